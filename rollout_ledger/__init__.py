"""Rollout Ledger, the durable, queryable system of record for RL rollouts: the contract (``shared/``), the services
(``services/``), the database's migrations (``migrations/``), the trainer's client package (``client/``) and the
``rollout`` command (``cli/``)."""
