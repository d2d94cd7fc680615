"""Response models of the viewer's JSON API (``/v1/viewer``): what the pages read, columnar where it is long."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class BatchRowPublic(BaseModel):
    """One batch in the batch list."""

    batch_id: str
    env: str
    num_tasks: int
    group_size: int
    num_episodes: int
    counts: dict[str, int]
    """Episodes per status (statuses with none are left out)."""
    mean_reward: float | None
    created_at: datetime
    cancelled_at: datetime | None
    max_staleness: int | None


class BatchListPublic(BaseModel):
    """GET /v1/viewer/batches: the newest batches first."""

    total: int
    offset: int
    batches: list[BatchRowPublic]


class HistogramPublic(BaseModel):
    """Rewards of one env and weight version (``v3``, ``v2-3`` across a swap) in the batch-wide bins."""

    env: str
    version: str
    counts: list[int]
    n: int
    mean: float


class BatchSummaryPublic(BaseModel):
    """GET /v1/viewer/batches/{id}: progress, reward histograms, failures by class, filter choices."""

    batch_id: str
    env: str
    group_size: int
    num_tasks: int
    num_episodes: int
    counts: dict[str, int]
    done: bool
    created_at: datetime
    cancelled_at: datetime | None
    edges: list[float]
    """Bin edges shared by every histogram (``len(counts) + 1``)."""
    histograms: list[HistogramPublic]
    failures: dict[str, int]
    """Failed episodes by failure class."""
    attempt_failures: dict[str, dict[str, int]]
    """Every failed attempt by failure class: ``retried`` (another attempt followed) and ``final``."""
    envs: list[str]
    versions: list[int]
    statuses: list[str]
    failure_classes: list[str]


class EpisodeRowPublic(BaseModel):
    """One episode in a batch's filtered list."""

    episode_id: str
    group_id: str
    task_index: int
    group_index: int
    env: str
    status: str
    attempt: int
    reward: float | None
    num_turns: int | None
    stop_reason: str | None
    failure_class: str | None
    failure_reason: str | None
    versions: str
    """``v3``; ``v2-3`` across a weight swap; ``none``."""
    num_tokens: int | None
    num_sampled_tokens: int | None
    num_segments: int | None


class EpisodeListPublic(BaseModel):
    """GET /v1/viewer/batches/{id}/episodes: one page of the episodes matching the filters."""

    total: int
    offset: int
    episodes: list[EpisodeRowPublic]


class SiblingPublic(BaseModel):
    """One episode of a group, from the group's first divergence on."""

    episode_id: str
    group_index: int
    status: str
    reward: float | None
    failure_class: str | None
    versions: str
    num_tokens: int | None
    """Null: no trajectory recorded (yet)."""
    divergence: int | None
    """First position where it differs from the group's first sibling with a trajectory (its length when equal)."""
    start: int
    """Position of ``pieces[0]``."""
    pieces: list[str]
    origins: list[int]
    truncated: bool
    """More tokens follow ``pieces`` (open the trajectory for them)."""


class GroupPublic(BaseModel):
    """GET /v1/viewer/batches/{id}/groups/{task_index}: a group's siblings side by side."""

    batch_id: str
    task_index: int
    group_id: str
    common_prefix: int
    """Tokens every sibling with a trajectory shares from the start (the first divergence)."""
    prompt_len: int | None
    siblings: list[SiblingPublic]
    note: str | None = None


class TurnViewPublic(BaseModel):
    """A kept turn: its sampled span, the weights that sampled it, and the env's step answering it."""

    turn_index: int
    start: int
    end: int
    weight_version: int | None
    finish_reason: str | None
    engine: str | None
    generate_ms: float | None
    cached_tokens: int | None
    observation: str | None
    reward: float | None
    terminated: bool | None
    truncated: bool | None
    drift: str | None
    new_segment: bool
    step_info: dict[str, Any] = Field(default_factory=dict)
    version_changes: list[list[int]] = Field(default_factory=list)
    """``[position, version]`` where the weight version changes inside the turn (a swap in mode ``keep`` carried
    it across versions); empty for a turn of one version."""
    reused_from: str | None = None
    """The recorded step this turn was carried over from, when a resumed attempt kept it."""
    attempt: int | None = None
    """The attempt that generated the turn (an earlier one for a carried-over turn)."""


class ResumePublic(BaseModel):
    """How the trajectory's attempt resumed from the one before it."""

    mode: str
    from_attempt: int
    turns_recorded: int
    turns_unstepped: int
    reason: str
    turns_reused: int
    """Turns it carried over (its steps with ``reused_from``)."""


class SegmentViewPublic(BaseModel):
    """``[start, end)`` of a segment; from the second on, the drift class of the turn that started it."""

    start: int
    end: int
    drift: str | None
    turn_index: int | None


class FoldPublic(BaseModel):
    """Tokens ``[start, end)`` of a ``<tool_call>`` block, folded by default."""

    start: int
    end: int
    turn_index: int
    label: str


class AuditPublic(BaseModel):
    """A logprob audit of the trajectory: |trainer logprob - inference logprob| over its sampled tokens."""

    source: str
    checkpoint: str
    engine: str
    num_tokens: int
    mean_abs_delta: float
    p99_abs_delta: float
    max_abs_delta: float
    created_at: datetime
    token_logprobs: list[float | None] | None = None
    """The recomputed logprob of each sampled (loss-mask 1) token, in order: the k-th value belongs to the k-th
    token whose mask is 1 (null where it was not recomputed). Null for an audit that kept only the aggregates, or
    whose values do not match the trajectory's sampled tokens (``token_note`` says so)."""
    token_note: str | None = None


class TokenViewPublic(BaseModel):
    """GET /v1/viewer/episodes/{id}: the trajectory token by token (arrays of ``num_tokens``), with its turns,
    steps, segments, tool-call folds and audits."""

    episode_id: str
    batch_id: str
    group_id: str
    task_index: int
    group_index: int
    env: str
    attempt: int
    status: str
    failure_class: str | None
    failure_reason: str | None
    stop_reason: str | None
    reward: float | None
    num_tokens: int
    prompt_len: int
    num_sampled_tokens: int
    token_check: str | None
    token_ids: list[int]
    pieces: list[str] | None
    """Each token's text (special tokens as themselves); null when the tokenizer is unavailable (see ``note``)."""
    origins: list[int]
    """0 sampled, 1 environment, 2 template (``origin_names``)."""
    origin_names: list[str]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    """Per token; -1 where not sampled."""
    turns: list[TurnViewPublic]
    resume: ResumePublic | None = None
    """How this attempt resumed (null: the first attempt, or a release before resume)."""
    segments: list[SegmentViewPublic]
    folds: list[FoldPublic]
    audits: list[AuditPublic]
    note: str | None = None
