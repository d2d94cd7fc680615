"""The policy-version contract: what a trainer announces (a new checkpoint, as version N) and what each inference
worker reports about it, as carried in the KV buckets ``rl_policy`` and ``rl_policy_workers``.

A version is announced once and never changes; versions only increase. The announcement is durable (a KV bucket is
a JetStream stream): an inference worker that starts later reads the current version and serves it. Each worker
puts its own state under its id: ``announced`` (seen, not started) -> ``loading`` -> ``serving`` | ``failed``;
``retired`` once it serves a newer version. The models are tolerant readers, like the events (shared/events.py).
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_ledger.shared.errors import SchemaError

_M = TypeVar("_M", bound=BaseModel)

_TOLERANT = ConfigDict(extra="ignore", frozen=True)


def _now() -> datetime:
    return datetime.now(UTC)


class SwapMode(enum.StrEnum):
    """How an inference worker moves its running engine to a new version."""

    DRAIN = "drain"
    """Start no new turn, let the turns in flight finish on the old weights, swap, resume."""
    ABORT = "abort"
    """Abort the generations in flight, swap, and have their turns generated again on the new weights (tokens
    already kept keep their old version)."""
    KEEP = "keep"
    """Pause the generations in flight where they are, swap, and continue them on the new weights (a turn's tokens
    then carry two versions); refused by an engine that cannot."""


class WorkerPolicyState(enum.StrEnum):
    """Where one inference worker stands with one policy version."""

    ANNOUNCED = "announced"
    LOADING = "loading"
    SERVING = "serving"
    FAILED = "failed"
    RETIRED = "retired"


class PolicyAnnouncement(BaseModel):
    """The value of ``rl_policy`` / ``current``: the version every inference worker should serve."""

    model_config = _TOLERANT

    version: int = Field(ge=0)
    """The policy version (weight version); every token generated with these weights records it."""
    checkpoint: str = Field(min_length=1, max_length=4096)
    """Where the weights are: a Hugging Face directory (config, tokenizer, safetensors) every inference worker
    can read (a shared volume)."""
    mode: SwapMode = SwapMode.DRAIN
    """How running engines swap to it."""
    notes: str = ""
    created_at: datetime = Field(default_factory=_now)


class WorkerPolicyReport(BaseModel):
    """The value of ``rl_policy_workers`` / ``<worker id>``: what one inference worker serves and is doing."""

    model_config = _TOLERANT

    worker_id: str = Field(min_length=1)
    serving: int | None = None
    """The version it generates with now (None: not serving, e.g. starting, or its load failed at start)."""
    version: int = Field(ge=0)
    """The version this report's ``state`` is about (the newest it was told of)."""
    state: WorkerPolicyState
    error: str = ""
    """Why the load failed (``failed``)."""
    engine: str = ""
    time: datetime = Field(default_factory=_now)


def read_value(model: type[_M], value: bytes | None) -> _M | None:
    """A KV value of the policy buckets as ``model``; None for an empty (deleted) one, ``SchemaError`` for one that
    is not the agreed JSON."""
    if not value:
        return None
    try:
        return model.model_validate(orjson.loads(value))
    except (ValueError, ValidationError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise SchemaError(f"not a {model.__name__}: {exc}") from exc

