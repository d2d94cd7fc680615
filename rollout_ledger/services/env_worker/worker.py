"""The env worker: sets up what its episodes need (topology, leases, env adverts, cancel watch, publisher,
inference client, policy gate), takes work until shutdown, then drains. A facade over the parts that each own one
job: the consumers of its routes (``work_consumers.py``), the pull loop (``pull_loop.py``: free slots -> fetch),
the episode runner (``episode_runner.py``: claim under lease, park or hand back, run attempts, ack or nak) and the
drain on SIGTERM (``drain.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.agents.agent_runtime import AgentRuntime
from rollout_ledger.services.env_worker.attempt import AttemptDeps
from rollout_ledger.services.env_worker.cancellation import CancelWatch
from rollout_ledger.services.env_worker.drain import drain
from rollout_ledger.services.env_worker.episode_runner import EpisodeRunner
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.leases import EpisodeLeases
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.services.env_worker.pull_loop import PullLoop
from rollout_ledger.services.env_worker.resume_reader import ResumeReader
from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.routing import WorkerReport, register_adverts, report_forever, routes_of
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.env_worker.work_consumers import LEGACY, WorkConsumers
from rollout_ledger.services.envs.base import EnvLLM
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import Health, Shutdown
from rollout_ledger.shared.kit.tracing import Tracing

log = get_logger(__name__)


async def register_envs(js: JetStreamContext, envs: EnvRegistry, worker_id: str) -> None:
    """Advertise this worker's envs in the ``rl_envs`` bucket (the scheduler's list of known envs and their routes;
    a family as one entry, routing.py)."""
    await register_adverts(js, envs.specs(), worker_id)


class EnvWorker:
    """Runs episodes from the work queue with at most ``settings.concurrency`` in flight."""

    def __init__(self, settings: EnvWorkerSettings, nc: NATS, envs: EnvRegistry, template: TurnTemplate,
                 metrics: EnvWorkerMetrics, health: Health, agents: AgentRuntime | None = None,
                 env_llm: EnvLLM | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing if tracing is not None else Tracing.off()
        """An attempt's span continues the trace of its work item; turns and env calls are its children."""
        self.env_llm = env_llm
        """The chat LLM handed to envs (a simulated user); None: envs get none."""
        self.agents = agents
        """Agent functions run as envs (their episodes talk to the policy through the session endpoint)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.envs = envs
        self.template = template
        self.metrics = metrics
        self.health = health
        self.cancels = CancelWatch()
        self.client = InferenceClient(
            nc,
            InferenceClientConfig(
                request_timeout_s=settings.inference_request_timeout_s,
                max_tries=settings.inference_max_tries,
                backoff_initial_s=settings.inference_backoff_s,
                backoff_max_s=settings.inference_backoff_max_s,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
            ),
            on_retry=metrics.inference_retries.inc,
            on_latency=metrics.turn_latency.observe,
            tracing=self.tracing,
        )
        self.publisher = StreamPublisher(nc, settings.publish_timeout_s, self.tracing, retry_for_s=bus.RETRY_FOR_S)
        self.gate = EpisodeGate(PolicyBus(self.js), settings.worker_id, drain_timeout_s=settings.policy_drain_timeout_s,
                                report_s=settings.policy_report_s, alive=lambda w: w in self.client.workers,
                                metrics=metrics)
        """Holds new episodes back while a policy version announced in mode ``drain`` is being swapped in."""
        self._stopping = asyncio.Event()
        metrics.cancelled_batches.set_function(lambda: len(self.cancels.cancelled))
        self.consumers = WorkConsumers(self.js, settings)
        """The pull subscriptions of this worker's routes (and of the legacy subject)."""
        self.pulls = PullLoop(self.consumers, self.gate, settings, self._stopping)
        """Free slots -> fetches; its ``tasks`` are the work items in flight."""
        metrics.work_items_held.set_function(lambda: len(self.pulls.tasks))
        self.routes = routes_of(envs.specs(), agents.names() if agents is not None else ())
        """Route -> the envs of this worker routed by it: the routes whose consumers it pulls."""
        self._env_names = frozenset(e for names in self.routes.values() for e in names)
        self.leases = EpisodeLeases(self.js, settings.worker_id, uuid.uuid4().hex[:12])

    def _deps(self) -> AttemptDeps:
        resume = ResumeReader(self.nc, self.settings.resume_timeout_s) if self.settings.resume else None
        return AttemptDeps(publisher=self.publisher, client=self.client.requests, envs=self.envs,
                          template=self.template, is_cancelled=self.cancels.is_cancelled, metrics=self.metrics,
                          worker_id=self.settings.worker_id, max_model_len=self.settings.max_model_len,
                          publish_timeout_s=self.settings.publish_timeout_s,
                          budgets=RetryBudgets(self.settings.retry_budgets()),
                          episode_timeout_s=self.settings.episode_timeout_s, env_llm=self.env_llm,
                          tracing=self.tracing, resume=resume)

    def _route_of(self, env: str) -> str:
        """The route of one of this worker's envs (an agent function's is its name)."""
        return next((route for route, names in self.routes.items() if env in names), env)

    async def run(self, shutdown: Shutdown) -> None:
        """Set up, take work until ``shutdown``, then drain."""
        s = self.settings
        await bus.ensure_topology(self.js, s.stream_replicas)
        await self.leases.start()
        await register_envs(self.js, self.envs, s.worker_id)
        if self.agents is not None:
            await self.agents.register(self.js, s.worker_id)
        await self.cancels.start(self.js)
        await self.publisher.start()
        await self.client.start()
        if not await self.client.wait_for_workers(s.inference_discovery_s):
            log.warning("env_worker.no_inference_workers", waited_s=s.inference_discovery_s)
        await self.gate.start()  # after the heartbeats: which inference workers are live
        deps = self._deps()
        report = WorkerReport(s.worker_id, list(self.routes), sorted({e for es in self.routes.values() for e in es}),
                              s.legacy_work_queue)
        reporter = asyncio.create_task(report_forever(self.js, report, self._stopping))
        self.health.checks["nats"] = lambda: self.nc.is_connected
        self.health.ready = True
        log.info("env_worker.ready", envs=self.envs.names(), routes=list(self.routes), concurrency=s.concurrency)
        runner = EpisodeRunner(s, self.leases, self.metrics, deps, envs=self._env_names, route_of=self._route_of,
                               agents=self.agents, tracing=self.tracing)
        pullers = [*self.routes, *([LEGACY] if s.legacy_work_queue else [])]
        try:
            async with asyncio.TaskGroup() as group:
                for route in pullers:
                    group.create_task(self.pulls.pull(route, runner.handle, shutdown))
        finally:
            self._stopping.set()
            self.health.draining = True
            await drain(self.pulls.tasks, s.drain_timeout_s)
            await self.consumers.close()
            with contextlib.suppress(Exception):
                await reporter
            await self.gate.stop()
            await self.client.stop()
            await self.publisher.stop()
            await self.cancels.stop()
