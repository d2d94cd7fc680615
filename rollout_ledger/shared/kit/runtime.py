"""Process plumbing every service shares: the ops HTTP app (/healthz, /readyz, /metrics), uvicorn, SIGTERM.

A service builds its own ``CollectorRegistry`` (no import-time globals), mounts its routes on the app
returned by ``ops_app`` and runs until ``Shutdown.event`` is set by SIGTERM/SIGINT, then drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from rollout_ledger.shared.deploy import LIVENESS_PATH, METRICS_PATH, READINESS_PATH
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)


@dataclass
class Health:
    """Liveness is the process answering and every ``live`` check returning True (a service whose work loop can
    hang says so there); readiness is ``ready`` and every check returning True."""

    ready: bool = False
    checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    draining: bool = False
    live: dict[str, Callable[[], bool]] = field(default_factory=dict)

    def status(self) -> tuple[bool, dict[str, bool]]:
        results = {name: bool(check()) for name, check in self.checks.items()}
        ok = self.ready and not self.draining and all(results.values())
        return ok, results

    def liveness(self) -> tuple[bool, dict[str, bool]]:
        results = {name: bool(check()) for name, check in self.live.items()}
        return all(results.values()), results


def ready_gauge(health: Health, registry: CollectorRegistry) -> Gauge:
    """``rollout_ready`` in ``registry``: 1 while /readyz would answer 200, else 0 (read from ``health`` at each
    scrape, so it never goes stale)."""
    gauge = Gauge("rollout_ready", "1 while this process is ready (/readyz answers 200), else 0", registry=registry)
    gauge.set_function(lambda: 1.0 if health.status()[0] else 0.0)
    return gauge


def ops_app(service: str, health: Health, registry: CollectorRegistry, app: FastAPI | None = None) -> FastAPI:
    """Add /healthz, /readyz and /metrics to ``app`` (a new FastAPI app when None), and ``rollout_ready`` to
    ``registry``."""
    app = app or FastAPI(title=f"rollout-ledger {service}", docs_url=None, redoc_url=None)
    ready_gauge(health, registry)

    @app.get(LIVENESS_PATH, include_in_schema=False)
    async def healthz(response: Response) -> dict[str, Any]:
        ok, checks = health.status()
        alive, live = health.liveness()
        if not alive:
            response.status_code = 503
        return {"service": service, "alive": alive, "ready": ok, "draining": health.draining, "checks": checks,
                **({"live": live} if live else {})}

    @app.get(READINESS_PATH, include_in_schema=False)
    async def readyz(response: Response) -> dict[str, Any]:
        ok, checks = health.status()
        if not ok:
            response.status_code = 503
        return {"service": service, "ready": ok, "checks": checks}

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service's ``Shutdown`` owns SIGTERM/SIGINT and stops the
    HTTP server last, after the drain, so /healthz and /metrics answer while work drains."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn inside the service's event loop; ``port`` is the bound port (also when asked for 0).

    Lifespan is off: services own their clients in their ``run`` coroutine, not in an ASGI lifespan.
    """

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None, access_log=False,
                                lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("HTTP server stopped during start")
            await asyncio.sleep(0.02)
        for srv in self.server.servers:
            for sock in srv.sockets:
                self.port = int(sock.getsockname()[1])
                return

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=10)


class BackgroundHttpServer:
    """An ``HttpServer`` on its own event loop in a daemon thread, for a service whose work loop is synchronous
    (``rollout export --follow``): ``start`` returns once it listens, ``stop`` ends it."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._http = HttpServer(app, host, port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl-http", daemon=True)

    @property
    def port(self) -> int:
        return self._http.port

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._http.start(), self._loop).result(timeout_s)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._http.stop(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class Shutdown:
    """Set by SIGTERM or SIGINT; services stop taking work and drain when it is set."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("service.signal", signal=sig.name)
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


Stop = Shutdown | asyncio.Event
"""What ends a service's loops: its ``Shutdown`` (SIGTERM) or an event of its own (a component's ``stop``)."""


def _event(stop: Stop) -> asyncio.Event:
    return stop.event if isinstance(stop, Shutdown) else stop


async def sleep_or_stop(stop: Stop, seconds: float) -> bool:
    """Sleep up to ``seconds``, waking as soon as ``stop`` is set; True when it is set (before or meanwhile)."""
    event = _event(stop)
    if not event.is_set() and seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=seconds)
    return event.is_set()


async def ticks(stop: Stop, interval_s: float, *, at_once: bool = True) -> AsyncIterator[int]:
    """The one loop of a periodic duty: yields the tick number at once (or, without ``at_once``, after the first
    pause: the duty ran at start already), then again every ``interval_s`` until ``stop`` is set, which ends the pause
    early and the loop at once.

    ``async for _ in ticks(stop, 5.0): await report()``: the body runs whole (a set ``stop`` does not cut it), and a
    duty that fails inside the body handles its failure there (an exception ends the loop, as in a plain loop)."""
    event = _event(stop)
    if not at_once and await sleep_or_stop(event, interval_s):
        return
    tick = 0
    while not event.is_set():
        yield tick
        tick += 1
        if await sleep_or_stop(event, interval_s):
            return
