"""Runs one episode attempt: reset, prompt, turns (inference, env step, delta tokens), and its terminal event.

Events, ids and ``seq`` follow the common contract: started ``{ep}:a{n}:started`` (seq 0); turn t is requested
as ``{ep}:a{n}:t{t}:r{try}`` (seq 2t+1, published by the inference worker); its step ``{ep}:a{n}:s{t}``
(seq 2t+2); the terminal event ``{ep}:a{n}:end`` (seq 2T+1, T = turns generated in this attempt).

Steps are published without awaiting each ack (through the worker's ``StreamPublisher``, whose per-message
cost is a fraction of ``js.publish_async``'s); every pending ack is awaited before the terminal event, and
the terminal event's ack before the caller acks the work item. A failure of the bus is not an episode
outcome: ``BusError`` propagates and the caller hands the work item back (a later attempt redoes it).

A failure is an ``EpisodeFailed`` with its class (``env``, ``inference``, ``timeout``); when the failure is
retryable and the class's budget (``retries.py``) is not spent, the event says ``will_retry`` and the outcome
carries the next attempt's work item for the caller to publish. ``episode_timeout_s`` bounds reset and turns
(cancelling whatever is in flight); the terminal event's publication is outside the deadline.

Tracing (shared/kit/tracing.py; no-ops when off): inside the attempt's span (worker.py) each turn's inference round
trip is a ``turn`` span, the parent of the inference worker's generation, and each env call an ``env.reset`` or
``env.step`` span; the events carry the attempt's trace context in their headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import structlog
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.context import uses_window, windowed
from rollout_ledger.services.env_worker.inference_client import InferenceClient
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.stop_strings import cut_at_stop
from rollout_ledger.services.env_worker.tokenization import Transcript, TurnTemplate
from rollout_ledger.services.envs.base import Env, EnvContext, EnvLLM
from rollout_ledger.services.envs.registry import EnvRegistry, UnknownEnvError
from rollout_ledger.shared.errors import BusError, EnvError, InferenceError, TokenizationError
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    FailureClass,
    InferenceRequested,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    encode,
)
from rollout_ledger.shared.kit.bus import msg_id_headers, publish_event
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import event_subject

log = get_logger(__name__)

_STEP_SUBJECT = event_subject("step.completed")


@dataclass(frozen=True)
class DriverDeps:
    """What every episode of one worker shares."""

    js: JetStreamContext
    client: InferenceClient
    envs: EnvRegistry
    template: TurnTemplate
    is_cancelled: Callable[[str], bool]
    """batch_id -> whether the batch is cancelled (kept current by a KV watch)."""
    metrics: EnvWorkerMetrics
    worker_id: str
    max_model_len: int = 2048
    publish_timeout_s: float = 10.0
    publisher: StreamPublisher | None = None
    """Publishes the episode's events (its ack timeout is ``publish_timeout_s``); None: ``js`` publishes them."""
    budgets: RetryBudgets = field(default_factory=RetryBudgets)
    """Further attempts per failure class (``retries.py``); none by default."""
    episode_timeout_s: float = 0.0
    """Deadline of one attempt (reset and turns; not the terminal event's publication); 0: none."""
    env_llm: EnvLLM | None = None
    """The chat LLM handed to envs (``EnvContext.llm``): simulated users, judges."""
    tracing: Tracing = field(default_factory=Tracing.off)
    """Spans of turns and env calls, children of the attempt's span (off: none)."""

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


class EpisodeDriver:
    """One attempt of one episode (single use)."""

    def __init__(self, deps: DriverDeps, item: EpisodeRequested, attempt: int) -> None:
        self.deps = deps
        self.item = item
        self.attempt = attempt
        self.ep = item.episode_id
        self.turns = 0
        """Turns generated in this attempt (the terminal event's ``seq`` is ``2 * turns + 1``)."""
        self.kept = 0
        """Turns whose step was published (a failure's ``num_turns``: the turns its partial trajectory holds)."""
        self._deadline: asyncio.Timeout | None = None
        self.reward = 0.0
        self.transcript: Transcript | None = None
        self.last_worker: str | None = None
        self._pending_acks: list[tuple[asyncio.Future[Any], StepCompleted]] = []

    # --- ids ----------------------------------------------------------------------------------------
    def _common(self, event_id: str, seq: int) -> dict[str, Any]:
        return {"event_id": event_id, "episode_id": self.ep, "batch_id": self.item.batch_id,
                "attempt": self.attempt, "seq": seq, "produced_by": self.deps.produced_by}

    def request_id(self, turn: int, try_no: int) -> str:
        return f"{self.ep}:a{self.attempt}:t{turn}:r{try_no}"

    @property
    def _end_id(self) -> str:
        return f"{self.ep}:a{self.attempt}:end"

    # --- the attempt ----------------------------------------------------------------------------------
    async def run(self) -> AttemptOutcome:
        with structlog.contextvars.bound_contextvars(episode_id=self.ep, batch_id=self.item.batch_id,
                                                     attempt=self.attempt):
            env: Env | None = None
            try:
                if self.deps.is_cancelled(self.item.batch_id):
                    return await self._cancelled()
                try:
                    env = self.deps.envs.create(self.item.env)
                except UnknownEnvError:
                    return await self._failed(FailureClass.ENV, f"unknown env {self.item.env!r} in this worker")
                if self.deps.episode_timeout_s <= 0:
                    return await self._attempt(env)
                try:
                    async with asyncio.timeout(self.deps.episode_timeout_s) as self._deadline:
                        return await self._attempt(env)
                except TimeoutError:
                    if self._deadline is None or not self._deadline.expired():
                        raise
                    # Whatever was in flight (an inference request, an env call) was cancelled with the task.
                    return await self._failed(
                        FailureClass.TIMEOUT, f"the attempt ran past its deadline of {self.deps.episode_timeout_s:g}s "
                        f"({self.turns} turns generated, {self.kept} kept); in-flight requests cancelled",
                        retryable=True)
            finally:
                if env is not None:
                    with contextlib.suppress(Exception):
                        await env.close()

    async def _attempt(self, env: Env) -> AttemptOutcome:
        """Reset, the started event and the turns (what the deadline covers)."""
        try:
            env.bind(EnvContext(episode_id=self.ep, batch_id=self.item.batch_id, attempt=self.attempt,
                                llm=self.deps.env_llm))
            with self.deps.tracing.span("env.reset", attributes={"rollout.env": self.item.env}):
                messages = await env.reset(self.item.task)
            self.transcript = Transcript(self.deps.template.with_tools(env.tools()), messages)
        except Exception as exc:  # the env's code: any exception is an env failure
            return await self._failed(FailureClass.ENV, f"reset: {type(exc).__name__}: {exc}",
                                      retryable=_env_retryable(exc))
        await self._started(self.transcript, messages)
        return await self._turn_loop(env, self.transcript)

    async def _turn_loop(self, env: Env, transcript: Transcript) -> AttemptOutcome:
        max_turns = self.item.max_turns
        for t in range(max_turns):
            if t > 0 and self.deps.is_cancelled(self.item.batch_id):
                return await self._cancelled()
            room = self.deps.max_model_len - transcript.context_len
            if room <= 0:
                return await self._finished(TrajectoryStatus.TRUNCATED, "context_length")
            try:
                turn = await self._generate(t, transcript, min(self.item.sampling.max_tokens, room))
            except InferenceError as exc:
                return await self._failed(FailureClass.INFERENCE, f"turn {t}: {exc}", retryable=exc.retryable)
            text = transcript.add_sampled(turn.token_ids)
            # the env gets OpenAI's text: cut before the stop string that ended the turn (the ids keep it)
            action, _ = cut_at_stop(text, self.item.sampling.stop)
            started = time.perf_counter()
            try:
                with self.deps.tracing.span("env.step", attributes={"rollout.turn_index": t}):
                    result = await env.step(action)
                env_s = time.perf_counter() - started
                final = result.terminated or result.truncated or result.aborted or t + 1 >= max_turns
                view = None  # the full history (the default) builds no copy of the conversation per turn
                if not final and uses_window(self.item.context):
                    view = windowed(self.item.context, [
                        *transcript.messages, {"role": "assistant", "content": text}, *result.observation])
                delta = transcript.add_observation(result.observation, final, window=view)
            except Exception as exc:  # the env's code (or its unrenderable messages): an env failure
                return await self._failed(FailureClass.ENV, f"step {t}: {type(exc).__name__}: {exc}",
                                          retryable=_env_retryable(exc))
            self.deps.metrics.env_step_seconds.observe(env_s)
            try:
                reward = float(result.reward)
            except (TypeError, ValueError, OverflowError):
                reward = math.nan
            if not math.isfinite(reward):  # never stored: a NaN reward turns every mean over it into NaN
                return await self._failed(FailureClass.ENV, f"step {t}: the env returned a non-finite reward "
                                          f"{str(result.reward)[:100]!r}")
            if not math.isfinite(self.reward + reward):
                return await self._failed(FailureClass.ENV, f"step {t}: the episode's reward sum overflowed "
                                          f"({self.reward!r} + {reward!r})")
            self.reward += reward
            info = _jsonable(result.info)
            if result.aborted:
                info["aborted"] = True
            observation = "\n".join(str(m.get("content", "")) for m in result.observation)
            if final and observation:
                info["final_observation"] = observation  # not part of the trajectory; kept for inspection
            step = StepCompleted(
                **self._common(f"{self.ep}:a{self.attempt}:s{t}", 2 * t + 2),
                turn_index=t, turn_event_id=turn.event_id, action=action,
                observation="" if final else observation,
                observation_token_ids=delta.ids, reward=reward, terminated=result.terminated,
                truncated=result.truncated, info=info, step_ms=(time.perf_counter() - started) * 1000.0,
                drift=None if delta.drift is None else delta.drift.value, new_segment=delta.new_segment,
            )
            await self._publish_async(step)
            self.kept += 1
            if result.aborted:
                return await self._finished(TrajectoryStatus.ABORTED, "aborted")
            if result.terminated:
                return await self._finished(TrajectoryStatus.COMPLETED, "terminated")
            if result.truncated:
                return await self._finished(TrajectoryStatus.TRUNCATED, "env_truncated")
        return await self._finished(TrajectoryStatus.TRUNCATED, "max_turns")

    async def _generate(self, t: int, transcript: Transcript, max_tokens: int) -> TurnGenerated:
        """Turn ``t`` from an inference worker (sticky to the previous turn's worker); ``InferenceError`` when
        the budget is spent."""
        context = transcript.context
        common: dict[str, Any] = {"episode_id": self.ep, "batch_id": self.item.batch_id, "attempt": self.attempt,
                                  "seq": 2 * t + 1, "produced_by": self.deps.produced_by}

        def build(try_no: int) -> InferenceRequested:
            rid = self.request_id(t, try_no)
            return InferenceRequested(event_id=rid, request_id=rid, turn_index=t, prompt_token_ids=context,
                                      sampling=self.item.sampling, max_tokens=max_tokens, reply_seq=2 * t + 1,
                                      **common)

        with self.deps.tracing.span("turn", attributes={"rollout.turn_index": t, "rollout.prompt_tokens": len(context),
                                                        "gen_ai.request.max_tokens": max_tokens}) as span:
            turn = await self.deps.client.generate(build, prefer=self.last_worker)
            if span is not None:
                span.set_attributes({"rollout.inference_worker": turn.worker_id,
                                     "gen_ai.usage.output_tokens": int(turn.token_ids.shape[0])})
        self.turns += 1
        self.last_worker = turn.worker_id
        return turn

    # --- publishing ---------------------------------------------------------------------------------
    async def _started(self, transcript: Transcript, messages: list[dict[str, Any]]) -> None:
        event = EpisodeStarted(**self._common(f"{self.ep}:a{self.attempt}:started", 0), env=self.item.env,
                               worker_id=self.deps.worker_id, prompt_token_ids=transcript.prompt_ids,
                               prompt_text=transcript.prompt_text, messages=_jsonable_list(messages))
        await self._publish(event)

    async def _publish(self, event: EpisodeStarted | EpisodeFinished | EpisodeFailed | EpisodeCancelled
                       | StepCompleted) -> None:
        """Publish and await the stream's ack (``BusError`` otherwise)."""
        if self.deps.publisher is not None:
            await self.deps.publisher.publish(event.type, event.event_id, encode(event))
        else:
            await publish_event(self.deps.js, event, timeout=self.deps.publish_timeout_s)

    async def _publish_async(self, event: StepCompleted) -> None:
        fut: asyncio.Future[Any]
        if self.deps.publisher is not None:
            fut = await self.deps.publisher.publish_nowait(event.type, event.event_id, encode(event), _STEP_SUBJECT)
        else:
            try:
                fut = await self.deps.js.publish_async(_STEP_SUBJECT, encode(event),
                                                       headers=msg_id_headers(event.event_id))
            except Exception as exc:
                raise BusError(f"publish of step.completed failed: {exc}") from exc
        self._pending_acks.append((fut, event))

    async def _flush(self) -> None:
        """Await every step ack before the terminal event (a lost step would leave a hole in the trajectory). A step
        whose ack did not come (its publish was in flight when NATS went down) is published once more, awaited:
        the same ``Nats-Msg-Id``, so the stream stores it at most once; only if that fails too is the attempt lost."""
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

    async def _terminal(self, event: EpisodeFinished | EpisodeFailed | EpisodeCancelled, status: str) -> AttemptOutcome:
        if self._deadline is not None and not self._deadline.expired():
            self._deadline.reschedule(None)  # the outcome is decided: its publication is not cut short
        await self._flush()
        await self._publish(event)
        log.info("episode.end", status=status, turns=self.turns, reward=self.reward)
        return AttemptOutcome(status, self.turns)

    async def _finished(self, status: TrajectoryStatus, stop_reason: str) -> AttemptOutcome:
        transcript = self.transcript
        if transcript is None:
            raise TokenizationError("an episode finished before its prompt was built")
        checks = transcript.check_results()
        info: dict[str, Any] = {"token_check": "ok" if all(checks) else "mismatch",
                                "segment_checks": ["ok" if c else "mismatch" for c in checks]}
        if transcript.drifts:
            info["drifts"] = [{"turn": t, "class": d.value} for t, d in transcript.drifts]
        if info["token_check"] != "ok":
            log.warning("episode.token_check_mismatch", turns=self.turns)
        event = EpisodeFinished(**self._common(self._end_id, 2 * self.turns + 1), status=status, reward=self.reward,
                                num_turns=self.turns, num_tokens=len(transcript), stop_reason=stop_reason,
                                info=info)
        return await self._terminal(event, status.value)

    async def _failed(self, failure_class: FailureClass, reason: str, retryable: bool = False) -> AttemptOutcome:
        """The attempt failed; another attempt follows when the failure is retryable and its class's budget allows.

        ``num_turns`` is the turns kept (with their steps): a turn whose step failed is not part of the partial
        trajectory. ``seq`` still counts every turn generated, so it stays unique within the attempt.
        """
        will_retry = self.deps.budgets.allows(self.item, failure_class, retryable)
        log.warning("episode.failed", failure_class=failure_class.value, reason=reason, will_retry=will_retry)
        event = EpisodeFailed(**self._common(self._end_id, 2 * self.turns + 1), failure_class=failure_class,
                              reason=reason[:2000], num_turns=self.kept, retryable=retryable, will_retry=will_retry)
        outcome = await self._terminal(event, "retried" if will_retry else "failed")
        retry = self.deps.budgets.next_item(self.item, self.attempt, failure_class) if will_retry else None
        return replace(outcome, retry=retry, failure_class=failure_class)

    async def _cancelled(self) -> AttemptOutcome:
        event = EpisodeCancelled(**self._common(self._end_id, 2 * self.turns + 1), num_turns=self.turns)
        return await self._terminal(event, "cancelled")


def _env_retryable(exc: Exception) -> bool:
    """Whether an env failure may pass on another attempt: only when the env says so (``EnvError.retryable``: a
    remote env unreachable or answering 5xx). A bad task or an env's own exception would fail the same way."""
    return isinstance(exc, EnvError) and exc.retryable


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """The env's free-form info as plain JSON values (numpy scalars, sets, objects become JSON or strings)."""
    if not info:
        return {}
    out = orjson.loads(orjson.dumps(info, default=str, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS))
    return out if isinstance(out, dict) else {"info": out}


def _jsonable_list(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = orjson.loads(orjson.dumps(messages, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
    return out if isinstance(out, list) else []
