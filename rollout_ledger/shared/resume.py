"""The resume query: what an env worker starting attempt n > 1 asks the recorders for, and what they answer.

The recorders hold the episode's durable turns in Postgres (a turn and its step are stored before the work item
is acked). An attempt after the first asks for them on ``RESUME_SUBJECT`` (core NATS request, queue group
``RESUME_QUEUE``) and rebuilds its transcript from the answer instead of generating those turns again.

Which attempt is read: the episode's latest started attempt (``episodes.attempt``) below the asking one, and of
it the steps of turns ``0..k-1`` in a row from turn 0, each with the turn it names (a resumed attempt's steps
name turns of the attempt it resumed, so a chain of resumes reads the same turns). A long episode's answer comes
in pages: ``from_turn`` asks for the next one while ``more`` is set. msgpack like the events (token arrays as raw
little-endian bytes); readers are tolerant of fields they do not know.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_ledger.shared.arrays import Floats, TokenIds
from rollout_ledger.shared.errors import SchemaError

_TOLERANT = ConfigDict(extra="ignore", frozen=True, arbitrary_types_allowed=True)

_M = TypeVar("_M", bound=BaseModel)

PAGE_BYTES = 512 * 1024
"""Token bytes of one answer page at most (NATS's default max payload is 1 MiB)."""


class ResumeQuery(BaseModel):
    """Ask for the recorded turns of ``episode_id`` that attempt ``attempt`` may carry over."""

    model_config = _TOLERANT

    episode_id: str = Field(min_length=1, max_length=128)
    attempt: int = Field(ge=2)
    """The attempt that asks: only attempts below it are read."""
    from_turn: int = Field(0, ge=0)
    """The first turn of the page (0, then the turn after the previous page's last)."""
    from_attempt: int = Field(0, ge=0)
    """The attempt the first page was read from (later pages name it, so every page reads the same attempt)."""


class RecordedTurn(BaseModel):
    """One recorded turn with the step that kept it."""

    model_config = _TOLERANT

    turn_index: int = Field(ge=0)
    turn_event_id: str
    step_event_id: str
    token_ids: TokenIds
    logprobs: Floats
    finish_reason: str
    weight_version: int
    version_runs: list[tuple[int, int]] | None = None
    worker_id: str
    prompt_len: int = Field(ge=0)
    action: str
    observation: str
    observation_token_ids: TokenIds
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = Field(default_factory=dict)
    drift: str | None = None
    new_segment: bool = False
    env_state: Any = None


class ResumeRecord(BaseModel):
    """One page of an episode's recorded turns (``source_attempt`` 0: nothing that can be carried over)."""

    model_config = _TOLERANT

    episode_id: str
    source_attempt: int = Field(0, ge=0)
    prompt_token_ids: TokenIds | None = None
    """The source attempt's prompt (the replay's reset must render the same ids)."""
    turns: list[RecordedTurn] = Field(default_factory=list)
    more: bool = False
    """Another page follows, from the turn after this page's last."""
    unstepped_turns: int = Field(0, ge=0)
    """Turns of the source attempt after the kept ones that were generated (their step never recorded)."""
    reason: str = ""
    """Why nothing can be carried over, when ``source_attempt`` is 0."""


def encode(model: BaseModel) -> bytes:
    return msgpack.packb(model.model_dump(mode="python"), datetime=True)


def decode_query(data: bytes) -> ResumeQuery:
    return _decode(data, ResumeQuery)


def decode_record(data: bytes) -> ResumeRecord:
    return _decode(data, ResumeRecord)


def _decode(data: bytes, model: type[_M]) -> _M:
    try:
        raw = msgpack.unpackb(data, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise SchemaError(f"not a msgpack {model.__name__}: {type(exc).__name__}: {exc}") from exc
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise SchemaError(f"malformed {model.__name__}: {exc.errors()[:3]}") from exc
