"""The one lifecycle of a service process: ``run_main`` reads its settings, configures logging, installs the SIGTERM
handler and exits with the service's code; ``ServiceScope`` holds what every service opens (the ops HTTP server,
tracing, the NATS connection with the project's topology, and the service's own closers) and closes it in reverse
order once the service drained.

    def main() -> None:
        run_main("recorder", RecorderSettings, run)

    async def run(settings: RecorderSettings, shutdown: Shutdown) -> None:
        async with ServiceScope("recorder", settings, health, metrics.registry) as scope:
            nc = await scope.connect()
            scope.on_close(store.dispose)
            ...  # serve until shutdown, then drain; the scope closes NATS, tracing and HTTP

Settings that do not validate end the process with exit code 2 and one log line naming each bad field (never its
value: a password may be among them).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, NoReturn, TypeVar

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import configure_logging, get_logger
from rollout_ledger.shared.kit.runtime import Health, HttpServer, Shutdown, ops_app
from rollout_ledger.shared.kit.settings import BaseServiceSettings
from rollout_ledger.shared.kit.tracing import Tracing, setup_tracing

log = get_logger(__name__)

S = TypeVar("S", bound=BaseServiceSettings)

BAD_SETTINGS_EXIT = 2
"""The exit code of a service whose settings do not validate (a supervisor should not restart it unchanged)."""


def bad_settings(exc: ValidationError) -> str:
    """The fields ``exc`` names, each with what is wrong, without the values given."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(settings)'}: {e['msg']}" for e in exc.errors())


def run_main(name: str, settings_type: type[S], run: Callable[[S, Shutdown], Awaitable[int | None]]) -> NoReturn:
    """The ``main`` of service ``name``: settings from the environment (exit 2, naming the bad fields, when they do
    not validate), logging, SIGTERM/SIGINT setting the ``Shutdown`` given to ``run``, and ``run``'s code (None: 0)
    as the exit code."""
    try:
        settings = settings_type()
    except ValidationError as exc:
        configure_logging(service=name)
        log.error("service.bad_settings", error=bad_settings(exc), code=BAD_SETTINGS_EXIT)
        sys.exit(BAD_SETTINGS_EXIT)
    configure_logging(settings.log_level, settings.log_format, service=name)

    async def _main() -> int | None:
        shutdown = Shutdown()
        shutdown.install()
        return await run(settings, shutdown)

    sys.exit(asyncio.run(_main()) or 0)


class ServiceScope:
    """What one service process opens, closed in reverse order on exit (after ``health`` is marked draining)."""

    def __init__(self, name: str, settings: BaseServiceSettings, health: Health, registry: CollectorRegistry) -> None:
        self.name = name
        self.settings = settings
        self.health = health
        self.http = HttpServer(ops_app(name, health, registry), settings.http_host, settings.http_port)
        """``/healthz``, ``/readyz`` and ``/metrics`` (shared/kit/runtime.py), started on entry."""
        self.tracing: Tracing = Tracing.off()
        """Off unless a collector is configured (``ROLLOUT_TRACING_ENDPOINT``); buffered spans exported on exit."""
        self.nc: bus.NATS | None = None
        self._closers = contextlib.AsyncExitStack()

    async def __aenter__(self) -> ServiceScope:
        await self.http.start()
        self._closers.push_async_callback(self.http.stop)
        self.tracing = setup_tracing(self.settings, self.name)
        self._closers.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.health.draining = True
        self.health.ready = False
        await self._closers.aclose()
        log.info("service.stopped", service=self.name)

    async def connect(self, *, initial_wait_s: float = 30.0, topology: bool = True) -> bus.NATS:
        """Connect to NATS as ``<name>-<worker_id>`` (its health check ``nats`` set), declare the project's streams,
        consumers' topology and buckets (``topology``), and close the connection on exit."""
        nc = await bus.connect(self.settings.nats_url, name=f"{self.name}-{self.settings.worker_id}",
                               connect_timeout_s=self.settings.nats_connect_timeout_s, initial_wait_s=initial_wait_s)
        self.nc = nc
        self._closers.push_async_callback(bus.close, nc)
        self.health.checks["nats"] = lambda: nc.is_connected
        if topology:
            await bus.ensure_topology(nc.jetstream(), self.settings.stream_replicas)
        return nc

    def on_close(self, close: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Await ``close(*args)`` on exit, before what was opened earlier is closed."""
        self._closers.push_async_callback(close, *args)
