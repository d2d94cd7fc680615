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
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import configure_logging, get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.kit.runtime import Health, HttpServer, Shutdown, ops_app, sleep_or_shutdown
from rollout_ledger.shared.kit.tracing import setup_tracing
from rollout_ledger.shared.policy import EnvPolicyReport
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
    http = HttpServer(ops_app(SERVICE, health, metrics.registry), settings.http_host, settings.http_port)
    nc: bus.NATS | None = None
    engine_died = False
    tracing = setup_tracing(settings, SERVICE)  # off unless a collector is configured (ROLLOUT_TRACING_ENDPOINT)
    try:
        await http.start()
        if engine is None:
            engine = build_engine(settings)
        nc = await bus.connect(settings.nats_url, name=f"{SERVICE}-{settings.worker_id}",
                               connect_timeout_s=settings.nats_connect_timeout_s)
        await bus.ensure_topology(nc.jetstream(), settings.stream_replicas)
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
        server = InferenceServer(nc, engine, identity, metrics, weights, tracing)
        await server.start()
        conn = nc
        served = engine
        health.checks["nats"] = lambda: conn.is_connected
        health.checks["engine"] = lambda: served.healthy
        health.ready = True
        log.info("service.ready", http_port=http.port, engine=engine.name, weight_version=settings.weight_version)
        while not await sleep_or_shutdown(shutdown, ENGINE_CHECK_S):
            if failed_load or not engine.healthy:
                engine_died = True
                log.error("inference_worker.engine_dead", action="stopping: requesters fail over to other workers, "
                          "the supervisor restarts this one")
                break
        health.draining = True
        await follower.stop()
        await env_reports.stop()
        await server.drain(settings.drain_timeout_s)
    finally:
        health.ready = False
        if engine is not None:
            await engine.stop()
        await bus.close(nc)
        await http.stop()
        await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered
        log.info("service.stopped")
    if engine_died:
        raise InferenceError("the inference engine died; exiting so that the worker is restarted", retryable=True)


async def _main(settings: InferenceSettings) -> None:
    shutdown = Shutdown()
    shutdown.install()
    await run(settings, shutdown)


def main() -> None:
    settings = InferenceSettings()
    configure_logging(settings.log_level, settings.log_format, service=SERVICE)
    asyncio.run(_main(settings))
