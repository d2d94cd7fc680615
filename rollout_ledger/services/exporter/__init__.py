"""The training exporter: reads trajectories from Postgres and writes trainer-ready files."""
