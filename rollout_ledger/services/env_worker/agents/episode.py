"""One agent episode attempt: the agent (a function or a harness process) against its session, and what its
outcome makes of the episode; with resume, the recorded turns a later attempt answers repeated calls with.

Each episode gets an ``AgentSession`` on the worker's session endpoint; the agent gets that session's URL and
secret (``run.AgentRun``) and every model call it makes, in any of the endpoint's dialects, is one turn of the
episode (see ``sessions.session``). Where the agent runs (in the worker, in an agent process of ``pool``, or as a
process of its own) is ``runtime``'s business; the session, and so every turn and event, is the worker's either
way. Outcomes, attributed to one boundary each:

- the agent returns a number or a dict with ``reward``: ``EpisodeFinished`` (``completed``, or ``truncated``
  when a call found the turn budget or the context used up) with the reward, and ``info`` holding the agent's
  ``answer`` and ``agent_info``;
- the agent raises (a harness process exits non-zero): ``EpisodeFailed`` class ``agent`` with the traceback (the
  end of its stderr) in the reason (the worker goes on);
- the agent runs past ``agent_timeout_s``: it is cancelled (a process killed) with its in-flight generations,
  class ``timeout``;
- its agent process dies before it returns: class ``agent`` (retryable within ``retry_agent``), saying how;
- the agent returns without a single model call, or returns something else: class ``agent``, saying so;
- the policy produced no turn for a call (the inference budget is spent): class ``inference``, whatever the
  agent did with the 503 it got.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rollout_ledger.services.env_worker.agents.run import AgentResult, AgentRun, AgentSpec, RunEnd, RunOutcome
from rollout_ledger.services.env_worker.attempt import Attempt, AttemptDeps, AttemptOutcome, recorded_turn_event
from rollout_ledger.services.env_worker.resume_reader import Recorded, ResumeUnavailable
from rollout_ledger.services.env_worker.sessions.app import SessionRegistry
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.sessions.turns import Message
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript
from rollout_ledger.shared.events import (
    EpisodeRequested,
    FailureClass,
    ResumeInfo,
    ResumeMode,
    SamplingParams,
    TrajectoryStatus,
    TurnGenerated,
)
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.resume import RecordedTurn

log = get_logger(__name__)

AgentRunner = Callable[[AgentRun], Awaitable[RunOutcome]]
"""Runs one agent call (``AgentRuntime.run_agent``)."""


class AgentEpisode:
    """One attempt of an agent episode: the agent function against its session (single use).

    Resume (``agent_replay``): an attempt after the first reads the recorded turns and runs the agent again; each
    call whose context is the recorded context of that turn is answered with the recorded turn, token-exact and
    without inference (its step names the recorded turn), until the first call that differs, which is generated
    live, as is every call after it."""

    def __init__(self, deps: AttemptDeps, item: EpisodeRequested, attempt: int, agent: AgentSpec,
                 sessions: SessionRegistry, timeout_s: float, runner: AgentRunner) -> None:
        self.attempt = Attempt(deps, item, attempt)
        self.deps = deps
        self.item = item
        self.agent = agent
        self.sessions = sessions
        self.timeout_s = timeout_s
        self.runner = runner
        """Where the agent function runs (in this process, or in an agent process of the pool)."""
        self._replay: _AgentReplay | None = None
        self._resume = ResumeInfo(mode=ResumeMode.RESTART)

    # --- EpisodeSink (what the session calls) --------------------------------------------------------
    @property
    def sampling(self) -> SamplingParams:
        return self.item.sampling

    @property
    def max_turns(self) -> int:
        return self.item.max_turns

    @property
    def max_model_len(self) -> int:
        return self.deps.max_model_len

    def batch_cancelled(self) -> bool:
        return self.deps.is_cancelled(self.item.batch_id)

    async def publish_started(self, transcript: Transcript, messages: list[Message]) -> None:
        resume = self._resume if self.attempt.attempt > 1 else None
        await self.attempt.publish_started(transcript, messages, resume)

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        """Turn ``t`` with the call's sampling: the recorded turn when the call repeats it, else from an inference
        worker (sticky to the previous turn's worker; ``InferenceError`` when the budget is spent)."""
        if self._replay is not None:
            recorded = self._replay.answer(t, context, max_tokens)
            if recorded is not None:
                self.attempt.turns += 1
                self.attempt.last_worker = recorded.worker_id
                return recorded_turn_event(recorded, self.item, self.attempt.attempt)
            log.info("agent.replay_ended", turn=t, reused=len(self._replay.reused))
            self._replay.stop()
        return await self.attempt.request_turn(t, context, sampling, max_tokens)

    async def publish_step(self, t: int, turn: TurnGenerated, action: str, observation: list[Message],
                           delta: Delta, *, final: bool, reward: float = 0.0, terminated: bool = False,
                           truncated: bool = False, info: dict[str, Any] | None = None) -> None:
        text = "\n".join(str(m.get("content") or "") for m in observation)
        reused = self._replay.reused.get(t) if self._replay is not None else None
        await self.attempt.publish_step(t, turn.event_id, action, "" if final else text, delta, reward=reward,
                                        terminated=terminated, truncated=truncated, info=info or {},
                                        reused_from=reused)

    # --- the attempt ----------------------------------------------------------------------------------
    async def run(self) -> AttemptOutcome:
        a = self.attempt
        with a.bind_log(agent=self.agent.name):
            if self.deps.is_cancelled(self.item.batch_id):
                return await a.cancelled()
            await self._prepare_replay()
            session = AgentSession(self, self.deps.template, self.sessions.model_name)
            secret = self.sessions.open(a.ep, session)
            run = AgentRun(agent=self.agent.name, task=copy.deepcopy(self.item.task),
                           base_url=self.sessions.url(a.ep), api_key=secret, timeout_s=self.timeout_s)
            try:
                outcome = await self.runner(run)
            finally:
                self.sessions.close(a.ep)
                await session.close()
            try:
                return await self._conclude(session, outcome)
            finally:
                self._count_resume()

    async def _prepare_replay(self) -> None:
        """Read the recorded turns an attempt after the first may answer calls with."""
        a = self.attempt
        if a.attempt <= 1:
            return
        if self.deps.resume is None:
            self._resume = ResumeInfo(mode=ResumeMode.RESTART, reason="resume is off in this worker")
            return
        try:
            recorded = await self.deps.resume.read(a.ep, a.attempt)
        except ResumeUnavailable as exc:
            log.warning("episode.resume_unavailable", reason=str(exc))
            self._resume = ResumeInfo(mode=ResumeMode.RESTART, reason=str(exc))
            return
        if recorded is None or not recorded.turns:
            self._resume = ResumeInfo(mode=ResumeMode.RESTART, reason="no turn recorded",
                                      from_attempt=recorded.source_attempt if recorded else 0,
                                      turns_unstepped=recorded.unstepped_turns if recorded else 0)
            return
        self._replay = _AgentReplay(recorded)
        self._resume = ResumeInfo(mode=ResumeMode.AGENT_REPLAY, from_attempt=recorded.source_attempt,
                                  turns_recorded=len(recorded.turns), turns_unstepped=recorded.unstepped_turns)

    def _count_resume(self) -> None:
        self.attempt.count_resume(self._resume, len(self._replay.reused) if self._replay is not None else 0)

    async def _conclude(self, session: AgentSession, outcome: RunOutcome) -> AttemptOutcome:
        a = self.attempt
        ending = session.ending
        if outcome.end is RunEnd.TIMEOUT:
            await session.finish(0.0)
            how = f" ({outcome.message})" if outcome.message else ""
            return await a.failed(FailureClass.TIMEOUT, f"agent {self.agent.name} ran past its {self.timeout_s:g}s "
                                  f"deadline after {session.turns} model calls; it and its in-flight generations "
                                  f"were cancelled{how}", retryable=True)
        if ending is not None and ending.status == "cancelled":
            await session.finish(0.0)
            return await a.cancelled()
        if ending is not None and ending.failure_class is not None:
            await session.finish(0.0)
            return await a.failed(ending.failure_class, ending.reason, retryable=ending.retryable)
        if outcome.end is RunEnd.LOST:
            await session.finish(0.0)
            log.warning("agent.lost", reason=outcome.message)
            return await a.failed(FailureClass.AGENT, f"agent {self.agent.name}: {outcome.message} (after "
                                  f"{session.turns} model calls)", retryable=True)
        if outcome.end is RunEnd.RAISED and ending is None:
            await session.finish(0.0)
            log.warning("agent.raised", error=outcome.error)
            return await a.failed(FailureClass.AGENT, outcome.message, retryable=True)
        if session.turns == 0:
            return await a.failed(FailureClass.AGENT, f"no model calls: agent {self.agent.name} returned without "
                                  "calling the policy (its client's base_url is the session endpoint)")
        if outcome.end is RunEnd.INVALID:
            await session.finish(0.0)
            return await a.failed(FailureClass.AGENT, outcome.message)
        result = outcome.result if outcome.end is RunEnd.RETURNED and outcome.result is not None else AgentResult(0.0)
        status, stop = TrajectoryStatus.COMPLETED, "agent_returned"
        if ending is not None:  # a call found the turn budget or the context used up
            status, stop = TrajectoryStatus.TRUNCATED, ending.reason
        extra: dict[str, Any] = {"answer": result.answer, "agent_info": result.info, "model_calls": session.turns}
        if outcome.end is RunEnd.RAISED:
            extra["agent_error"] = outcome.error
        await session.finish(result.reward, info=extra)  # the last step's info: queryable in SQL (steps.info)
        a.reward = result.reward
        return await a.finished(status, stop, extra)


class _AgentReplay:
    """The recorded turns of an agent episode, each with the context it was generated from: a call with that
    context (and room for the recorded tokens) is answered with it, until the first call that differs."""

    def __init__(self, recorded: Recorded) -> None:
        self.turns = recorded.turns
        self.contexts = recorded_contexts(recorded)
        self.reused: dict[int, str] = {}
        """Turn index -> the recorded step it repeats, for the turns answered from the record."""
        self.active = True

    def answer(self, t: int, context: Any, max_tokens: int) -> RecordedTurn | None:
        if not self.active or t >= len(self.turns) or t in self.reused:
            return None
        turn = self.turns[t]
        if len(turn.token_ids) > max_tokens or not np.array_equal(np.asarray(context), self.contexts[t]):
            return None
        self.reused[t] = turn.step_event_id
        return turn

    def stop(self) -> None:
        self.active = False


def recorded_contexts(recorded: Recorded) -> list[np.ndarray]:
    """The context each recorded turn was generated from: its segment of prompt + Σ(sampled + observation ids), as
    the recorder assembles it (a step with ``new_segment`` starts a segment after its turn's sampled ids)."""
    parts: list[np.ndarray] = [np.asarray(recorded.prompt_token_ids, dtype=np.int32)]
    seq = parts[0]
    seg_start = 0
    contexts: list[np.ndarray] = []
    for turn in recorded.turns:
        contexts.append(seq[seg_start:].copy())
        sampled_end = len(seq) + len(turn.token_ids)
        seq = np.concatenate([seq, np.asarray(turn.token_ids, dtype=np.int32),
                              np.asarray(turn.observation_token_ids, dtype=np.int32)])
        if turn.new_segment:
            seg_start = sampled_end
    return contexts
