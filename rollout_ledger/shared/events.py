"""The event contract: every message a service puts on the bus, as one discriminated union.

Rules (pinned by tests/contract):
- every event has ``event_id`` (also its ``Nats-Msg-Id``, so a re-publish is deduplicated), ``type``,
  ``schema_version``, ``episode_id``, ``batch_id``, ``attempt``, ``seq``, ``produced_by`` and ``time``;
- ``event_id`` is deterministic for a logical event (episode, attempt, position, try), so a producer that
  retries a publish produces the same id;
- readers are tolerant: a field they do not know is ignored (a newer producer may add optional fields with
  defaults at any time, without a version change), so old and new pods run side by side in a rolling upgrade;
- ``schema_version`` is the contract's major version. Removing or retyping a field, making a field required, or
  adding an event type raises it. ``decode`` refuses an event of a newer major with ``NewerContractError``
  (never a plain ``SchemaError``): consumers park such an event (nak with a delay, or a work item handed back
  for a newer worker) and count it; they never dead-letter or terminate it. See docs/architecture.md,
  "Contract evolution".

``seq`` orders the events of one attempt: started is 0, turn ``t`` is ``2t+1``, its step ``2t+2``, and the
terminal event is ``2T+1`` where T is the number of turns.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgpack
import numpy as np
import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

from rollout_ledger.shared.arrays import Floats, TokenIds
from rollout_ledger.shared.errors import NewerContractError, SchemaError

SCHEMA_VERSION = 1
"""The contract's major version this code writes and reads (events of any lower major are read too)."""

_TOLERANT = ConfigDict(extra="ignore", frozen=True)
"""Every model of the contract: unknown fields (from a newer producer) are ignored, not an error."""

_M = TypeVar("_M", bound=BaseModel)


def utcnow() -> datetime:
    return datetime.now(UTC)


class ToolCallConstraint(BaseModel):
    """A turn that must be one hermes tool call: exactly ``<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>``
    (N one of ``names``, the arguments a JSON object, written as ``json.dumps`` writes it), then end of turn."""

    model_config = _TOLERANT

    names: list[str] = Field(min_length=1)
    """The functions the call may name."""
    parameters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """JSON schema of a name's arguments (the tool's ``parameters``); a name without one takes any JSON object."""


class SamplingParams(BaseModel):
    """Sampling parameters passed to the engine for every turn of an episode."""

    model_config = _TOLERANT

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k cut-off; -1 disables it."""
    max_tokens: int = Field(256, ge=1, le=131072)
    """New tokens per turn at most (also bounded by the context left)."""
    min_tokens: int = Field(0, ge=0, le=131072)
    """New tokens per turn at least: neither the end-of-turn id nor a stop string ends a turn before it (vLLM's
    ``min_tokens``); a turn still ends at ``max_tokens`` or the context limit (the engines take the smaller of the
    two; the REST API refuses a floor above ``max_tokens`` with a 400). 0: no floor."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings."""
    seed: int | None = None
    """Per-request seed, for reproducible sampling."""
    logprobs: int = Field(0, ge=0, le=20)
    """Top-k alternatives to record per token besides the sampled one (0: only the sampled token's)."""
    tool_call: ToolCallConstraint | None = None
    """Constrain the turn to one tool call (the session endpoint's ``tool_choice`` ``required`` or a named function);
    an engine that cannot enforce it refuses the request. None: unconstrained."""

    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({"tool_call", "min_tokens"})
    """Left out of every dump while default (nested in events too): a previous-release reader refuses unknown
    fields, so the field reaches it only when it says something."""

    @model_serializer(mode="wrap")
    # no return annotation: pydantic would take it for the model's serialization schema (a bare dict)
    def _omit_at_default(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        out: dict[str, Any] = handler(self)
        for name in self.OMIT_AT_DEFAULT:
            if getattr(self, name) == type(self).model_fields[name].default:
                out.pop(name, None)
        return out


class ContextPolicy(BaseModel):
    """Which part of the conversation each turn of an episode is generated from."""

    model_config = _TOLERANT

    policy: Literal["full", "window"] = "full"
    """``full``: the whole conversation (one segment per episode unless the template rewrites history);
    ``window``: the system message and the last ``window_turns`` turns, re-rendered before every turn, so each
    turn is a segment of its own: its own training sample."""
    window_turns: int = Field(2, ge=1, le=10000)
    """Turns a window holds (a turn: the messages before an assistant reply and that reply; the newest
    messages, which the next reply answers, count as one)."""


class FinishReason(enum.StrEnum):
    """Why the engine stopped generating a turn."""

    STOP = "stop"
    """End-of-sequence token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` or the context limit reached."""
    ABORT = "abort"
    """Cancelled before the end."""


class TrajectoryStatus(enum.StrEnum):
    """How an episode's trajectory ended (the status a trainer sees)."""

    COMPLETED = "completed"
    """The environment terminated the episode."""
    TRUNCATED = "truncated"
    """``max_turns`` or the context length cut the episode short."""
    ABORTED = "aborted"
    """The environment or agent gave up (e.g. a malformed tool call with abort-on-error)."""
    FAILED = "failed"
    """A failure ended the episode; see its failure class."""


class FailureClass(enum.StrEnum):
    """The boundary an episode failure crossed; each has its own retry budget."""

    INFRA = "infra"
    """A worker process died or the bus/store could not be reached, past its redelivery budget."""
    INFERENCE = "inference"
    """No inference worker answered within the retry budget, or the engine rejected the request."""
    ENV = "env"
    """The environment raised or answered with an error."""
    AGENT = "agent"
    """User agent code raised."""
    TIMEOUT = "timeout"
    """The episode ran past its deadline."""


class ResumeMode(enum.StrEnum):
    """How an attempt after the first got back the state of the one before it."""

    REPLAY = "replay"
    """The env was reset with the same task and the recorded actions applied again, every observation compared
    with the recorded one; the recorded turns are kept, not generated again."""
    SNAPSHOT = "snapshot"
    """The env restored the state it returned after the last recorded step (``Env.restore``)."""
    AGENT_REPLAY = "agent_replay"
    """An agent function ran again; each model call it repeated was answered from the recorded turns, token-exact,
    until the first new call."""
    RESTART = "restart"
    """Started again from turn 0: the env cannot be restored, nothing was recorded, or the replay diverged
    (``ResumeInfo.reason`` says which)."""


class ResumeInfo(BaseModel):
    """Where an attempt resumed (``EpisodeStarted.resume``)."""

    model_config = _TOLERANT

    mode: ResumeMode
    from_attempt: int = Field(0, ge=0)
    """The attempt whose recorded turns were read (0: none was read)."""
    turns_recorded: int = Field(0, ge=0)
    """Turns of that attempt recorded with their steps (what could be kept)."""
    turns_reused: int = Field(0, ge=0)
    """Recorded turns this attempt carries over at its start (an agent replay counts its repeated calls in its
    steps' ``reused_from`` instead, as the agent makes them)."""
    turns_unstepped: int = Field(0, ge=0)
    """Turns of that attempt generated but never followed by a recorded step (in flight at the crash): generated
    again."""
    reason: str = ""
    """Why the attempt fell back to ``restart`` (or what limited the reuse); empty when it resumed as planned."""


def token_versions(n: int, weight_version: int, runs: list[tuple[int, int]] | None) -> np.ndarray:
    """Per-token weight versions of a turn of ``n`` ids from its runs (``TurnGenerated.version_runs``)."""
    out = np.full(n, weight_version, dtype=np.int32)
    if not runs:
        return out
    ends = [r[0] for r in runs[1:]] + [n]
    for (start, version), end in zip(runs, ends, strict=True):
        out[max(0, start):max(0, min(end, n))] = version
    return out


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, arbitrary_types_allowed=True)

    type: str
    """The event type (each subclass pins it to a literal: the union's discriminator)."""
    event_id: str = Field(min_length=1, max_length=256)
    """Unique and deterministic per logical event; the ``Nats-Msg-Id`` it is published with."""
    schema_version: int = Field(SCHEMA_VERSION, ge=1, strict=True)
    """The contract's major version the producer wrote (see the module docstring)."""
    episode_id: str = Field(min_length=1, max_length=128)
    """The episode this event belongs to."""
    batch_id: str = Field(min_length=1, max_length=128)
    """The batch of the episode."""
    attempt: int = Field(ge=1)
    """Delivery attempt of the episode (1 for the first run; a redelivery after a crash is 2, ...)."""
    seq: int = Field(ge=0)
    """Position of the event within its attempt (see module docstring)."""
    produced_by: str = Field(min_length=1)
    """``service/worker-id`` of the producer."""
    time: datetime = Field(default_factory=utcnow)
    """When the producer created the event (UTC)."""


EventBase = _Event
"""The envelope every event type extends (for type hints of code that handles any event)."""


class EpisodeRequested(_Event):
    """Work item: run one episode. Published by the scheduler on the work queue."""

    type: Literal["episode.requested"] = "episode.requested"
    env: str
    """Registered environment name."""
    task: dict[str, Any]
    """The task handed to ``env.reset``."""
    group_id: str
    """GRPO group: the episodes of one task in one batch share it."""
    group_index: int = Field(ge=0)
    """Index of this sample within its group."""
    group_size: int = Field(ge=1)
    """Samples per task in this batch."""
    sampling: SamplingParams
    """Sampling parameters for every turn."""
    max_turns: int = Field(ge=1)
    """Turn budget; reaching it truncates the episode."""
    context: ContextPolicy | None = None
    """The batch's context policy; None: full history."""
    attempt_base: int = Field(0, ge=0)
    """Attempts of the episode before this work item: 0 from the scheduler; a retried episode's next work item
    carries the attempt that failed. An env worker runs the item as attempt ``attempt_base`` + its JetStream
    delivery count, so every attempt (and every event id) stays distinct."""
    failures: dict[str, int] = Field(default_factory=dict)
    """Failed attempts so far by failure class (``{"env": 1}``): what the per-class retry budgets count."""


class EpisodeStarted(_Event):
    """An env worker reset the environment and rendered the prompt."""

    type: Literal["episode.started"] = "episode.started"
    env: str
    worker_id: str
    """Env worker running this attempt."""
    prompt_token_ids: TokenIds
    """The rendered prompt, tokenised once."""
    prompt_text: str
    """The chat template's rendering of the initial messages."""
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The initial chat messages returned by ``env.reset``."""
    resume: ResumeInfo | None = None
    """Set on an attempt after the first: where it resumed from, how, and why it fell back (None: attempt 1, or
    an env worker of a release before resume)."""

    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({"resume"})
    """Left off the wire while unset, so a first attempt's event is what it was before resume existed."""


class InferenceRequested(_Event):
    """A request for one turn, sent to an inference worker (core NATS request, not stored on the stream)."""

    type: Literal["inference.requested"] = "inference.requested"
    request_id: str
    """Unique per try: ``{episode}:{attempt}:t{turn}:r{try}``. Also the event id of the resulting turn."""
    turn_index: int = Field(ge=0)
    prompt_token_ids: TokenIds
    """The whole context so far: prompt ids, sampled ids and observation ids, verbatim."""
    sampling: SamplingParams
    max_tokens: int = Field(ge=1)
    """New tokens allowed for this turn (sampling.max_tokens bounded by the context left)."""
    reply_seq: int = Field(ge=0)
    """The ``seq`` the resulting turn event carries."""
    record: bool = True
    """Whether the turn is the policy's: published as ``TurnGenerated`` on RL_EVENTS before the reply. False for
    an environment's own generation (a simulated user, env_worker/env_llm.py): only answered, never recorded; the
    env hands its text to the episode as an observation."""

    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({"record"})
    """Left off the wire while default (``encode``): a previous-release inference worker refuses unknown fields."""


class TurnGenerated(_Event):
    """One sampled turn: published by the inference worker and sent back to the requester."""

    type: Literal["turn.generated"] = "turn.generated"
    request_id: str
    """The request this answers (equals ``event_id``)."""
    turn_index: int = Field(ge=0)
    prompt_len: int = Field(ge=0)
    """Context length the turn was generated from."""
    token_ids: TokenIds
    """The sampled ids, exactly as the engine returned them."""
    logprobs: Floats
    """Logprob of each sampled id under the inference engine (same length as ``token_ids``)."""
    top_logprobs: list[dict[int, float]] | None = None
    """Optional top-k alternatives per position."""
    finish_reason: FinishReason
    weight_version: int
    """Version of the policy weights that sampled this turn."""
    engine: str
    """Engine name (``vllm``, ``fake``)."""
    worker_id: str
    """Inference worker that served the request."""
    queue_ms: float = Field(ge=0)
    """Time from receipt to the engine starting the request."""
    generate_ms: float = Field(ge=0)
    """Time in the engine."""
    cached_tokens: int | None = None
    """Prompt tokens served from the engine's prefix cache, when the engine reports it."""
    version_runs: list[tuple[int, int]] | None = None
    """Set when the turn straddles a weight swap in mode ``keep``: ``[(start, version), ...]``, from token
    ``start`` on (up to the next run) the ids were sampled by ``version``; the first run starts at 0 and
    ``weight_version`` is its version (the oldest: a reader that knows only ``weight_version`` over-counts the
    turn's staleness, never under-counts it). None: every id was sampled by ``weight_version``."""

    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({"version_runs"})
    """Left off the wire while unset: a turn on one version is what it was before ``keep`` existed."""

    def token_versions(self) -> np.ndarray:
        """The weight version of each sampled id (int32, the length of ``token_ids``)."""
        return token_versions(len(self.token_ids), self.weight_version, self.version_runs)


class StepCompleted(_Event):
    """The environment took the turn's action and answered."""

    type: Literal["step.completed"] = "step.completed"
    turn_index: int = Field(ge=0)
    turn_event_id: str
    """The turn (``TurnGenerated.event_id``) whose sampled ids the episode kept."""
    action: str
    """The sampled text handed to the environment."""
    observation: str
    """Environment text appended after the turn ('' when the episode ends)."""
    observation_token_ids: TokenIds
    """Ids the chat template adds after the sampled ids (observation plus template tokens), mask 0."""
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = Field(default_factory=dict)
    step_ms: float = Field(0.0, ge=0)
    """Time in ``env.step`` and tokenisation."""
    drift: str | None = None
    """Why this turn's rendering did not extend the context token-exactly (a ``Drift`` class of the env worker's
    tokenisation: the template rewrote history, the agent rewrote its messages, a context window), else None."""
    new_segment: bool = False
    """``observation_token_ids`` is the whole re-rendered context of the next turn (mask 0): a new segment of the
    trajectory starts with it (a trainer trains on each segment as its own sample)."""
    reused_from: str | None = None
    """Set when a resumed attempt carries this turn over from an earlier attempt: the recorded step it repeats
    (its ``turn_event_id`` names the recorded turn, not a new generation). None: the turn was played in this
    attempt."""
    env_state: Any = None
    """A ``snapshot`` env's serialisable state after this step (``Env.snapshot``), stored with the step: what a
    resumed attempt restores instead of replaying the actions. None for other envs."""

    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({"reused_from", "env_state"})
    """Left off the wire while unset: a step of a first attempt is what it was before resume existed."""


class EpisodeFinished(_Event):
    """The episode ended with a trajectory (completed, truncated or aborted)."""

    type: Literal["episode.finished"] = "episode.finished"
    status: TrajectoryStatus
    reward: float
    num_turns: int = Field(ge=0)
    """Turns kept; the recorder assembles the trajectory once it has all of them."""
    num_tokens: int = Field(ge=0)
    """Length of the full token sequence, for the recorder's completeness check."""
    stop_reason: str = ""
    """Why it ended (``terminated``, ``max_turns``, ``context_length``, ...)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Free-form details. Keys the recorder stores in columns: ``token_check`` (``ok`` when, for every segment,
    decode(ids) equals the chat template's rendering of its conversation, else ``mismatch``), ``segment_checks``
    (one ``ok``/``mismatch`` per segment) and ``drifts`` (``[{"turn": t, "class": ...}]``)."""


class EpisodeFailed(_Event):
    """The episode could not finish; it keeps whatever turns it has, marked failed."""

    type: Literal["episode.failed"] = "episode.failed"
    failure_class: FailureClass
    reason: str
    num_turns: int = Field(0, ge=0)
    retryable: bool = False
    """The failure may pass (a remote env unreachable, no inference worker, a deadline); a bad task, a 4xx or an
    engine's refusal is not."""
    will_retry: bool = False
    """Another attempt of the episode follows (retryable, and its class's budget was not spent): the recorder
    stores the attempt's failure and keeps the episode running."""


class EpisodeCancelled(_Event):
    """The episode's batch was cancelled before or while it ran."""

    type: Literal["episode.cancelled"] = "episode.cancelled"
    num_turns: int = Field(0, ge=0)


Event = Annotated[
    EpisodeRequested
    | EpisodeStarted
    | InferenceRequested
    | TurnGenerated
    | StepCompleted
    | EpisodeFinished
    | EpisodeFailed
    | EpisodeCancelled,
    Field(discriminator="type"),
]
"""Any event of the contract."""

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def encode(event: BaseModel) -> bytes:
    """Bus bytes of an event: a msgpack map, token arrays as raw little-endian ``bin`` (see shared/arrays.py).

    Fields an event lists in ``OMIT_AT_DEFAULT`` are left out while they hold their default: the release before the
    tolerant readers refused unknown fields, so a field added since reaches it only when it says something."""
    omit: frozenset[str] = getattr(type(event), "OMIT_AT_DEFAULT", frozenset())
    fields = type(event).model_fields
    exclude = {name for name in omit if getattr(event, name) == fields[name].default}
    return msgpack.packb(event.model_dump(mode="python", exclude=exclude or None), datetime=True)


def _unpack(data: bytes | str) -> Any:
    if isinstance(data, str):
        data = data.encode()
    if data[:1] in (b"{", b" ", b"\n"):
        # JSON (base64 arrays) is accepted too: hand-written events, HTTP payloads, replays from JSONL.
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise SchemaError(f"not valid JSON: {exc}") from exc
    try:
        return msgpack.unpackb(data, timestamp=3, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise SchemaError(f"not a msgpack event: {type(exc).__name__}: {exc}") from exc


def _check_version(raw: Any) -> None:
    """Raise ``NewerContractError`` for an event written at a newer major than this code reads."""
    if not isinstance(raw, dict):
        return
    version = raw.get("schema_version", SCHEMA_VERSION)
    if type(version) is int and version > SCHEMA_VERSION:
        raise NewerContractError(
            f"{raw.get('type', '?')} {raw.get('event_id', '?')} is at contract version {version}; this code reads "
            f"up to {SCHEMA_VERSION} (upgrade this service)", version=version)


def decode(data: bytes | str) -> Event:
    """Parse and validate any event; raises ``NewerContractError`` for a newer major, else ``SchemaError`` naming
    what is wrong."""
    raw = _unpack(data)
    _check_version(raw)
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from exc


def decode_as(data: bytes | str, model: type[_M]) -> _M:
    """Parse an event that must be of one type (same errors as ``decode``)."""
    raw = _unpack(data)
    _check_version(raw)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from exc


def to_json(event: BaseModel) -> bytes:
    """JSON bytes of an event (arrays as base64), for HTTP views, logs and JSONL dumps."""
    return event.model_dump_json().encode()


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def dumps(obj: Any) -> bytes:
    """orjson with numpy support, for non-event payloads (heartbeats, KV values)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
