"""The agents of one env worker: which envs are agents, where their runs go (this process's event loop or the pool
of agent processes), and the session server their episodes call.
"""

from __future__ import annotations

from pathlib import Path

from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.agents.episode import AgentEpisode
from rollout_ledger.services.env_worker.agents.pool import AgentPool
from rollout_ledger.services.env_worker.agents.run import (
    AgentRun,
    AgentSpec,
    RunOutcome,
    load_agents,
    run_agent,
    shared_http_client,
)
from rollout_ledger.services.env_worker.attempt import AttemptDeps
from rollout_ledger.services.env_worker.sessions.app import SessionRegistry, session_app
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.shared.events import EpisodeRequested, dumps
from rollout_ledger.shared.kit.bus import bucket
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import HttpServer
from rollout_ledger.shared.subjects import ENVS_BUCKET, env_key

log = get_logger(__name__)


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

    def driver(self, deps: AttemptDeps, item: EpisodeRequested, attempt: int) -> AgentEpisode | None:
        """The episode of ``item`` when its env is one of the agents, else None."""
        agent = self.agents.get(item.env)
        if agent is None:
            return None
        deadlines = [t for t in (self.timeout_s, deps.episode_timeout_s) if t > 0]  # the nearer one applies
        return AgentEpisode(deps, item, attempt, agent, self.sessions, min(deadlines, default=0.0), self.run_agent)

    async def register(self, js: JetStreamContext, worker_id: str) -> None:
        """Advertise every agent in the ``rl_envs`` bucket (the scheduler accepts their names as envs)."""
        kv = await bucket(js, ENVS_BUCKET)
        for spec in self.agents.values():
            await kv.put(env_key(spec.name), dumps(spec.advert(registered_by=worker_id)))

    def names(self) -> list[str]:
        return sorted(self.agents)
