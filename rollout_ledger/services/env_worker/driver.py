"""Runs one attempt of an episode of a built-in or library env: reset, prompt, turns (inference, env step, delta
tokens), and its terminal event; an attempt after the first resumes from the last recorded turn.

Each turn is played the same way live and in a replay (``_play``): the sampled ids are appended verbatim, the env
takes the decoded text cut before its stop string, and the template delta follows. ``episode_timeout_s`` bounds
reset, replay and turns (cancelling whatever is in flight); the terminal event's publication is outside it.

Resume (see docs/architecture.md, "Resume"). Attempt n > 1 reads the recorded turns of the attempt before it
(``resume.py``) and gets the env's state back by the env's declared capability (``Env.resume``):

- ``replay``: reset with the same task, then every recorded turn's sampled ids through ``_play`` again; every
  action, observation, observation id, reward and ending is compared with the recorded step. All equal: the turns
  are carried over (``Attempt.carry_over``) and generation goes on at turn k. The first difference falls back to
  ``restart`` with the reason recorded.
- ``snapshot``: reset, then ``restore`` the state stored with the last recorded step; the transcript is rebuilt
  from the recorded ids and compared the same way.
- ``restart``: turn 0, as before resume existed (the env cannot be restored, nothing was recorded, or the
  recorders did not answer).

Tracing (shared/kit/tracing.py; no-ops when off): each turn's inference round trip is a ``turn`` span, each env
call an ``env.reset`` or ``env.step`` span, inside the attempt's span (episode_runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_ledger.services.env_worker.attempt import Attempt, AttemptDeps, AttemptOutcome, jsonable
from rollout_ledger.services.env_worker.context import uses_window, windowed
from rollout_ledger.services.env_worker.env_llm_journal import RESET_KEY, STEP_KEY, JournaledLLM, ScriptExhausted
from rollout_ledger.services.env_worker.resume_reader import Recorded, ResumeUnavailable
from rollout_ledger.services.env_worker.stop_strings import cut_at_stop
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript
from rollout_ledger.services.envs.base import REPLAY, SNAPSHOT, Env, EnvContext, StepResult
from rollout_ledger.services.envs.registry import UnknownEnvError
from rollout_ledger.shared.errors import EnvError, InferenceError
from rollout_ledger.shared.events import (
    EpisodeRequested,
    FailureClass,
    ResumeInfo,
    ResumeMode,
    TrajectoryStatus,
)
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.resume import RecordedTurn

log = get_logger(__name__)

__all__ = ["AttemptDeps", "AttemptOutcome", "EpisodeDriver"]


class _StepFailed(Exception):
    """The env failed a step (its exception, an unrenderable message, a non-finite reward)."""

    def __init__(self, reason: str, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


class _Diverged(Exception):
    """A replay did not give the recorded turn back."""


@dataclass(frozen=True)
class _Played:
    """One turn played: the env's answer and what the step event carries."""

    action: str
    result: StepResult
    delta: Delta
    final: bool
    reward: float
    info: dict[str, Any]
    observation: str
    step_ms: float


class EpisodeDriver(Attempt):
    """One attempt of one episode of an ``Env`` (single use)."""

    def __init__(self, deps: AttemptDeps, item: EpisodeRequested, attempt: int) -> None:
        super().__init__(deps, item, attempt)
        self._env: Env | None = None
        self._llm: JournaledLLM | None = None
        """The env's own LLM, journaled (None when the worker offers none)."""
        self._reset_replies: list[str] = []

    async def run(self) -> AttemptOutcome:
        with self.bind_log():
            try:
                if self.deps.is_cancelled(self.item.batch_id):
                    return await self.cancelled()
                try:
                    self._env = self.deps.envs.create(self.item.env)
                except UnknownEnvError:
                    return await self.failed(FailureClass.ENV, f"unknown env {self.item.env!r} in this worker")
                if self.deps.episode_timeout_s <= 0:
                    return await self._attempt()
                try:
                    async with asyncio.timeout(self.deps.episode_timeout_s) as self._deadline:
                        return await self._attempt()
                except TimeoutError:
                    if self._deadline is None or not self._deadline.expired():
                        raise
                    # Whatever was in flight (an inference request, an env call) was cancelled with the task.
                    return await self.failed(
                        FailureClass.TIMEOUT, f"the attempt ran past its deadline of {self.deps.episode_timeout_s:g}s "
                        f"({self.turns} turns, {self.kept} kept, {self.reused} carried over); in-flight requests "
                        "cancelled", retryable=True)
            finally:
                await self._close_env()

    async def _close_env(self) -> None:
        if self._env is not None:
            with contextlib.suppress(Exception):
                await self._env.close()
            self._env = None

    async def _reset(self, recorded: Recorded | None = None) -> tuple[Env, list[dict[str, Any]], Transcript]:
        """Bind and reset the env (its LLM answering from ``recorded``'s turn 0 when given); raise ``_StepFailed``
        when the env refuses."""
        env = self._env
        assert env is not None
        self._llm = JournaledLLM(self.deps.env_llm) if self.deps.env_llm is not None else None
        if self._llm is not None and recorded is not None and recorded.turns:
            self._llm.play(recorded.turns[0].info.get(RESET_KEY, []))
        try:
            env.bind(EnvContext(episode_id=self.ep, batch_id=self.item.batch_id, attempt=self.attempt,
                                llm=self._llm))
            with self.deps.tracing.span("env.reset", attributes={"rollout.env": self.item.env}):
                messages = await env.reset(self.item.task)
            transcript = Transcript(self.deps.template.with_tools(env.tools()), messages)
        except ScriptExhausted as exc:
            raise _Diverged(f"reset: {exc}") from exc
        except Exception as exc:  # the env's code: any exception is an env failure
            raise _StepFailed(f"reset: {type(exc).__name__}: {exc}", retryable=_env_retryable(exc)) from exc
        if self._llm is not None:
            if self._llm.left():
                raise _Diverged(f"the reset used {self._llm.left()} fewer env LLM replies than recorded")
            self._reset_replies = self._llm.take()
        return env, messages, transcript

    async def _attempt(self) -> AttemptOutcome:
        """Reset (and resume), the started event and the turns (what the deadline covers)."""
        recorded, info = await self._recorded()
        resuming = recorded is not None and info.mode in (ResumeMode.REPLAY, ResumeMode.SNAPSHOT)
        try:
            try:
                env, messages, transcript = await self._reset(recorded if resuming else None)
                if recorded is not None and resuming:
                    await self._restore(env, transcript, recorded, info.mode)
            except _Diverged as exc:
                assert recorded is not None
                info = ResumeInfo(mode=ResumeMode.RESTART, from_attempt=recorded.source_attempt,
                                  turns_recorded=len(recorded.turns), reason=f"{info.mode} diverged: {exc}",
                                  turns_unstepped=recorded.unstepped_turns)
                log.warning("episode.resume_diverged", reason=info.reason)
                await self._close_env()
                self._env = self.deps.envs.create(self.item.env)
                env, messages, transcript = await self._reset()
            if self._llm is not None:
                self._llm.live()
        except _StepFailed as exc:
            return await self.failed(FailureClass.ENV, exc.reason, retryable=exc.retryable)
        if info.mode in (ResumeMode.REPLAY, ResumeMode.SNAPSHOT) and recorded is not None:
            for turn in recorded.turns:
                await self.carry_over(turn)
                self.reward += turn.reward
            info = info.model_copy(update={"turns_reused": self.reused})
            await self.flush()  # the carried-over steps are durable before the attempt says it started
        self.count_resume(info, self.reused)
        await self.publish_started(transcript, messages, info if self.attempt > 1 else None)
        if recorded is not None and self.reused:
            last = recorded.turns[-1]
            if last.info.get("aborted"):
                return await self.finished(TrajectoryStatus.ABORTED, "aborted")
            if last.terminated:
                return await self.finished(TrajectoryStatus.COMPLETED, "terminated")
            if last.truncated:
                return await self.finished(TrajectoryStatus.TRUNCATED, "env_truncated")
        return await self._turn_loop(env, transcript, self.reused)

    async def _recorded(self) -> tuple[Recorded | None, ResumeInfo]:
        """The recorded turns this attempt may carry over, and how it resumes (``restart`` with the reason when it
        cannot)."""
        env = self._env
        assert env is not None
        mode = {REPLAY: ResumeMode.REPLAY, SNAPSHOT: ResumeMode.SNAPSHOT}.get(env.resume)
        if self.attempt <= 1:
            return None, ResumeInfo(mode=ResumeMode.RESTART)
        if self.deps.resume is None:
            return None, ResumeInfo(mode=ResumeMode.RESTART, reason="resume is off in this worker")
        try:
            recorded = await self.deps.resume.read(self.ep, self.attempt)
        except ResumeUnavailable as exc:
            log.warning("episode.resume_unavailable", reason=str(exc))
            return None, ResumeInfo(mode=ResumeMode.RESTART, reason=str(exc))
        if recorded is None:
            return None, ResumeInfo(mode=ResumeMode.RESTART, reason="no recorded attempt")
        base = ResumeInfo(mode=mode or ResumeMode.RESTART, from_attempt=recorded.source_attempt,
                          turns_recorded=len(recorded.turns), turns_unstepped=recorded.unstepped_turns)
        if mode is None:
            return recorded, base.model_copy(update={
                "reason": f"env {self.item.env} declares resume={env.resume!r}: its state cannot be restored"})
        if not recorded.turns:
            return recorded, base.model_copy(update={"mode": ResumeMode.RESTART, "reason": "no turn recorded"})
        if len(recorded.turns) > self.item.max_turns:
            return recorded, base.model_copy(update={"mode": ResumeMode.RESTART,
                                                     "reason": "more turns recorded than max_turns"})
        return recorded, base

    async def _restore(self, env: Env, transcript: Transcript, recorded: Recorded, mode: ResumeMode) -> None:
        """Rebuild the transcript (and the env's state) from the recorded turns; ``_Diverged`` at the first
        difference."""
        prompt = np.asarray(recorded.prompt_token_ids, dtype=np.int32)
        if not np.array_equal(prompt, transcript.prompt_ids):
            raise _Diverged(f"the reset rendered a prompt of {len(transcript.prompt_ids)} tokens that differs from "
                            f"the recorded one ({len(prompt)} tokens)")
        if mode is ResumeMode.SNAPSHOT:
            state = recorded.turns[-1].env_state
            if not isinstance(state, dict) or "state" not in state:
                raise _Diverged("the last recorded step carries no env state")
            try:
                await env.restore(state["state"])
            except Exception as exc:  # the env's code
                raise _Diverged(f"restore: {type(exc).__name__}: {exc}") from exc
            for turn in recorded.turns:
                self._rebuild(transcript, turn, (turn.env_state or {}).get("observation") or [])
            return
        for turn in recorded.turns:
            if self._llm is not None:
                self._llm.play(turn.info.get(STEP_KEY, []))
            try:
                played = await self._play(env, transcript, turn.turn_index, turn.token_ids)
            except _StepFailed as exc:
                raise _Diverged(f"turn {turn.turn_index}: {exc.reason}") from exc
            _compare(turn, played)
            if self._llm is not None and self._llm.left():
                raise _Diverged(f"turn {turn.turn_index}: the env used fewer LLM replies than recorded")

    def _rebuild(self, transcript: Transcript, turn: RecordedTurn, observation: list[dict[str, Any]]) -> None:
        """Append a recorded turn to the transcript without the env (``snapshot``): the observation messages come
        from the stored state; the template delta must equal the recorded ids."""
        t = turn.turn_index
        text = transcript.add_sampled(turn.token_ids)
        ended = bool(turn.terminated or turn.truncated or turn.info.get("aborted"))
        delta, _ = self._append_observation(transcript, t, text, observation, ended)
        if not np.array_equal(delta.ids, turn.observation_token_ids):
            raise _Diverged(f"turn {t}: the template delta differs from the recorded observation ids")

    def _append_observation(self, transcript: Transcript, t: int, text: str, observation: list[dict[str, Any]],
                            ended: bool) -> tuple[Delta, bool]:
        """The template delta after turn ``t`` (live and in a resume alike) and whether the turn is the last one."""
        final = ended or t + 1 >= self.item.max_turns
        view = None  # the full history (the default) builds no copy of the conversation per turn
        if not final and uses_window(self.item.context):
            view = windowed(self.item.context, [*transcript.messages, {"role": "assistant", "content": text},
                                                *observation])
        return transcript.add_observation(observation, final, window=view), final

    async def _play(self, env: Env, transcript: Transcript, t: int, token_ids: np.ndarray) -> _Played:
        """Append turn ``t``'s sampled ids, step the env with the action, append the template delta."""
        text = transcript.add_sampled(token_ids)
        # the env gets OpenAI's text: cut before the stop string that ended the turn (the ids keep it)
        action, _ = cut_at_stop(text, self.item.sampling.stop)
        started = time.perf_counter()
        try:
            with self.deps.tracing.span("env.step", attributes={"rollout.turn_index": t}):
                result = await env.step(action)
            env_s = time.perf_counter() - started
            delta, final = self._append_observation(transcript, t, text, result.observation,
                                                    result.terminated or result.truncated or result.aborted)
        except Exception as exc:  # the env's code (or its unrenderable messages): an env failure
            raise _StepFailed(f"step {t}: {type(exc).__name__}: {exc}", retryable=_env_retryable(exc)) from exc
        self.deps.metrics.env_step_seconds.observe(env_s)
        try:
            reward = float(result.reward)
        except (TypeError, ValueError, OverflowError):
            reward = math.nan
        if not math.isfinite(reward):  # never stored: a NaN reward turns every mean over it into NaN
            raise _StepFailed(f"step {t}: the env returned a non-finite reward {str(result.reward)[:100]!r}")
        if not math.isfinite(self.reward + reward):
            raise _StepFailed(f"step {t}: the episode's reward sum overflowed ({self.reward!r} + {reward!r})")
        info = jsonable(result.info)
        if result.aborted:
            info["aborted"] = True
        observation = "\n".join(str(m.get("content", "")) for m in result.observation)
        if final and observation:
            info["final_observation"] = observation  # not part of the trajectory; kept for inspection
        return _Played(action, result, delta, final, reward, info, "" if final else observation,
                       (time.perf_counter() - started) * 1000.0)

    async def _turn_loop(self, env: Env, transcript: Transcript, first: int) -> AttemptOutcome:
        max_turns = self.item.max_turns
        for t in range(first, max_turns):
            if t > 0 and self.deps.is_cancelled(self.item.batch_id):
                return await self.cancelled()
            room = self.deps.max_model_len - transcript.context_len
            if room <= 0:
                return await self.finished(TrajectoryStatus.TRUNCATED, "context_length")
            try:
                turn = await self.request_turn(t, transcript.context, self.item.sampling,
                                               min(self.item.sampling.max_tokens, room))
            except InferenceError as exc:
                return await self.failed(FailureClass.INFERENCE, f"turn {t}: {exc}", retryable=exc.retryable)
            try:
                played = await self._play(env, transcript, t, turn.token_ids)
            except _StepFailed as exc:
                return await self.failed(FailureClass.ENV, exc.reason, retryable=exc.retryable)
            self.reward += played.reward
            result = played.result
            if self._llm is not None:  # the env LLM's replies of this step (and of the reset), for a replay
                replies = self._llm.take()
                if replies:
                    played.info[STEP_KEY] = replies
                if t == 0 and self._reset_replies:
                    played.info[RESET_KEY] = self._reset_replies
            state = None
            if env.resume == SNAPSHOT:
                try:
                    state = {"state": env.snapshot(), "observation": result.observation}
                except Exception as exc:  # the env's code
                    if not played.final:  # after the last step no attempt needs it: the episode ends anyway
                        return await self.failed(FailureClass.ENV, f"snapshot after step {t}: "
                                                 f"{type(exc).__name__}: {exc}")
            await self.publish_step(t, turn.event_id, played.action, played.observation, played.delta,
                                    reward=played.reward, terminated=result.terminated, truncated=result.truncated,
                                    info=played.info, step_ms=played.step_ms, env_state=state)
            if result.aborted:
                return await self.finished(TrajectoryStatus.ABORTED, "aborted")
            if result.terminated:
                return await self.finished(TrajectoryStatus.COMPLETED, "terminated")
            if result.truncated:
                return await self.finished(TrajectoryStatus.TRUNCATED, "env_truncated")
        return await self.finished(TrajectoryStatus.TRUNCATED, "max_turns")


def _compare(turn: RecordedTurn, played: _Played) -> None:
    """Raise ``_Diverged`` naming the first field where the replayed turn differs from the recorded step."""
    t = turn.turn_index
    checks: list[tuple[str, bool]] = [
        ("action", played.action == turn.action),
        ("observation", played.observation == turn.observation),
        ("observation ids", np.array_equal(played.delta.ids, turn.observation_token_ids)),
        ("new segment", played.delta.new_segment == turn.new_segment),
        ("reward", played.reward == turn.reward),
        ("terminated", played.result.terminated == turn.terminated),
        ("truncated", played.result.truncated == turn.truncated),
        ("aborted", bool(played.result.aborted) == bool(turn.info.get("aborted"))),
    ]
    for what, same in checks:
        if not same:
            raise _Diverged(f"turn {t}: the {what} differs from the recorded step {turn.step_event_id}")


def _env_retryable(exc: Exception) -> bool:
    """Whether an env failure may pass on another attempt: only when the env says so (``EnvError.retryable``: a
    remote env unreachable or answering 5xx). A bad task or an env's own exception would fail the same way."""
    return isinstance(exc, EnvError) and exc.retryable
