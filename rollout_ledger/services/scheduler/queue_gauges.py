"""The work queue and the env workers as the scheduler's gauges: work items waiting and unacked per route, and live
env workers per route, read from JetStream and ``rl_env_workers`` every ``QUEUE_GAUGE_INTERVAL_S``.

Cost per read: one stream info of ``RL_WORK`` (its subjects: one per route with items), one consumer list of
``RL_WORK`` (one entry per route consumer) and the live env workers' entries (``envs.live_workers``); nothing is
read per work item. Every scheduler replica reads the same values: dashboards and alerts take ``max`` over them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.metrics import SchedulerMetrics
from rollout_ledger.services.scheduler.route_book import live_workers
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.bus import NATS_FAILURES, as_bus_error, bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.subjects import (
    WORK_CONSUMER,
    WORK_STREAM,
    WORK_SUBJECT,
    route_of_token,
    work_consumer_subject,
)

log = get_logger(__name__)

QUEUE_GAUGE_INTERVAL_S = 15.0
"""How often the queue gauges are read (a typical scrape interval: fresher values would not be seen)."""
LEGACY_ROUTE = WORK_CONSUMER
"""The ``route`` label of the items a previous release queued on the single subject ``WORK_SUBJECT`` (the legacy
consumer's name: no route token can be it, a route's consumer being ``env-workers-<token>``)."""


@dataclass(frozen=True)
class RouteQueue:
    """One route's work items: not yet delivered, and delivered but not acked."""

    waiting: int
    unacked: int


def route_of_subject(subject: str) -> str | None:
    """The route label of a work subject: ``LEGACY_ROUTE`` for ``WORK_SUBJECT``, the route for
    ``WORK_SUBJECT.<token>``; None for anything else."""
    if subject == WORK_SUBJECT:
        return LEGACY_ROUTE
    prefix = f"{WORK_SUBJECT}."
    if subject.startswith(prefix) and "." not in subject[len(prefix):]:
        return route_of_token(subject[len(prefix):])
    return None


async def read_queue(js: JetStreamContext) -> dict[str, RouteQueue]:
    """Route -> its work items (``BusError`` when JetStream cannot be read).

    ``waiting`` is the route consumer's ``num_pending`` (items not yet delivered to any worker); a route whose items
    have no consumer yet (no env worker with the route ever started) has all of them waiting. ``unacked`` is the
    consumer's ``num_ack_pending``: episodes running, or held by a worker's policy gate or lease check."""
    with bus_errors("read the work queue's state"):
        info = await js.stream_info(WORK_STREAM, subjects_filter=">")
        consumers = await js.consumers_info(WORK_STREAM)
    items: dict[str, int] = {}
    for subject, count in (info.state.subjects or {}).items():
        route = route_of_subject(subject)
        if route is not None:
            items[route] = items.get(route, 0) + int(count)
    out = {route: RouteQueue(waiting=n, unacked=0) for route, n in items.items()}
    for consumer in consumers:
        name = consumer.name or (consumer.config.durable_name if consumer.config else None) or ""
        filtered = work_consumer_subject(name)
        served = route_of_subject(filtered) if filtered is not None else None
        if served is None:  # not a work consumer this project declares (e.g. an operator's ad-hoc one)
            continue
        out[served] = RouteQueue(waiting=int(consumer.num_pending or 0), unacked=int(consumer.num_ack_pending or 0))
    return out


async def read_live_routes(js: JetStreamContext, workers_kv: KeyValue) -> dict[str, int]:
    """Route -> live env workers serving it (``BusError`` when ``rl_env_workers`` cannot be read)."""
    counts: dict[str, int] = {}
    try:
        workers = await live_workers(js, workers_kv)
    except BusError:
        raise
    except NATS_FAILURES as exc:
        raise as_bus_error(exc, "read the live env workers") from exc
    for worker in workers:
        for route in set(worker.routes):
            counts[route] = counts.get(route, 0) + 1
    return counts


def set_queue_gauges(metrics: SchedulerMetrics, queue: dict[str, RouteQueue], live: dict[str, int]) -> None:
    """Replace the per-route gauges: every route with items, a consumer or a live worker gets all three (0 where it
    has none), so "items waiting on a route no worker serves" is one comparison; routes gone since drop out."""
    routes = set(queue) | set(live)
    for gauge in (metrics.work_waiting, metrics.work_unacked, metrics.env_workers_live):
        gauge.clear()
    for route in sorted(routes):
        q = queue.get(route, RouteQueue(0, 0))
        metrics.work_waiting.labels(route=route).set(q.waiting)
        metrics.work_unacked.labels(route=route).set(q.unacked)
        metrics.env_workers_live.labels(route=route).set(live.get(route, 0))


async def refresh(metrics: SchedulerMetrics, js: JetStreamContext, workers_kv: KeyValue) -> None:
    """One read of the queue and the live workers into the gauges (both read before any gauge changes)."""
    queue = await read_queue(js)
    live = await read_live_routes(js, workers_kv)
    set_queue_gauges(metrics, queue, live)


async def run(metrics: SchedulerMetrics, js: JetStreamContext, workers_kv: KeyValue, stop: asyncio.Event,
              interval_s: float = QUEUE_GAUGE_INTERVAL_S) -> None:
    """Until ``stop``: ``refresh`` every ``interval_s``; a failed read keeps the last values and is logged."""
    async for _ in ticks(stop, interval_s):
        try:
            await refresh(metrics, js, workers_kv)
        except BusError as exc:
            log.warning("scheduler.queue_gauges_failed", error=str(exc))
