"""Env-aware routing on the env worker's side: which routes it serves, what it advertises in ``rl_envs``, its live
report in ``rl_env_workers``, and the fair split of its free slots between the consumers of its routes.

Work is published per route (``rl.work.episodes.<token>``, ``shared/subjects.py``): the route of an env is its family
(``rg`` for every ``rg:<dataset>``) or its own name. Each route has one durable pull consumer, ``env-workers-<token>``,
shared by every worker that has the route, so a worker is only ever handed episodes of envs it has; episodes of an env
no live worker has stay on the work queue (work-queue retention keeps what no consumer took) until one starts.

A worker pulls from one consumer per route and from the legacy consumer (the previous release's single subject).
``FairSlots`` bounds the items it asks for by its free slots and splits them fairly: a route whose last pull came back
empty keeps a one-item probe open, the routes that found work share the free slots evenly.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext

from rollout_ledger.services.envs.base import EnvSpec
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import dumps
from rollout_ledger.shared.kit.bus import best_effort, bucket, bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.route_advert import RouteAdvert
from rollout_ledger.shared.subjects import ENV_WORKER_TTL_S, ENV_WORKERS_BUCKET, ENVS_BUCKET, env_key

log = get_logger(__name__)

def routes_of(specs: Iterable[EnvSpec], agents: Iterable[str] = ()) -> dict[str, list[str]]:
    """Route -> the env names of this worker routed by it (agent functions are routed by their own name)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        out.setdefault(spec.route, []).append(spec.name)
    for name in agents:
        out.setdefault(name, []).append(name)
    return {route: sorted(names) for route, names in sorted(out.items())}


def adverts(specs: Iterable[EnvSpec], worker_id: str) -> dict[str, dict[str, Any]]:
    """``rl_envs`` entry name -> advert: each env's own advert with its ``route``; the members of a family as ONE
    entry ``<family>:*`` listing them (so ``GET /v1/envs`` is not flooded by a family's ~100 members)."""
    out: dict[str, dict[str, Any]] = {}
    families: dict[str, list[EnvSpec]] = {}
    for spec in specs:
        if spec.family:
            families.setdefault(spec.family, []).append(spec)
        else:
            out[spec.name] = {**spec.advert(registered_by=worker_id),
                              **RouteAdvert.for_env(spec.name, spec.route).format()}
    for family, members in families.items():
        members = sorted(members, key=lambda s: s.name)
        routing = RouteAdvert.for_family(family, [m.name for m in members])
        out[routing.name] = {
            "name": routing.name,
            "description": f"{len(members)} envs of the family {family!r}: submit a batch with env "
                           f"'<member>' (one of members), e.g. {members[0].name!r}",
            "multi_turn": any(m.multi_turn for m in members),
            "example_task": members[0].example_task,
            "registered_by": worker_id,
            **routing.format(),
        }
    return out


async def register_adverts(js: JetStreamContext, specs: Iterable[EnvSpec], worker_id: str) -> None:
    """Put this worker's adverts into the ``rl_envs`` bucket (the scheduler's list of known envs and their routes)."""
    kv = await bucket(js, ENVS_BUCKET)
    for name, advert in adverts(specs, worker_id).items():
        await kv.put(env_key(name), dumps(advert))


@dataclass(frozen=True)
class WorkerReport:
    """This worker's entry in ``rl_env_workers`` (expires ``ENV_WORKER_TTL_S`` after its last write)."""

    worker: str
    routes: list[str]
    """The routes whose consumers it pulls from."""
    envs: list[str]
    """Every env it runs (a family's members and agent functions included)."""
    legacy: bool
    """Whether it also pulls the previous release's single work subject."""

    def encode(self) -> bytes:
        return dumps({"worker": self.worker, "routes": self.routes, "envs": self.envs, "legacy": self.legacy})


async def report_forever(js: JetStreamContext, report: WorkerReport, stop: asyncio.Event) -> None:
    """Write ``report`` every ``ENV_WORKER_TTL_S / 3`` until ``stop``, then delete it (the scheduler stops counting
    this worker at once rather than after the TTL)."""
    kv = await bucket(js, ENV_WORKERS_BUCKET)
    key = env_key(report.worker)
    async for _ in ticks(stop, ENV_WORKER_TTL_S / 3):
        try:
            with bus_errors("report the worker's envs"):
                await kv.put(key, report.encode())
        except BusError as exc:  # NATS reconnecting: the next tick writes it again
            log.warning("env_worker.report_failed", error=str(exc))
    with best_effort("delete this worker's report"):
        await kv.delete(key)


class FairSlots:
    """How many work items each route's puller may ask for now (see the module docstring).

    ``in_use()`` counts the items this worker holds (running or waiting at its gates). A route that found work last
    time ("hungry") asks for its even share of the slots neither running nor asked for by another hungry route's
    pull in flight. A route that found nothing keeps one probe open (a pull of one item, waiting ``fetch_timeout_s``)
    while any slot is free, so a route whose work arrives is found at once. Probes do not hold slots back from the
    hungry routes: when probes and hungry pulls deliver together the worker holds at most ``capacity`` plus one item
    per other route (a worker with one route never exceeds ``capacity``).
    """

    def __init__(self, capacity: int, batch: int, in_use: Callable[[], int]) -> None:
        self.capacity = capacity
        self.batch = batch
        self.in_use = in_use
        self.reserved = 0
        """Items asked for by hungry routes' pulls in flight."""
        self.probing: set[str] = set()
        """Routes whose probe is in flight."""
        self.hungry: set[str] = set()
        """Routes whose last pull brought work (they may have more)."""
        self._changed = asyncio.Event()

    def free(self) -> int:
        return self.capacity - self.in_use() - self.reserved

    def grant(self, route: str) -> int:
        """Reserve and return how many items ``route`` may pull now: 0 when no slot is free; 1 (a probe) for a route
        that found nothing last time; else its even share of the free slots, at least 1, at most ``batch``."""
        free = self.free()
        if free <= 0:
            return 0
        if route not in self.hungry:
            self.probing.add(route)
            return 1
        share = math.ceil(max(0, self.capacity - self.in_use()) / len(self.hungry))
        n = max(1, min(share, free, self.batch))
        self.reserved += n
        return n

    def settle(self, route: str, granted: int, got: int) -> None:
        """The pull of ``granted`` items came back with ``got`` (the caller counted them into ``in_use`` already)."""
        if route in self.probing:
            self.probing.discard(route)
        else:
            self.reserved -= granted
        if got > 0:
            self.hungry.add(route)
        else:
            self.hungry.discard(route)
        self.notify()

    def notify(self) -> None:
        """A slot came free (or a pull came back): wake the routes waiting for one."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def changed(self) -> asyncio.Event:
        """Set at the next ``notify``. Take it right after a ``grant`` of 0, with no await in between, then wait on
        it: a ``notify`` that happens before the wait starts is not lost."""
        return self._changed
