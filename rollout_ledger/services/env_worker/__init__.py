"""The environment worker: pulls episode work items, runs environments, asks inference workers for turns."""
