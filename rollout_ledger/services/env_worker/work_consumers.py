"""The work consumers an env worker pulls from: one per route of its envs (``routing.py``) and, during an upgrade,
the previous release's single subject (``LEGACY``), each declared on ``RL_WORK`` and bound to a pull
subscription, declared and bound again when the server refused it or lost it."""

from __future__ import annotations

from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import Shutdown, sleep_or_stop
from rollout_ledger.shared.subjects import WORK_CONSUMER, WORK_STREAM, WORK_SUBJECT, work_consumer, work_subject

log = get_logger(__name__)

LEGACY = ""
"""The key of the legacy consumer among a worker's pullers (no route is empty)."""

_SUBSCRIBE_RETRY_S = 5.0
"""Pause before trying again to declare a route's consumer the server refused (e.g. ``RL_WORK`` does not take the
route subjects yet: during an upgrade only the scheduler's NATS user may update the stream)."""


class WorkConsumers:
    """Route (``LEGACY``: the legacy subject) -> the pull subscription bound to its consumer."""

    def __init__(self, js: JetStreamContext, settings: EnvWorkerSettings) -> None:
        self.js = js
        self.settings = settings
        self.subs: dict[str, JetStreamContext.PullSubscription] = {}

    def __getitem__(self, route: str) -> JetStreamContext.PullSubscription:
        return self.subs[route]

    async def subscribe(self, route: str) -> JetStreamContext.PullSubscription:
        """Declare the consumer of ``route`` (``LEGACY``: the previous release's subject) and bind a pull to it."""
        s = self.settings
        legacy = route == LEGACY
        spec = bus.work_consumer_spec(s.ack_wait_s, s.max_deliver, s.max_ack_pending, None if legacy else route)
        await bus.ensure_consumer(self.js, spec)
        return await self.js.pull_subscribe(WORK_SUBJECT if legacy else work_subject(route),
                                            durable=WORK_CONSUMER if legacy else work_consumer(route),
                                            stream=WORK_STREAM)

    async def bind(self, route: str, shutdown: Shutdown) -> None:
        """Declare the consumer of ``route`` and bind a pull to it, trying again until it works (or ``shutdown``)."""
        while not shutdown.requested and route not in self.subs:
            try:
                with bus.bus_errors(f"subscribe to route {route or '(legacy)'}"):
                    self.subs[route] = await self.subscribe(route)
            except BusError as exc:  # refused or NATS reconnecting: again later
                log.warning("work.subscribe_failed", route=route or "(legacy)", error=str(exc),
                            retry_s=_SUBSCRIBE_RETRY_S)
                await sleep_or_stop(shutdown, _SUBSCRIBE_RETRY_S)

    async def rebind(self, route: str, shutdown: Shutdown) -> None:
        """Drop the pull of ``route`` (e.g. its consumer is gone) and declare and bind it again."""
        with bus.best_effort("unsubscribe a route's consumer"):
            await self.subs.pop(route).unsubscribe()
        await self.bind(route, shutdown)

    async def close(self) -> None:
        """Unsubscribe every pull (best effort: the worker is stopping)."""
        for psub in self.subs.values():
            with bus.best_effort("unsubscribe a route's consumer"):
                await psub.unsubscribe()
