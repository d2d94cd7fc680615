"""The scheduler service: the HTTP API that stores batches of episodes and publishes their work items."""
