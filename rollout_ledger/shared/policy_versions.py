"""The policy-version contract: what a trainer announces (a new checkpoint, as version N), what each inference
worker reports about it and what each env worker reports about the episodes it holds back for it, as carried in the
KV buckets ``rl_policy``, ``rl_policy_workers`` and ``rl_policy_env``; and the pure rules read from those reports
(whether an env worker has drained for a version, which inference workers do not serve it yet).

A version is announced once and never changes; versions only increase. The announcement is durable (a KV bucket is
a JetStream stream): an inference worker that starts later reads the current version and serves it. Each worker
puts its own state under its id: ``announced`` (seen, not started) -> ``loading`` -> ``serving`` | ``failed``;
``retired`` once it serves a newer version. The models are tolerant readers, like the events (shared/events.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
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
    """Start no new episode, let the episodes in flight finish on the old weights, swap, resume: no episode spans
    the two versions (env workers hold new episodes back and report when they have drained; inference workers
    wait for that, for at most their ``episode_drain_timeout_s``, then drain the turns in flight and swap)."""
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


class EnvPolicyState(enum.StrEnum):
    """Where one env worker stands with the announced versions."""

    RUNNING = "running"
    """It starts episodes."""
    DRAINING = "draining"
    """It starts no new episode (a ``drain`` announcement that not every live inference worker serves yet) and
    episodes it started before are still running."""
    DRAINED = "drained"
    """It starts no new episode and none is running: an inference worker may swap without mixing versions in this
    worker's episodes."""


class EnvPolicyReport(BaseModel):
    """The value of ``rl_policy_env`` / ``<env worker id>``: whether one env worker holds new episodes back for a
    ``drain`` announcement, and whether its running episodes have finished."""

    model_config = _TOLERANT

    worker_id: str = Field(min_length=1)
    version: int = Field(ge=0)
    """The newest announced version this worker knows of."""
    state: EnvPolicyState
    paused_for: int | None = None
    """The version it holds new episodes back for (``draining``, ``drained``)."""
    drained_for: int | None = None
    """The newest version it drained for (none of its episodes running while it held new ones back)."""
    running: int = Field(0, ge=0)
    """Episodes running on this worker now."""
    held: int = Field(0, ge=0)
    """Work items it took and holds back (not started; they start when it resumes)."""
    time: datetime = Field(default_factory=_now)


def drained_for(report: EnvPolicyReport, version: int) -> bool:
    """True while the env worker holds new episodes back and none runs, for ``version`` or a newer one: an
    inference worker may swap to ``version`` without an episode of this worker spanning the swap."""
    return (report.state is EnvPolicyState.DRAINED and report.drained_for is not None
            and report.drained_for >= version)


def envs_not_drained(reports: Mapping[str, EnvPolicyReport], version: int) -> list[str]:
    """The env workers (of ``reports``, the live ones) an inference worker still waits for before a ``drain`` swap
    to ``version``; sorted."""
    return sorted(key for key, report in reports.items() if not drained_for(report, version))


def settled_on(report: WorkerPolicyReport, version: int) -> bool:
    """True when the inference worker serves ``version`` (or a newer one), or refused it (``failed``: it keeps its
    older version, and waiting for it would be waiting forever)."""
    if report.serving is not None and report.serving >= version:
        return True
    return report.version >= version and report.state is WorkerPolicyState.FAILED


def workers_behind(reports: Mapping[str, WorkerPolicyReport], version: int,
                   alive: Callable[[str], bool] | None = None) -> list[str]:
    """The inference workers (of ``reports``, those ``alive`` says live) that do not serve ``version`` yet and have
    not refused it: an env worker holding new episodes back for ``version`` resumes when there are none; sorted."""
    return sorted(key for key, report in reports.items()
                  if (alive is None or alive(report.worker_id)) and not settled_on(report, version))


def read_value(model: type[_M], value: bytes | None) -> _M | None:
    """A KV value of the policy buckets as ``model``; None for an empty (deleted) one, ``SchemaError`` for one that
    is not the agreed JSON."""
    if not value:
        return None
    try:
        return model.model_validate(orjson.loads(value))
    except (ValueError, ValidationError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise SchemaError(f"not a {model.__name__}: {exc}") from exc

