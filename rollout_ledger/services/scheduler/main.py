"""Entry point of ``rollout serve scheduler``: the API and ops routes on one uvicorn server, drained on SIGTERM."""

from __future__ import annotations

from rollout_ledger.services.scheduler.app import SERVICE, create_app, scheduler_lifespan
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.state import SchedulerState
from rollout_ledger.shared.errors import RolloutError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import HttpServer, Shutdown
from rollout_ledger.shared.kit.service import run_main

log = get_logger(__name__)


async def run(settings: SchedulerSettings, shutdown: Shutdown) -> int:
    """Serve until SIGTERM/SIGINT, then stop taking requests, finish those in flight and close; the exit code. (The
    API and the ops routes share one server: the app is not a ``ServiceScope``'s ops app; ``scheduler_lifespan``
    opens NATS and Postgres.)"""
    app = create_app(settings, with_lifespan=False)
    state: SchedulerState = app.state.scheduler
    try:
        async with scheduler_lifespan(app):
            server = HttpServer(app, settings.http_host, settings.http_port)
            await server.start()
            log.info("scheduler.listening", host=settings.http_host, port=server.port)
            await shutdown.wait()
            log.info("scheduler.draining")
            state.health.draining = True
            await server.stop()  # uvicorn finishes in-flight requests; then the lifespan closes NATS and Postgres
    except RolloutError as exc:
        if state.startup_error is not exc:
            raise
        log.error("scheduler.exit", reason=str(exc), code=1)
        return 1
    log.info("scheduler.exit", reason="shutdown", code=0)
    return 0


def main() -> None:
    """Read settings from the environment (exit 2 naming a bad one), configure logging, run the scheduler."""
    run_main(SERVICE, SchedulerSettings, run)
