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


class NewerContractError(SchemaError):
    """A message written at a newer major version of the event contract than this code reads.

    Not garbage: a newer producer in a rolling upgrade. Consumers park it (nak with a delay, a work item handed
    back for a newer worker) and count it; they never dead-letter or terminate it. Retryable: an upgraded
    consumer will read it."""

    retryable = True

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


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
