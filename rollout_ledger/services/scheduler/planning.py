"""Pure batch planning: the canonical request and its hash, the ids of a batch's episodes and its run spec."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_ledger.services.scheduler.schemas import BatchCreate
from rollout_ledger.shared.events import ContextPolicy, SamplingParams
from rollout_ledger.shared.ids import episode_id, group_id

__all__ = ["BatchRunSpec", "PlannedEpisode", "canonical_request", "episode_id", "group_id", "json_size",
           "new_batch_id", "plan_episodes", "request_hash"]


def new_batch_id() -> str:
    """A generated batch id (``uuid4().hex``)."""
    return uuid.uuid4().hex


OPTIONAL_FIELDS = ("context", "max_staleness", "episodes_per_version")
"""Request fields added after the first release: left out of the canonical request when not given, so the hash of
a request that does not use them is what it was before they existed."""


def canonical_request(req: BatchCreate) -> bytes:
    """The request as canonical JSON (sorted keys, defaults filled in, without ``batch_id``; without the
    ``OPTIONAL_FIELDS`` that are not given)."""
    exclude = {"batch_id", *(name for name in OPTIONAL_FIELDS if getattr(req, name) is None)}
    body = req.model_dump(mode="json", exclude=exclude)
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def request_hash(req: BatchCreate) -> str:
    """sha256 hex of the canonical request: equal for the same request whatever its key order or omitted defaults."""
    return hashlib.sha256(canonical_request(req)).hexdigest()


def json_size(value: dict[str, Any]) -> int:
    """Bytes of a task's (or the metadata's) JSON encoding: a task travels inside one work item."""
    return len(orjson.dumps(value))



@dataclass(frozen=True)
class PlannedEpisode:
    """One episode of a batch: its ids and its task."""

    id: str
    batch_id: str
    group_id: str
    task_index: int
    group_index: int
    env: str
    task: dict[str, Any]

    def row(self) -> dict[str, Any]:
        """The ``episodes`` row to insert (status and timestamps from the column defaults)."""
        return {
            "id": self.id,
            "batch_id": self.batch_id,
            "group_id": self.group_id,
            "task_index": self.task_index,
            "group_index": self.group_index,
            "env": self.env,
            "task": self.task,
        }


def plan_episodes(batch_id: str, env: str, tasks: list[dict[str, Any]], group_size: int) -> list[PlannedEpisode]:
    """Every (task, sample) of a batch, task-major, with ids per the project's id scheme (``shared/ids.py``)."""
    return [
        PlannedEpisode(
            id=episode_id(batch_id, t, g),
            batch_id=batch_id,
            group_id=group_id(batch_id, t),
            task_index=t,
            group_index=g,
            env=env,
            task=task,
        )
        for t, task in enumerate(tasks)
        for g in range(group_size)
    ]


@dataclass(frozen=True)
class BatchRunSpec:
    """What every work item of a batch shares."""

    env: str
    group_size: int
    max_turns: int
    sampling: SamplingParams
    context: ContextPolicy | None = None

    @classmethod
    def of(cls, body: BatchCreate) -> BatchRunSpec:
        """The spec of a batch request: its sampling and context as the bus models of the same values (the request
        models are strict about fields; the bus models tolerate a newer producer's, docs/architecture.md)."""
        context = ContextPolicy.model_validate(body.context.model_dump()) if body.context is not None else None
        return cls(body.env, body.group_size, body.max_turns, SamplingParams.model_validate(body.sampling.model_dump()),
                   context)
