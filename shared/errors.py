"""Errors named after the boundary they crossed; each says whether a retry can help."""

from __future__ import annotations


class RolloutError(Exception):
    """Base of every error this project raises on purpose."""

    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class SchemaError(RolloutError):
    """A message or record did not match the contract (never retryable: the bytes will not change)."""


class BusError(RolloutError):
    """NATS could not be reached or refused an operation."""

    retryable = True


class StoreError(RolloutError):
    """Postgres could not be reached or refused a write."""

    retryable = True


class SchemaVersionError(RolloutError):
    """The database schema is not at the revision this code expects."""


class InferenceError(RolloutError):
    """No inference worker produced the turn within the retry budget."""


class EnvError(RolloutError):
    """The environment raised or answered with an error."""


class TokenizationError(RolloutError):
    """A rendering could not be tokenised consistently (recorded as drift, never raised to users)."""


class InfraError(RolloutError):
    """A private NATS/Postgres server could not be started or reached."""
