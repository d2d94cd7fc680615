"""The scheduler's HTTP routes (one module per resource) and their dependencies."""
