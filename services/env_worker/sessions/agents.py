"""Agent functions as environments: ``async def run(task, client) -> reward | {"reward", "info", "answer"}``,
registered by ``module:function`` (``ROLLOUT_AGENTS="name=module:function"``), run one per episode.

Each episode gets an ``AgentSession`` on the worker's session endpoint and its own ``openai.AsyncOpenAI``
client on that session's URL; every chat call of the agent is one turn of the episode (see ``session``).
Outcomes, attributed to one boundary each:

- the agent returns a number or a dict with ``reward``: ``EpisodeFinished`` (``completed``, or ``truncated``
  when a call found the turn budget or the context used up) with the reward, and ``info`` holding the agent's
  ``answer`` and ``agent_info``;
- the agent raises: ``EpisodeFailed`` class ``agent`` with the traceback in the reason (the worker goes on);
- the agent runs past ``agent_timeout_s``: it is cancelled with its in-flight generations, class ``timeout``;
- the agent returns without a single model call, or returns something else: class ``agent``, saying so;
- the policy produced no turn for a call (the inference budget is spent): class ``inference``, whatever the
  agent did with the 503 it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import inspect
import math
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.driver import AttemptOutcome, DriverDeps, EpisodeDriver, _jsonable
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

AgentFunction = Callable[[dict[str, Any], Any], Awaitable[Any]]
"""``async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict``."""

_REASON_CHARS = 1900
"""Room for the traceback in ``EpisodeFailed.reason`` (the event keeps 2,000 characters)."""


class AgentLoadError(ValueError):
    """An agent entry cannot be parsed or its function imported (the worker refuses to start)."""


@dataclass(frozen=True)
class AgentSpec:
    """A registered agent function."""

    name: str
    """The env name batches use."""
    target: str
    """``module:function``."""
    function: AgentFunction
    description: str = ""

    def advert(self, registered_by: str) -> dict[str, Any]:
        """The ``rl_envs`` bucket value (the scheduler accepts the name as an env)."""
        return {"name": self.name, "description": self.description or f"agent function {self.target}",
                "multi_turn": True, "example_task": {}, "registered_by": registered_by, "kind": "agent",
                "agent": self.target}


def parse_agents(value: str) -> dict[str, str]:
    """``"a=pkg.mod:fn, b=other:run"`` -> ``{"a": "pkg.mod:fn", "b": "other:run"}`` (``AgentLoadError`` when
    an entry is malformed or a name repeats)."""
    out: dict[str, str] = {}
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, target = entry.partition("=")
        name, target = name.strip(), target.strip()
        module, colon, attr = target.partition(":")
        if not sep or not name or not colon or not module or not attr:
            raise AgentLoadError(f"agent entry {entry!r}: expected name=module:function")
        if name in out:
            raise AgentLoadError(f"agent {name!r} is listed twice")
        out[name] = target
    return out


def load_agent(name: str, target: str) -> AgentSpec:
    """Import ``module:function`` (an ``async def`` taking ``(task, client)``)."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:  # as uvicorn does: modules of the directory the worker runs in import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentLoadError(f"agent {name!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    function: Any = module
    for part in attr.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise AgentLoadError(f"agent {name!r}: {module_name} has no {attr}")
    if not inspect.iscoroutinefunction(function):
        raise AgentLoadError(f"agent {name!r}: {target} must be an async function run(task, client)")
    doc = inspect.getdoc(function) or ""
    return AgentSpec(name=name, target=target, function=function, description=doc.split("\n", 1)[0])


def load_agents(value: str) -> dict[str, AgentSpec]:
    """Every agent of a ``ROLLOUT_AGENTS`` value, imported."""
    return {name: load_agent(name, target) for name, target in parse_agents(value).items()}


@dataclass(frozen=True)
class AgentResult:
    """What an agent returned, checked."""

    reward: float
    info: dict[str, Any]
    answer: Any


def agent_result(value: Any) -> AgentResult:
    """The reward, info and answer of an agent's return value; ``ValueError`` saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        raise ValueError(f"the agent returned {type(value).__name__}; expected a number (the reward) or a dict "
                         "with 'reward' (and optionally 'info', 'answer')")
    if isinstance(value, dict):
        reward = value.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"the agent's result has no numeric 'reward' (got {reward!r})")
        info = value.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError(f"the agent's 'info' must be a dict, got {type(info).__name__}")
        result = AgentResult(float(reward), _jsonable(info), _jsonable({"a": value.get("answer")})["a"])
    else:
        result = AgentResult(float(value), {}, None)
    if not math.isfinite(result.reward):
        raise ValueError(f"the agent's reward is not finite ({result.reward})")
    return result


def _failure_reason(agent: AgentSpec, exc: BaseException) -> str:
    """The exception and the end of its traceback (the frames nearest the error matter most)."""
    head = f"agent {agent.name} ({agent.target}) raised {type(exc).__name__}: {exc}"[:400]
    tb = "".join(traceback.format_exception(exc))
    room = _REASON_CHARS - len(head) - 1
    return f"{head}\n{tb[-room:]}" if room > 0 else head


class AgentEpisode(EpisodeDriver):
    """One attempt of an agent episode: the agent function against its session (single use)."""

    def __init__(self, deps: DriverDeps, item: EpisodeRequested, attempt: int, agent: AgentSpec,
                 sessions: SessionRegistry, timeout_s: float) -> None:
        super().__init__(deps, item, attempt)
        self.agent = agent
        self.sessions = sessions
        self.timeout_s = timeout_s
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
            from openai import AsyncOpenAI  # the SDK only where agents run

            session = AgentSession(self, self.deps.template, self.sessions.model_name)
            secret = self.sessions.open(self.ep, session)
            client = AsyncOpenAI(base_url=self.sessions.url(self.ep), api_key=secret, max_retries=0,
                                 timeout=self.timeout_s or None)
            result: Any = None
            error: BaseException | None = None
            timed_out = False
            try:
                timeout = asyncio.timeout(self.timeout_s or None)
                try:
                    async with timeout:
                        result = await self.agent.function(copy.deepcopy(self.item.task), client)
                except TimeoutError as exc:
                    if timeout.expired():
                        timed_out = True
                    else:
                        error = exc
                except Exception as exc:  # user code: any exception is the agent's failure
                    error = exc
            finally:
                self.sessions.close(self.ep)
                await session.close()
                with contextlib.suppress(Exception):
                    await client.close()
            return await self._conclude(session, result, error, timed_out)

    async def _conclude(self, session: AgentSession, result: Any, error: BaseException | None,
                        timed_out: bool) -> AttemptOutcome:
        ending = session.ending
        if timed_out:
            await session.finish(0.0)
            return await self._failed(FailureClass.TIMEOUT, f"agent {self.agent.name} ran past its {self.timeout_s:g}s "
                                      f"deadline after {session.turns} model calls; it and its in-flight generations "
                                      "were cancelled", retryable=True)
        if ending is not None and ending.status == "cancelled":
            await session.finish(0.0)
            return await self._cancelled()
        if ending is not None and ending.failure_class is not None:
            await session.finish(0.0)
            return await self._failed(ending.failure_class, ending.reason, retryable=ending.retryable)
        if error is not None and ending is None:
            await session.finish(0.0)
            log.warning("agent.raised", error=f"{type(error).__name__}: {error}")
            return await self._failed(FailureClass.AGENT, _failure_reason(self.agent, error), retryable=True)
        if session.turns == 0:
            return await self._failed(FailureClass.AGENT, f"no model calls: agent {self.agent.name} returned without "
                                      "calling the policy (its client's base_url is the session endpoint)")
        try:
            outcome = agent_result(result) if error is None else AgentResult(0.0, {}, None)
        except ValueError as exc:
            await session.finish(0.0)
            return await self._failed(FailureClass.AGENT, f"agent {self.agent.name}: {exc}")
        status, stop = TrajectoryStatus.COMPLETED, "agent_returned"
        if ending is not None:  # a call found the turn budget or the context used up
            status, stop = TrajectoryStatus.TRUNCATED, ending.reason
        extra: dict[str, Any] = {"answer": outcome.answer, "agent_info": outcome.info, "model_calls": session.turns}
        if error is not None:
            extra["agent_error"] = f"{type(error).__name__}: {error}"[:500]
        await session.finish(outcome.reward, info=extra)  # the last step's info: queryable in SQL (steps.info)
        return await self._agent_finished(status, stop, outcome.reward, extra)

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
    """The agents of one worker, the registry of their sessions and their timeout: what the worker consults for
    a work item whose env names an agent."""

    def __init__(self, agents: dict[str, AgentSpec], sessions: SessionRegistry, timeout_s: float) -> None:
        self.agents = agents
        self.sessions = sessions
        self.timeout_s = timeout_s
        self.server: HttpServer | None = None

    @classmethod
    async def start(cls, settings: EnvWorkerSettings) -> AgentRuntime | None:
        """Import ``settings.agents`` and serve their sessions on ``session_host:session_port``; None without
        agents (no session server then)."""
        agents = load_agents(settings.agents)
        if not agents:
            return None
        runtime = cls(agents, SessionRegistry(Path(settings.model).name or "policy"), settings.agent_timeout_s)
        runtime.server = HttpServer(session_app(runtime.sessions), settings.session_host, settings.session_port)
        await runtime.server.start()
        host = "127.0.0.1" if settings.session_host in ("", "0.0.0.0", "::") else settings.session_host
        runtime.sessions.base_url = settings.session_url.rstrip("/") or f"http://{host}:{runtime.server.port}"
        log.info("agents.ready", agents=runtime.names(), sessions=runtime.sessions.base_url)
        return runtime

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def driver(self, deps: DriverDeps, item: EpisodeRequested, attempt: int) -> AgentEpisode | None:
        """The episode of ``item`` when its env is one of the agents, else None."""
        agent = self.agents.get(item.env)
        if agent is None:
            return None
        deadlines = [t for t in (self.timeout_s, deps.episode_timeout_s) if t > 0]  # the nearer one applies
        return AgentEpisode(deps, item, attempt, agent, self.sessions, min(deadlines, default=0.0))

    async def register(self, js: JetStreamContext, worker_id: str) -> None:
        """Advertise every agent in the ``rl_envs`` bucket (the scheduler accepts their names as envs)."""
        kv = await js.key_value(ENVS_BUCKET)
        for spec in self.agents.values():
            await kv.put(env_key(spec.name), dumps(spec.advert(registered_by=worker_id)))

    def names(self) -> list[str]:
        return sorted(self.agents)
