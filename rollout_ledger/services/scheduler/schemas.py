"""HTTP request and response models of the scheduler API, kept apart from the bus events of shared/events.py.

Families follow full-stack-fastapi-template: ``*Base`` holds the shared fields, ``*Create`` what a client
sends, ``*Public`` what the API returns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from rollout_ledger.shared.events import ContextPolicy, SamplingParams
from rollout_ledger.shared.policy_versions import SwapMode, WorkerPolicyState

BATCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
EPISODE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}\.[0-9]{1,9}\.[0-9]{1,9}$"
"""``{batch_id}.{task_index}.{group_index}`` (planning.episode_id)."""
INT32_MAX = 2**31 - 1


def _is_number(annotation: Any) -> bool:
    return any(a in (int, float) for a in (get_args(annotation) or (annotation,)))


class NoCoercion(BaseModel):
    """Numbers of a request are JSON numbers: ``true`` or ``"5"`` where a number belongs is a 422 (pydantic's lax
    mode would read them as 1 and 5, accepting what the schema calls invalid). ``5.0`` stays an integer 5, as JSON
    Schema says."""

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None or not _is_number(field.annotation) or not isinstance(value, bool | str):
            return value
        integer = int in (get_args(field.annotation) or (field.annotation,))
        raise PydanticCustomError(
            "int_type" if integer else "float_type", "Input should be a valid {kind}, not a {given}",
            {"kind": "integer" if integer else "number", "given": "boolean" if isinstance(value, bool) else "string"})


class SamplingRequest(NoCoercion, SamplingParams):
    """``sampling`` of a request: the event's fields, strictly (a misspelt field is a 422 here, while the bus
    contract ignores fields it does not know; see docs/architecture.md, "Contract evolution")."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ContextRequest(NoCoercion, ContextPolicy):
    """``context`` of a request, strictly (see ``SamplingRequest``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchBase(NoCoercion):
    """What defines how every episode of a batch runs."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1, max_length=128, examples=["arithmetic"])
    """Registered environment name (see GET /v1/envs)."""
    group_size: int = Field(1, ge=1, le=INT32_MAX)
    """Samples per task (a GRPO group)."""
    sampling: SamplingRequest = Field(default_factory=SamplingRequest)
    """Sampling parameters for every turn."""
    max_turns: int = Field(1, ge=1, le=10000)
    """Turn budget per episode; reaching it truncates the episode."""
    context: ContextRequest | None = None
    """Context policy: ``{"policy": "full"}`` (default) or ``{"policy": "window", "window_turns": N}`` (system
    message + last N turns, each turn its own training sample)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form client data stored with the batch (at most ``ROLLOUT_MAX_METADATA_BYTES`` as JSON, else 413)."""
    max_staleness: int | None = Field(None, ge=0, le=1_000_000)
    """k: an episode starts only while (current policy version - the version it would be generated with) <= k;
    until then it waits (status ``waiting``, no work item). Null: the deployment's ``ROLLOUT_MAX_STALENESS``, and
    when that is unset too, episodes start at once (no bound)."""
    episodes_per_version: int | None = Field(None, ge=1, le=INT32_MAX)
    """B, the trainer's consumption per policy version: with it, admission also bounds the run-ahead of generation
    beyond what the trainer has consumed to (current - base + k + 1) x B episodes (AReaL's rule; base = the
    version announced when the batch was stored). A multiple of ``group_size`` (whole groups are admitted); needs
    a staleness bound."""


class BatchCreate(BatchBase):
    """POST /v1/batches: tasks inline; a client-supplied ``batch_id`` makes the request idempotent."""

    tasks: list[dict[str, Any]] = Field(min_length=1, examples=[[{"seed": 0}, {"seed": 1}]])
    """The tasks, each handed to ``env.reset`` (at least one; tasks x group_size at most
    ``ROLLOUT_MAX_BATCH_EPISODES`` and each at most ``ROLLOUT_MAX_TASK_BYTES`` as JSON, else 413)."""
    batch_id: str | None = Field(None, pattern=BATCH_ID_PATTERN)
    """Client-supplied id; repeating the same request with it returns the existing batch."""


class AdmissionPublic(BaseModel):
    """Where a bounded batch's admission stands (services/scheduler/admission.py)."""

    max_staleness: int
    """k in force for the batch (its own or the deployment's)."""
    episodes_per_version: int | None
    base_version: int
    """The announced version when the batch was stored."""
    current_version: int
    """The version announced now (the newest a trainer pushed)."""
    serving_version: int
    """The lowest version a live inference worker serves (the version a starting episode would run on)."""
    admitted: int
    """Episodes admitted so far (every status but waiting)."""
    waiting: int
    limit: int | None
    """How many may be admitted in all at the current version (run-ahead bound); null without one."""
    held: str | None
    """Why waiting episodes are held now; null when none wait or they are about to be admitted."""


class BatchCreatedPublic(BaseModel):
    """Answer to POST /v1/batches (201 for a new batch, 200 for a repeated one)."""

    batch_id: str
    created: bool
    """False when the batch already existed with the same request."""
    env: str
    num_tasks: int
    group_size: int
    num_episodes: int
    request_hash: str
    """sha256 of the canonical request; a repeat with another hash is refused with 409."""
    episode_ids: list[str]
    """``{batch_id}.{task_index}.{group_index}``, task-major."""
    num_published: int
    """Work items on the work queue so far; the outbox publishes the rest."""
    num_waiting: int = 0
    """Episodes held by admission (the batch bounds staleness): they get their work item when the bound allows."""
    status_url: str
    created_at: datetime


class BatchPublic(BatchBase):
    """GET /v1/batches/{id}: the batch and how far its episodes got."""

    model_config = ConfigDict(extra="ignore")

    batch_id: str
    num_tasks: int
    num_episodes: int
    counts: dict[str, int]
    """Episodes per status (every status present, 0 when none)."""
    num_published: int
    num_trajectories: int
    mean_reward: float | None
    """Mean reward over finished (completed, truncated, aborted) episodes; null when none."""
    done: bool
    """Every episode is in a terminal status."""
    admission: AdmissionPublic | None = None
    """The staleness bound's state when the batch has one (``counts.waiting``: episodes it holds)."""
    waiting_for_env: dict[str, int] = Field(default_factory=dict)
    """``{env: n}`` when no live env worker has the batch's env: its ``n`` episodes not started yet wait on the work
    queue (they do not fail) until a worker with the env starts. Empty otherwise."""
    created_at: datetime
    cancelled_at: datetime | None


class BatchCancelPublic(BaseModel):
    """POST /v1/batches/{id}/cancel."""

    batch_id: str
    cancelled_at: datetime
    cancelled_now: int
    """Episodes still waiting (requested) that this call moved to cancelled; running ones end between turns."""
    counts: dict[str, int]


class TurnPublic(BaseModel):
    """One sampled turn (a try of an attempt); ``superseded`` when the episode did not keep it."""

    event_id: str
    attempt: int
    turn_index: int
    prompt_len: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    engine: str
    worker_id: str
    queue_ms: float
    generate_ms: float
    cached_tokens: int | None
    superseded: bool
    produced_at: datetime
    recorded_at: datetime


class StepPublic(BaseModel):
    """One environment step; ``superseded`` when it belongs to an attempt the episode did not keep."""

    event_id: str
    attempt: int
    turn_index: int
    turn_event_id: str
    action: str
    observation: str
    observation_token_ids: list[int]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    step_ms: float
    superseded: bool
    produced_at: datetime
    recorded_at: datetime


class EpisodePublic(BaseModel):
    """GET /v1/episodes/{id}: the episode row with all its turns and steps."""

    id: str
    batch_id: str
    group_id: str
    group_index: int
    task_index: int
    env: str
    task: dict[str, Any]
    status: str
    attempt: int
    reward: float | None
    num_turns: int | None
    stop_reason: str | None
    failure_class: str | None
    failure_reason: str | None
    worker_id: str | None
    weight_versions: list[int] | None
    prompt_token_ids: list[int] | None
    prompt_text: str | None
    published_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    turns: list[TurnPublic]
    steps: list[StepPublic]


class SpanPublic(BaseModel):
    """A contiguous part of a trajectory's token sequence."""

    kind: Literal["prompt", "sampled", "observation", "context"]
    """``context``: a segment's re-rendered context (the chat template or a context policy rewrote history)."""
    start: int
    end: int
    """Exclusive."""
    turn_index: int | None
    """The turn that sampled the span, or that the observation answers; null for the prompt."""
    text: str | None


class TrajectoryPublic(BaseModel):
    """GET /v1/episodes/{id}/trajectory: the token-exact trajectory, decoded where the tokenizer is present."""

    episode_id: str
    batch_id: str
    group_id: str
    env: str
    attempt: int
    status: str
    failure_class: str | None
    reward: float | None
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    min_weight_version: int | None = None
    """The lowest weight version of its sampled tokens (None: no sampled token)."""
    max_weight_version: int | None = None
    """The highest; a trajectory generated across a weight swap spans more than one."""
    mixed_versions: bool = False
    """Its sampled tokens came from more than one policy version."""
    action_ranges: list[list[int]]
    prompt_len: int
    num_tokens: int
    num_sampled_tokens: int
    num_turns: int
    segments: list[list[int]]
    """``[start, end)`` of each segment: a context the policy saw, trained on as its own sample."""
    num_segments: int
    token_check: str | None
    """``ok`` when every segment decodes to the chat template's rendering of its conversation."""
    drifts: list[dict[str, Any]]
    """Turns whose rendering did not extend the context, with their drift class."""
    created_at: datetime
    text: str | None
    """The whole sequence decoded (special tokens kept); null when the tokenizer is unavailable."""
    spans: list[SpanPublic]
    note: str | None = None
    """Why ``text`` is missing, when it is."""


class EnvPublic(BaseModel):
    """An environment some env worker registered in the KV bucket ``rl_envs``."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    multi_turn: bool = False
    example_task: dict[str, Any] = Field(default_factory=dict)
    registered_by: str = ""
    route: str = ""
    """What its work items are routed by (its family or its own name; the name when the advert names none): only env
    workers with the route get them."""
    family: str = ""
    """Set on a family's one entry (``name`` ``<family>:*``): submit a batch with one of its ``members``."""
    members: list[str] = Field(default_factory=list)
    """The envs of a family (``rg:leg_counting``, ...); empty for a single env."""


class EnvListPublic(BaseModel):
    """GET /v1/envs."""

    envs: list[EnvPublic]


class ErrorPublic(BaseModel):
    """Every non-validation error: one sentence saying what is wrong."""

    detail: str


class FieldErrorPublic(BaseModel):
    """One invalid field of a request."""

    loc: list[str | int]
    """Where: ``body``/``path`` then the keys and indexes down to the value."""
    field: str
    """``loc`` without its first element, dotted (``tasks.3.prompt``); ``body`` for the body as a whole."""
    msg: str
    """What is wrong with it."""
    type: str
    """A machine-readable kind (``int_out_of_range``, ``string_nul``, ``too_deep``, pydantic's types, ...)."""


class ValidationErrorPublic(BaseModel):
    """422: every invalid field of the request, and one line summing them up."""

    detail: list[FieldErrorPublic]
    message: str


class PolicyVersionCreate(NoCoercion):
    """POST /v1/policy/versions: a trainer announces new weights as the next policy version."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**31 - 1, examples=[1])
    """The new version: above every version announced so far (the same request again is idempotent)."""
    checkpoint: str = Field(min_length=1, max_length=4096, examples=["/checkpoints/run-7/step-100"])
    """Where the weights are: a Hugging Face directory (config, tokenizer, safetensors) the inference workers can
    read."""
    mode: SwapMode = SwapMode.DRAIN
    """How running engines swap: ``drain`` (finish the turns in flight first), ``abort`` (generate them again on
    the new weights) or ``keep`` (continue them on the new weights, where the engine can)."""
    notes: str = Field("", max_length=10_000)
    """Free text stored with the version (the trainer's step, its metrics, ...)."""


class PolicyVersionPublic(BaseModel):
    """One announced policy version."""

    version: int
    checkpoint: str
    mode: SwapMode
    notes: str
    created_at: datetime
    created: bool = False
    """In a POST's answer: True when this request recorded it (201), False for a repeat (200)."""
    announced: bool = True
    """In a POST's answer: the version is the current one on the bus (False: a newer one already is)."""


class WorkerPolicyPublic(BaseModel):
    """What one inference worker serves and is doing (from its latest report)."""

    worker_id: str
    serving: int | None
    """The version it generates with now."""
    version: int
    """The version ``state`` is about (the newest it was told of)."""
    state: WorkerPolicyState
    error: str = ""
    engine: str = ""
    reported_at: datetime


class PolicyPublic(BaseModel):
    """GET /v1/policy: the current version, what each inference worker serves, episodes in flight per version."""

    current: PolicyVersionPublic | None
    """The newest announced version (None before the first announcement: workers serve their start weights)."""
    workers: list[WorkerPolicyPublic]
    in_flight: dict[str, int]
    """Running episodes by the weight version of their latest turn (``none``: no turn yet)."""

