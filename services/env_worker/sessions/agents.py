"""Agent functions as environments: ``async def run(task, client) -> reward | {"reward", "info", "answer"}``,
registered by ``module:function`` (``ROLLOUT_AGENTS="name=module:function"``), run one per episode.

Each episode gets an ``AgentSession`` on the worker's session endpoint and its own ``openai.AsyncOpenAI``
client on that session's URL (all clients of a process share one HTTP client); every chat call of the agent is
one turn of the episode (see ``session``). The agent function runs in one of the worker's agent processes
(``agent_pool``, ``agent_processes`` of them) or, with ``agent_processes=0``, on the worker's own event loop; the
session, and so every turn and event, is the worker's either way. Outcomes, attributed to one boundary each:

- the agent returns a number or a dict with ``reward``: ``EpisodeFinished`` (``completed``, or ``truncated``
  when a call found the turn budget or the context used up) with the reward, and ``info`` holding the agent's
  ``answer`` and ``agent_info``;
- the agent raises: ``EpisodeFailed`` class ``agent`` with the traceback in the reason (the worker goes on);
- the agent runs past ``agent_timeout_s``: it is cancelled with its in-flight generations, class ``timeout``;
- its agent process dies before it returns: class ``agent`` (retryable within ``retry_agent``), saying how;
- the agent returns without a single model call, or returns something else: class ``agent``, saying so;
- the policy produced no turn for a call (the inference budget is spent): class ``inference``, whatever the
  agent did with the 503 it got.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.driver import AttemptOutcome, DriverDeps, EpisodeDriver
from rollout_ledger.services.env_worker.sessions.agent_pool import AgentPool
from rollout_ledger.services.env_worker.sessions.agent_run import (
    AgentLoadError,
    AgentResult,
    AgentRun,
    AgentSpec,
    RunEnd,
    RunOutcome,
    agent_result,
    load_agent,
    load_agents,
    parse_agents,
    run_agent,
    shared_http_client,
)
from rollout_ledger.services.env_worker.sessions.app import SessionRegistry, session_app
from rollout_ledger.services.env_worker.sessions.protocol import Message
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript
from rollout_ledger.shared.errors import TokenizationError
from rollout_ledger.shared.events import (
    EpisodeFinished,
    EpisodeRequested,
    FailureClass,
    InferenceRequested,
    SamplingParams,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    dumps,
)
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import HttpServer
from rollout_ledger.shared.subjects import ENVS_BUCKET, env_key

log = get_logger(__name__)

AgentRunner = Callable[[AgentRun], Awaitable[RunOutcome]]
"""Runs one agent call (``AgentRuntime.run_agent``)."""

__all__ = ["AgentEpisode", "AgentLoadError", "AgentRuntime", "AgentSpec", "agent_result", "load_agent",
           "load_agents", "parse_agents"]

class AgentEpisode(EpisodeDriver):
    """One attempt of an agent episode: the agent function against its session (single use)."""

    def __init__(self, deps: DriverDeps, item: EpisodeRequested, attempt: int, agent: AgentSpec,
                 sessions: SessionRegistry, timeout_s: float, runner: AgentRunner) -> None:
        super().__init__(deps, item, attempt)
        self.agent = agent
        self.sessions = sessions
        self.timeout_s = timeout_s
        self.runner = runner
        """Where the agent function runs (in this process, or in an agent process of the pool)."""
        self._sticky: str | None = None
        """The inference worker of the previous turn (its prefix cache is warm)."""

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
        self.transcript = transcript
        await self._started(transcript, messages)

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        """Turn ``t`` with the call's sampling (sticky to the previous turn's worker; ``InferenceError`` when the
        budget is spent)."""
        common: dict[str, Any] = {"episode_id": self.ep, "batch_id": self.item.batch_id, "attempt": self.attempt,
                                  "seq": 2 * t + 1, "produced_by": self.deps.produced_by}

        def build(try_no: int) -> InferenceRequested:
            rid = self.request_id(t, try_no)
            return InferenceRequested(event_id=rid, request_id=rid, turn_index=t, prompt_token_ids=context,
                                      sampling=sampling, max_tokens=max_tokens, reply_seq=2 * t + 1, **common)

        turn = await self.deps.client.generate(build, prefer=self._sticky)
        self.turns += 1
        self._sticky = turn.worker_id
        return turn

    async def publish_step(self, t: int, turn: TurnGenerated, action: str, observation: list[Message],
                           delta: Delta, *, final: bool, reward: float = 0.0, terminated: bool = False,
                           truncated: bool = False, info: dict[str, Any] | None = None) -> None:
        text = "\n".join(str(m.get("content") or "") for m in observation)
        step = StepCompleted(
            **self._common(f"{self.ep}:a{self.attempt}:s{t}", 2 * t + 2),
            turn_index=t, turn_event_id=turn.event_id, action=action, observation="" if final else text,
            observation_token_ids=delta.ids, reward=reward, terminated=terminated, truncated=truncated,
            info=info or {}, drift=None if delta.drift is None else delta.drift.value, new_segment=delta.new_segment,
        )
        await self._publish_async(step)
        self.kept = t + 1

    # --- the attempt ----------------------------------------------------------------------------------
    async def run(self) -> AttemptOutcome:
        with structlog.contextvars.bound_contextvars(episode_id=self.ep, batch_id=self.item.batch_id,
                                                     attempt=self.attempt, agent=self.agent.name):
            if self.deps.is_cancelled(self.item.batch_id):
                return await self._cancelled()
            session = AgentSession(self, self.deps.template, self.sessions.model_name)
            secret = self.sessions.open(self.ep, session)
            run = AgentRun(agent=self.agent.name, task=copy.deepcopy(self.item.task),
                           base_url=self.sessions.url(self.ep), api_key=secret, timeout_s=self.timeout_s)
            try:
                outcome = await self.runner(run)
            finally:
                self.sessions.close(self.ep)
                await session.close()
            return await self._conclude(session, outcome)

    async def _conclude(self, session: AgentSession, outcome: RunOutcome) -> AttemptOutcome:
        ending = session.ending
        if outcome.end is RunEnd.TIMEOUT:
            await session.finish(0.0)
            how = f" ({outcome.message})" if outcome.message else ""
            return await self._failed(FailureClass.TIMEOUT, f"agent {self.agent.name} ran past its {self.timeout_s:g}s "
                                      f"deadline after {session.turns} model calls; it and its in-flight generations "
                                      f"were cancelled{how}", retryable=True)
        if ending is not None and ending.status == "cancelled":
            await session.finish(0.0)
            return await self._cancelled()
        if ending is not None and ending.failure_class is not None:
            await session.finish(0.0)
            return await self._failed(ending.failure_class, ending.reason, retryable=ending.retryable)
        if outcome.end is RunEnd.LOST:
            await session.finish(0.0)
            log.warning("agent.lost", reason=outcome.message)
            return await self._failed(FailureClass.AGENT, f"agent {self.agent.name}: {outcome.message} (after "
                                      f"{session.turns} model calls)", retryable=True)
        if outcome.end is RunEnd.RAISED and ending is None:
            await session.finish(0.0)
            log.warning("agent.raised", error=outcome.error)
            return await self._failed(FailureClass.AGENT, outcome.message, retryable=True)
        if session.turns == 0:
            return await self._failed(FailureClass.AGENT, f"no model calls: agent {self.agent.name} returned without "
                                      "calling the policy (its client's base_url is the session endpoint)")
        if outcome.end is RunEnd.INVALID:
            await session.finish(0.0)
            return await self._failed(FailureClass.AGENT, outcome.message)
        result = outcome.result if outcome.end is RunEnd.RETURNED and outcome.result is not None else AgentResult(0.0)
        status, stop = TrajectoryStatus.COMPLETED, "agent_returned"
        if ending is not None:  # a call found the turn budget or the context used up
            status, stop = TrajectoryStatus.TRUNCATED, ending.reason
        extra: dict[str, Any] = {"answer": result.answer, "agent_info": result.info, "model_calls": session.turns}
        if outcome.end is RunEnd.RAISED:
            extra["agent_error"] = outcome.error
        await session.finish(result.reward, info=extra)  # the last step's info: queryable in SQL (steps.info)
        return await self._agent_finished(status, stop, result.reward, extra)

    async def _agent_finished(self, status: TrajectoryStatus, stop_reason: str, reward: float,
                              extra: dict[str, Any]) -> AttemptOutcome:
        transcript = self.transcript
        if transcript is None:
            raise TokenizationError("an agent episode finished before its first call")
        self.reward = reward
        checks = transcript.check_results()
        info: dict[str, Any] = {"token_check": "ok" if all(checks) else "mismatch",
                                "segment_checks": ["ok" if c else "mismatch" for c in checks], **extra}
        if transcript.drifts:
            info["drifts"] = [{"turn": t, "class": d.value} for t, d in transcript.drifts]
        if info["token_check"] != "ok":
            log.warning("episode.token_check_mismatch", turns=self.turns)
        event = EpisodeFinished(**self._common(self._end_id, 2 * self.turns + 1), status=status, reward=reward,
                                num_turns=self.turns, num_tokens=len(transcript), stop_reason=stop_reason,
                                info=info)
        return await self._terminal(event, status.value)


class AgentRuntime:
    """The agents of one worker, the registry of their sessions, their timeout and where they run (in this
    process, or in the pool of agent processes): what the worker consults for a work item whose env names an
    agent."""

    def __init__(self, agents: dict[str, AgentSpec], sessions: SessionRegistry, timeout_s: float,
                 pool: AgentPool | None = None) -> None:
        self.agents = agents
        self.sessions = sessions
        self.timeout_s = timeout_s
        self.pool = pool
        """The agent processes (None: agents run on this process's event loop)."""
        self.http = shared_http_client()
        """The HTTP client of every in-process agent's ``AsyncOpenAI``."""
        self.server: HttpServer | None = None

    @classmethod
    async def start(cls, settings: EnvWorkerSettings) -> AgentRuntime | None:
        """Import ``settings.agents``, start ``agent_processes`` processes running them (0: none, they run here)
        and serve their sessions on ``session_host:session_port``; None without agents (no session server then)."""
        agents = load_agents(settings.agents)
        if not agents:
            return None
        pool = await AgentPool(settings.agents, settings.agent_processes).start() if settings.agent_processes else None
        runtime = cls(agents, SessionRegistry(Path(settings.model).name or "policy"), settings.agent_timeout_s, pool)
        try:
            runtime.server = HttpServer(session_app(runtime.sessions), settings.session_host, settings.session_port)
            await runtime.server.start()
        except BaseException:
            await runtime.stop()
            raise
        host = "127.0.0.1" if settings.session_host in ("", "0.0.0.0", "::") else settings.session_host
        runtime.sessions.base_url = settings.session_url.rstrip("/") or f"http://{host}:{runtime.server.port}"
        log.info("agents.ready", agents=runtime.names(), sessions=runtime.sessions.base_url,
                 agent_processes=len(pool.procs) if pool is not None else 0)
        return runtime

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.stop()
        if self.server is not None:
            await self.server.stop()
        await self.http.shutdown()

    async def run_agent(self, run: AgentRun) -> RunOutcome:
        """Run one agent call where this worker runs agents."""
        if self.pool is not None:
            return await self.pool.run(run)
        return await run_agent(self.agents[run.agent], run, self.http)

    def driver(self, deps: DriverDeps, item: EpisodeRequested, attempt: int) -> AgentEpisode | None:
        """The episode of ``item`` when its env is one of the agents, else None."""
        agent = self.agents.get(item.env)
        if agent is None:
            return None
        deadlines = [t for t in (self.timeout_s, deps.episode_timeout_s) if t > 0]  # the nearer one applies
        return AgentEpisode(deps, item, attempt, agent, self.sessions, min(deadlines, default=0.0), self.run_agent)

    async def register(self, js: JetStreamContext, worker_id: str) -> None:
        """Advertise every agent in the ``rl_envs`` bucket (the scheduler accepts their names as envs)."""
        kv = await js.key_value(ENVS_BUCKET)
        for spec in self.agents.values():
            await kv.put(env_key(spec.name), dumps(spec.advert(registered_by=worker_id)))

    def names(self) -> list[str]:
        return sorted(self.agents)
