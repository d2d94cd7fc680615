"""Adapters of the client to trainers: ``trl``, ``verl`` and ``slime`` (each imports its trainer only when used)."""
