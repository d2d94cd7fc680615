"""The reference environment server: the built-in environments served over the remote actor protocol."""
