"""The contract between Rollout Ledger services: event schemas, subjects, settings, bus and DB helpers."""
