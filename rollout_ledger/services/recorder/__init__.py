"""The recorder service: writes the event stream to Postgres and assembles token-exact trajectories."""
