"""One attempt of one episode, written once: its ids, the turn requests, the started, step and terminal events, and
the turns it carries over from the attempt before it. The built-in driver (``driver.py``) and the agent episode
(``agents/episode.py``) both run their loops on it.

Events, ids and ``seq`` follow ``shared/ids.py``. Steps are published without awaiting each ack (through the
worker's ``StreamPublisher``); every pending ack is awaited before the terminal event, and the terminal event's
ack before the caller acks the work item. A failure of the bus is not an episode outcome: ``BusError``
propagates and the caller hands the work item back (a later attempt redoes it, resuming from what was recorded).

A failure is an ``EpisodeFailed`` with its class; when the failure is retryable and the class's budget
(``retries.py``) is not spent, the event says ``will_retry`` and the outcome carries the next attempt's work item
for the caller to publish.

Resume. An attempt after the first reads the episode's recorded turns (``resume.py``). A turn it carries over
gets a step of its own (``{ep}:a{n}:s{t}``, ``reused_from`` naming the recorded step) that names the recorded
turn, so the recorder assembles the attempt from its own steps as always, and no turn is generated twice. The
steps carried over are published, and their acks awaited, before ``episode.started``: an attempt that crashes
between the two still leaves the recorded prefix readable for the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import structlog

from rollout_ledger.services.env_worker.inference_request import TurnSource
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.resume_reader import ResumeReader
from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript, TurnTemplate
from rollout_ledger.services.envs.base import EnvLLM
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.shared import ids
from rollout_ledger.shared.errors import BusError, TokenizationError
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    FailureClass,
    FinishReason,
    InferenceRequested,
    ResumeInfo,
    SamplingParams,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    encode,
)
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import Producer
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.resume import RecordedTurn
from rollout_ledger.shared.subjects import event_subject

log = get_logger(__name__)

_STEP_SUBJECT = event_subject("step.completed")


@dataclass(frozen=True)
class AttemptDeps:
    """What every attempt of one worker shares."""

    publisher: Producer
    """Publishes the episode's events and resolves their stream acks (``shared/kit/publisher.py``; its ack timeout
    is the worker's ``publish_timeout_s``)."""
    client: TurnSource
    """Generates the turns within the retry budget (the inference client's ``TurnRequests``: inference_request.py)."""
    envs: EnvRegistry
    template: TurnTemplate
    is_cancelled: Callable[[str], bool]
    """batch_id -> whether the batch is cancelled (kept current by a KV watch)."""
    metrics: EnvWorkerMetrics
    worker_id: str
    max_model_len: int = 2048
    publish_timeout_s: float = 10.0
    """How long ``flush`` waits for the steps' acks before publishing the missing ones once more."""
    budgets: RetryBudgets = field(default_factory=RetryBudgets)
    """Further attempts per failure class (``retries.py``); none by default."""
    episode_timeout_s: float = 0.0
    """Deadline of one attempt (reset and turns; not the terminal event's publication); 0: none."""
    env_llm: EnvLLM | None = None
    """The chat LLM handed to envs (``EnvContext.llm``): simulated users, judges."""
    tracing: Tracing = field(default_factory=Tracing.off)
    """Spans of turns and env calls, children of the attempt's span (off: none)."""
    resume: ResumeReader | None = None
    """Reads an episode's recorded turns for an attempt after the first; None: every attempt starts at turn 0
    (``ROLLOUT_RESUME=off``, the behaviour before resume, kept for comparison)."""

    @property
    def produced_by(self) -> str:
        return f"env-worker/{self.worker_id}"


@dataclass(frozen=True)
class AttemptOutcome:
    """How an attempt ended; the work item is acked by the caller (the terminal event is on the stream)."""

    status: str
    """``completed``/``truncated``/``aborted``, ``failed``, ``retried`` or ``cancelled`` (the metrics label)."""
    num_turns: int
    retry: EpisodeRequested | None = None
    """The work item of the next attempt, when this one failed and its class's budget allows another: the caller
    publishes it before acking the current one."""
    failure_class: FailureClass | None = None


def recorded_turn_event(turn: RecordedTurn, item: EpisodeRequested, attempt: int) -> TurnGenerated:
    """A recorded turn as the ``TurnGenerated`` a live generation would have returned (never published again: its
    event id is the recorded one, which the carried-over step names)."""
    try:
        finish = FinishReason(turn.finish_reason)
    except ValueError:
        finish = FinishReason.STOP
    return TurnGenerated(event_id=turn.turn_event_id, request_id=turn.turn_event_id, episode_id=item.episode_id,
                         batch_id=item.batch_id, attempt=attempt, seq=ids.turn_seq(turn.turn_index),
                         produced_by="recorded", turn_index=turn.turn_index, prompt_len=turn.prompt_len,
                         token_ids=turn.token_ids, logprobs=turn.logprobs, finish_reason=finish,
                         weight_version=turn.weight_version, version_runs=turn.version_runs, engine="recorded",
                         worker_id=turn.worker_id,
                         queue_ms=0.0, generate_ms=0.0)


class Attempt:
    """One attempt of one episode (single use): what the built-in driver and the agent episode share."""

    def __init__(self, deps: AttemptDeps, item: EpisodeRequested, attempt: int) -> None:
        self.deps = deps
        self.item = item
        self.attempt = attempt
        self.ep = item.episode_id
        self.turns = 0
        """Turns of this attempt's trajectory so far, carried-over ones included (the terminal ``seq`` is
        ``2 * turns + 1``)."""
        self.kept = 0
        """Turns whose step was published (a failure's ``num_turns``: the turns its partial trajectory holds)."""
        self.reused = 0
        """Turns carried over from the recorded attempt (their steps name the recorded turns)."""
        self._deadline: asyncio.Timeout | None = None
        self.reward = 0.0
        self.transcript: Transcript | None = None
        self.last_worker: str | None = None
        self._pending_acks: list[tuple[asyncio.Future[Any], StepCompleted]] = []

    def bind_log(self, **extra: Any) -> Any:
        return structlog.contextvars.bound_contextvars(episode_id=self.ep, batch_id=self.item.batch_id,
                                                       attempt=self.attempt, **extra)

    # --- ids ----------------------------------------------------------------------------------------
    def _common(self, event_id: str, seq: int) -> dict[str, Any]:
        return {"event_id": event_id, "episode_id": self.ep, "batch_id": self.item.batch_id,
                "attempt": self.attempt, "seq": seq, "produced_by": self.deps.produced_by}

    def request_id(self, turn: int, try_no: int) -> str:
        return ids.turn_request_id(self.ep, self.attempt, turn, try_no)

    # --- turns --------------------------------------------------------------------------------------
    async def request_turn(self, t: int, context: np.ndarray, sampling: SamplingParams,
                           max_tokens: int) -> TurnGenerated:
        """Turn ``t`` from an inference worker (sticky to the previous turn's worker); ``InferenceError`` when the
        budget is spent."""

        def build(try_no: int) -> InferenceRequested:
            rid = self.request_id(t, try_no)
            return InferenceRequested(**self._common(rid, ids.turn_seq(t)), request_id=rid, turn_index=t,
                                      prompt_token_ids=context, sampling=sampling, max_tokens=max_tokens,
                                      reply_seq=ids.turn_seq(t))

        with self.deps.tracing.span("turn", attributes={"rollout.turn_index": t, "rollout.prompt_tokens": len(context),
                                                        "gen_ai.request.max_tokens": max_tokens}) as span:
            turn = await self.deps.client.generate(build, prefer=self.last_worker)
            if span is not None:
                span.set_attributes({"rollout.inference_worker": turn.worker_id,
                                     "gen_ai.usage.output_tokens": int(turn.token_ids.shape[0])})
        self.turns += 1
        self.last_worker = turn.worker_id
        return turn

    def count_resume(self, info: ResumeInfo, reused: int) -> None:
        """Count how this attempt (after the first) resumed: the recorded turns it carried over and the turns the
        attempt before it generated that this one generates again."""
        if self.attempt <= 1:
            return
        regenerated = info.turns_unstepped + info.turns_recorded - reused
        self.deps.metrics.resumed(str(info.mode), reused, regenerated)
        log.info("episode.resumed", mode=str(info.mode), from_attempt=info.from_attempt, reused=reused,
                 regenerated=regenerated, reason=info.reason)

    # --- publishing ---------------------------------------------------------------------------------
    async def publish_started(self, transcript: Transcript, messages: list[dict[str, Any]],
                              resume: ResumeInfo | None = None) -> None:
        self.transcript = transcript
        event = EpisodeStarted(**self._common(ids.started_id(self.ep, self.attempt), 0), env=self.item.env,
                               worker_id=self.deps.worker_id, prompt_token_ids=transcript.prompt_ids,
                               prompt_text=transcript.prompt_text, messages=jsonable_list(messages), resume=resume)
        await self._publish(event)

    async def publish_step(self, t: int, turn_event_id: str, action: str, observation: str, delta: Delta, *,
                           reward: float, terminated: bool, truncated: bool, info: dict[str, Any],
                           step_ms: float = 0.0, reused_from: str | None = None, env_state: Any = None) -> None:
        """The step of turn ``t`` (not awaited: its ack is awaited before the terminal event)."""
        step = StepCompleted(
            **self._common(ids.step_id(self.ep, self.attempt, t), ids.step_seq(t)),
            turn_index=t, turn_event_id=turn_event_id, action=action, observation=observation,
            observation_token_ids=delta.ids, reward=reward, terminated=terminated, truncated=truncated, info=info,
            step_ms=step_ms, drift=None if delta.drift is None else delta.drift.value, new_segment=delta.new_segment,
            reused_from=reused_from, env_state=env_state,
        )
        await self._publish_async(step)
        self.kept = t + 1

    async def carry_over(self, turn: RecordedTurn) -> None:
        """Publish the step that keeps recorded turn ``turn`` in this attempt: a copy of its recorded step under this
        attempt's id, naming the recorded turn."""
        t = turn.turn_index
        step = StepCompleted(
            **self._common(ids.step_id(self.ep, self.attempt, t), ids.step_seq(t)),
            turn_index=t, turn_event_id=turn.turn_event_id, action=turn.action, observation=turn.observation,
            observation_token_ids=turn.observation_token_ids, reward=turn.reward, terminated=turn.terminated,
            truncated=turn.truncated, info=turn.info, drift=turn.drift, new_segment=turn.new_segment,
            reused_from=turn.step_event_id, env_state=turn.env_state,
        )
        await self._publish_async(step)
        self.kept = t + 1
        self.reused += 1
        self.turns = max(self.turns, t + 1)
        self.last_worker = turn.worker_id

    async def _publish(self, event: EpisodeStarted | EpisodeFinished | EpisodeFailed | EpisodeCancelled
                       | StepCompleted) -> None:
        """Publish and await the stream's ack (``BusError`` otherwise)."""
        await self.deps.publisher.publish(event.type, event.event_id, encode(event))

    async def _publish_async(self, event: StepCompleted) -> None:
        fut = await self.deps.publisher.publish_nowait(event.type, event.event_id, encode(event), _STEP_SUBJECT)
        self._pending_acks.append((fut, event))

    async def flush(self) -> None:
        """Await every step ack (a lost step would leave a hole in the trajectory). A step whose ack did not come
        (its publish was in flight when NATS went down) is published once more, awaited: the same
        ``Nats-Msg-Id``, so the stream stores it at most once; only if that fails too is the attempt lost."""
        if not self._pending_acks:
            return
        pending, self._pending_acks = self._pending_acks, []
        try:
            async with asyncio.timeout(self.deps.publish_timeout_s):
                await asyncio.gather(*(fut for fut, _ in pending), return_exceptions=True)
        except TimeoutError:
            pass
        unacked = [event for fut, event in pending if not fut.done() or fut.cancelled() or fut.exception()]
        for fut, _ in pending:
            fut.cancel()
        for event in unacked:
            try:
                await self._publish(event)
            except Exception as exc:
                raise BusError(f"step events not acknowledged by the stream: {exc!r}") from exc

    # --- the end ------------------------------------------------------------------------------------
    async def _terminal(self, event: EpisodeFinished | EpisodeFailed | EpisodeCancelled, status: str) -> AttemptOutcome:
        if self._deadline is not None and not self._deadline.expired():
            self._deadline.reschedule(None)  # the outcome is decided: its publication is not cut short
        await self.flush()
        await self._publish(event)
        log.info("episode.end", status=status, turns=self.turns, reward=self.reward, reused=self.reused)
        return AttemptOutcome(status, self.turns)

    async def finished(self, status: TrajectoryStatus, stop_reason: str, extra: dict[str, Any] | None = None
                       ) -> AttemptOutcome:
        """``EpisodeFinished`` with ``self.reward``, the token check of every segment and ``extra`` in its info."""
        transcript = self.transcript
        if transcript is None:
            raise TokenizationError("an episode finished before its prompt was built")
        checks = transcript.check_results()
        info: dict[str, Any] = {"token_check": "ok" if all(checks) else "mismatch",
                                "segment_checks": ["ok" if c else "mismatch" for c in checks], **(extra or {})}
        if transcript.drifts:
            info["drifts"] = [{"turn": t, "class": d.value} for t, d in transcript.drifts]
        if info["token_check"] != "ok":
            log.warning("episode.token_check_mismatch", turns=self.turns)
        event = EpisodeFinished(**self._common(ids.end_id(self.ep, self.attempt), ids.end_seq(self.turns)),
                                status=status, reward=self.reward, num_turns=self.turns, num_tokens=len(transcript),
                                stop_reason=stop_reason, info=info)
        return await self._terminal(event, status.value)

    async def failed(self, failure_class: FailureClass, reason: str, retryable: bool = False) -> AttemptOutcome:
        """The attempt failed; another attempt follows when the failure is retryable and its class's budget allows.

        ``num_turns`` is the turns kept (with their steps): a turn whose step failed is not part of the partial
        trajectory. ``seq`` still counts every turn generated, so it stays unique within the attempt.
        """
        will_retry = self.deps.budgets.allows(self.item, failure_class, retryable)
        log.warning("episode.failed", failure_class=failure_class.value, reason=reason, will_retry=will_retry)
        event = EpisodeFailed(**self._common(ids.end_id(self.ep, self.attempt), ids.end_seq(self.turns)),
                              failure_class=failure_class, reason=reason[:2000], num_turns=self.kept,
                              retryable=retryable, will_retry=will_retry)
        outcome = await self._terminal(event, "retried" if will_retry else "failed")
        retry = self.deps.budgets.next_item(self.item, self.attempt, failure_class) if will_retry else None
        return AttemptOutcome(outcome.status, outcome.num_turns, retry=retry, failure_class=failure_class)

    async def cancelled(self) -> AttemptOutcome:
        event = EpisodeCancelled(**self._common(ids.end_id(self.ep, self.attempt), ids.end_seq(self.turns)),
                                 num_turns=self.turns)
        return await self._terminal(event, "cancelled")


def jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """Free-form info as plain JSON values (numpy scalars, sets, objects become JSON or strings)."""
    if not info:
        return {}
    out = orjson.loads(orjson.dumps(info, default=str, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS))
    return out if isinstance(out, dict) else {"info": out}


def jsonable_list(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = orjson.loads(orjson.dumps(messages, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
    return out if isinstance(out, list) else []
