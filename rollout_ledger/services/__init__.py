"""Rollout Ledger services: scheduler, env worker, inference worker, recorder, exporter, CLI."""
