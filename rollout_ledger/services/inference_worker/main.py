"""Entry point of ``rollout serve inference-worker``: wires settings, NATS, the engine, the server and HTTP."""

from __future__ import annotations

import asyncio

from rollout_ledger.services.inference_worker.checkpoints import check_compatible
from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.services.inference_worker.engines import build_engine
from rollout_ledger.services.inference_worker.metrics import InferenceMetrics
from rollout_ledger.services.inference_worker.server import InferenceServer, WorkerIdentity
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.services.inference_worker.weights import EpisodeDrain, PolicyFollower, Weights
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.kit.runtime import Health, Shutdown, sleep_or_stop
from rollout_ledger.shared.kit.service import ServiceScope, run_main
from rollout_ledger.shared.policy_versions import EnvPolicyReport
from rollout_ledger.shared.subjects import POLICY_ENV_BUCKET

SERVICE = "inference-worker"
ENGINE_CHECK_S = 1.0
"""How often the worker checks that its engine is still alive."""

log = get_logger(__name__)


async def run(settings: InferenceSettings, shutdown: Shutdown, *, engine: Engine | None = None,
              health: Health | None = None) -> None:
    """Serve until ``shutdown`` is set, then drain. ``engine`` and ``health`` may be given (in-process tests)."""
    metrics = InferenceMetrics.create()
    health = health if health is not None else Health()
    engine_died = False
    async with ServiceScope(SERVICE, settings, health, metrics.registry) as scope:
        if engine is None:
            engine = build_engine(settings)
        nc = await scope.connect()
        scope.on_close(engine.stop)  # before NATS closes: the engine's last replies still go out
        await engine.start()
        identity = WorkerIdentity(settings.worker_id, settings.weight_version, settings.max_inflight,
                                  settings.heartbeat_s, pool=settings.pool)
        weights = Weights(engine, settings.weight_version, settings.swap_drain_timeout_s,
                          on_swap=metrics.swap_seconds.observe)
        failed_load: list[BaseException] = []

        async def _failed_load(exc: BaseException) -> None:
            failed_load.append(exc)  # the engine may be half-loaded: stop serving (the loop below exits)

        policy = PolicyBus(nc.jetstream())
        env_reports = policy.reports(POLICY_ENV_BUCKET, EnvPolicyReport)
        await env_reports.start()

        async def _precheck(checkpoint: str) -> None:
            await asyncio.to_thread(check_compatible, settings.model, checkpoint)

        episode_drain = EpisodeDrain(env_reports, settings.episode_drain_timeout_s, precheck=_precheck,
                                     on_waited=metrics.episode_drain_seconds.observe,
                                     on_timeout=metrics.episode_drain_timeouts.inc)
        follower = PolicyFollower(policy, weights, settings.worker_id, settings.policy_report_s,
                                  on_failed_load=_failed_load, episode_drain=episode_drain)
        if identity.is_policy:  # a worker of another pool (a simulated user's model) never applies policy versions
            await follower.start()  # serves the announced version from the first turn on (loaded here if newer)
        metrics.weight_version.set_function(lambda: weights.serving)
        server = InferenceServer(nc, engine, identity, metrics, weights, scope.tracing)
        await server.start()
        served = engine
        health.checks["engine"] = lambda: served.healthy
        health.ready = True
        log.info("service.ready", http_port=scope.http.port, engine=engine.name,
                 weight_version=settings.weight_version)
        while not await sleep_or_stop(shutdown, ENGINE_CHECK_S):
            if failed_load or not engine.healthy:
                engine_died = True
                log.error("inference_worker.engine_dead", action="stopping: requesters fail over to other workers, "
                          "the supervisor restarts this one")
                break
        health.draining = True
        await follower.stop()
        await env_reports.stop()
        await server.drain(settings.drain_timeout_s)
    if engine_died:
        raise InferenceError("the inference engine died; exiting so that the worker is restarted", retryable=True)


def main() -> None:
    run_main(SERVICE, InferenceSettings, run)
