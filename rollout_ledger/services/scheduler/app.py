"""The scheduler's FastAPI app factory: lifespan (NATS, Postgres, schema check, outbox), routes, errors, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_ledger.services.scheduler import policy_registry, queue_gauges
from rollout_ledger.services.scheduler.admission import Admission
from rollout_ledger.services.scheduler.api import batches, episodes
from rollout_ledger.services.scheduler.api import envs as envs_api
from rollout_ledger.services.scheduler.api import policy as policy_api
from rollout_ledger.services.scheduler.api.deps import Scope as TokenScope
from rollout_ledger.services.scheduler.api.deps import check_scope
from rollout_ledger.services.scheduler.api.error_responses import (
    describe_validation_errors,
    on_unavailable,
    on_validation_error,
)
from rollout_ledger.services.scheduler.api.guard import BodyGuard
from rollout_ledger.services.scheduler.api.openapi import behaving_schema
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics, create_metrics
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.state import Resources, SchedulerState
from rollout_ledger.services.scheduler.trajectory_view import TokenizerCache
from rollout_ledger.services.scheduler.viewer import routes as viewer_api
from rollout_ledger.services.scheduler.viewer.pages import mount_viewer
from rollout_ledger.services.scheduler.work_items import WorkItemPublisher
from rollout_ledger.shared.db import check_schema, create_engine
from rollout_ledger.shared.deploy import METRICS_PATH
from rollout_ledger.shared.errors import BusError, StoreError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import Health, ops_app
from rollout_ledger.shared.kit.tracing import setup_tracing
from rollout_ledger.shared.subjects import (
    CANCEL_BUCKET,
    ENV_WORKERS_BUCKET,
    ENVS_BUCKET,
    POLICY_BUCKET,
    POLICY_WORKERS_BUCKET,
)

log = get_logger(__name__)

__all__ = ["SERVICE", "create_app", "describe_validation_errors", "scheduler_lifespan"]

SERVICE = "scheduler"


@contextlib.asynccontextmanager
async def scheduler_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect NATS and Postgres (refusing an old schema), run the outbox; on exit stop it and close the clients."""
    state: SchedulerState = app.state.scheduler
    settings = state.settings
    nc: bus.NATS | None = None
    engine = None
    try:
        engine = create_engine(settings.database_url, pool_size=settings.db_pool_size)
        await check_schema(engine)
        nc = await bus.connect(settings.nats_url, name=f"scheduler-{settings.worker_id}",
                               connect_timeout_s=settings.nats_connect_timeout_s,
                               initial_wait_s=settings.nats_initial_wait_s)
        js = nc.jetstream()
        try:
            await bus.ensure_topology(js, settings.stream_replicas)
            envs_kv = await bus.bucket(js, ENVS_BUCKET)
            cancel_kv = await bus.bucket(js, CANCEL_BUCKET)
            policy_kv = await bus.bucket(js, POLICY_BUCKET)
            policy_workers_kv = await bus.bucket(js, POLICY_WORKERS_BUCKET)
            env_workers_kv = await bus.bucket(js, ENV_WORKERS_BUCKET)
        except bus.NATS_FAILURES as exc:
            raise bus.as_bus_error(exc, "declare the streams and buckets") from exc
    except Exception as exc:
        state.startup_error = exc
        log.error("scheduler.start_refused", error=str(exc), error_type=type(exc).__name__)
        await bus.close(nc)
        if engine is not None:
            await engine.dispose()
        raise
    tracing = setup_tracing(settings, SERVICE)  # off unless a collector is configured (ROLLOUT_TRACING_ENDPOINT)
    producer = StreamPublisher(nc, settings.publish_timeout_s)  # work items carry their own root span's context
    await producer.start()
    publisher = WorkItemPublisher(js, producer, engine, settings, state.metrics, tracing)
    admission = Admission(engine, publisher, policy_kv, policy_workers_kv, state.metrics,
                          interval_s=settings.admission_interval_s)
    state.resources = Resources(nc, js, engine, envs_kv, cancel_kv, publisher, policy_kv, policy_workers_kv,
                                admission)
    state.db_ok = True
    state.health.checks["nats"] = lambda: nc.is_connected
    state.health.checks["postgres"] = lambda: state.db_ok

    def _on_pass(ok: bool) -> None:
        state.db_ok = ok

    stop = asyncio.Event()
    outbox = asyncio.create_task(publisher.run_outbox(stop, _on_pass), name="scheduler-outbox")
    mirror = asyncio.create_task(policy_registry.run_mirror(policy_workers_kv, engine, stop, on_report=admission.nudge),
                                 name="scheduler-policy-mirror")
    admitting = asyncio.create_task(admission.run(stop), name="scheduler-admission")
    gauging = asyncio.create_task(queue_gauges.run(state.metrics, js, env_workers_kv, stop),
                                  name="scheduler-queue-gauges")
    state.health.ready = True
    log.info("scheduler.ready")
    try:
        yield
    finally:
        state.health.ready = False
        stop.set()
        for task in (outbox, mirror, admitting, gauging):
            try:
                await asyncio.wait_for(task, timeout=settings.drain_timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception as exc:  # the mirror's failure must not hide the outbox's clean stop
                log.warning("scheduler.task_failed", task=task.get_name(), error=str(exc))
        state.resources = None
        await producer.stop()
        await bus.close(nc)
        await engine.dispose()
        await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered
        log.info("scheduler.stopped")


def _route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"


class _MetricsMiddleware:
    """Counts requests by method, route template and status, and observes their latency."""

    def __init__(self, app: ASGIApp, metrics: SchedulerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_code = 500

        async def _send(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = _route_label(scope)
            method = str(scope.get("method", ""))
            self.metrics.http_requests.labels(method, route, str(status_code)).inc()
            self.metrics.http_latency.labels(method, route).observe(time.perf_counter() - started)


class _MetricsAuth:
    """``/metrics`` behind a read token when ``ROLLOUT_METRICS_AUTH=read`` (the ops routes are shared, plain)."""

    def __init__(self, app: ASGIApp, settings: SchedulerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == METRICS_PATH and self.settings.metrics_auth == "read":
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            try:
                check_scope(self.settings, header, TokenScope.READ)
            except HTTPException as exc:
                await JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                                   headers=exc.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: SchedulerSettings, *, with_lifespan: bool = True) -> FastAPI:
    """A scheduler app; its lifespan connects NATS and Postgres (refusing an old schema) and runs the outbox.

    ``with_lifespan=False`` leaves ``scheduler_lifespan`` to the caller (``main.run`` enters it around the
    server so a refusal to start becomes a clean exit code instead of uvicorn's ``SystemExit(3)``).
    """
    metrics = create_metrics()
    health = Health()
    app = FastAPI(
        title="Rollout Ledger scheduler",
        summary="Submit batches of RL episodes, follow them, cancel them, read their token-exact trajectories.",
        version="1",
        lifespan=scheduler_lifespan if with_lifespan else None,
    )
    app.state.scheduler = SchedulerState(
        settings=settings, health=health, metrics=metrics, tokenizers=TokenizerCache(settings.model)
    )
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StoreError, on_unavailable)
    app.add_exception_handler(BusError, on_unavailable)
    app.include_router(batches.router)
    app.include_router(episodes.router)
    app.include_router(envs_api.router)
    app.include_router(policy_api.router)
    app.include_router(viewer_api.router)
    mount_viewer(app)
    ops_app(SERVICE, health, metrics.registry, app)
    app.openapi = behaving_schema(app, settings)  # type: ignore[method-assign]  # FastAPI's documented override
    app.add_middleware(BodyGuard, settings=settings)
    app.add_middleware(_MetricsAuth, settings=settings)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app
