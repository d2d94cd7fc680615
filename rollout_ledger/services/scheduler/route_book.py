"""Where the scheduler sends an env's work items, and which env workers are live to take them.

An env's work items go to ``rl.work.episodes.<token of its route>`` (shared/subjects.py). The route is the ``route``
of the env's advert in ``rl_envs`` (its format: shared/route_advert.py); a family (``rg:<dataset>``) is advertised as
one entry ``rg:*`` listing its ``members`` with the family's route. An env nobody advertised is routed by its own name
(its items wait there until a worker with it starts). The live env workers are the unexpired reports in
``rl_env_workers``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import orjson
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.env_registry import bucket_keys, read_value
from rollout_ledger.shared.kit.bus import bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.route_advert import RouteAdvert
from rollout_ledger.shared.subjects import ENV_WORKERS_BUCKET, ENVS_BUCKET, env_key

log = get_logger(__name__)


ROUTE_CACHE_S = 10.0
"""How long the scheduler keeps an env's route before reading its advert again."""
LIVE_CACHE_S = 2.0
"""How long the scheduler keeps the list of live env workers (batch status reads it; one read per worker)."""


async def read_advert(kv: KeyValue, name: str) -> RouteAdvert | None:
    """The routing part of the advert stored under ``name`` (an env or a family's ``<family>:*``); None when there
    is none."""
    value = await read_value(kv, env_key(name))
    return None if value is None else RouteAdvert.parse(name, value)


async def resolve(kv: KeyValue, env: str) -> tuple[bool, str]:
    """Whether ``env`` is registered (its own advert, or a member listed by its family's advert) and its route (the
    advert's ``route``; the env's name when the advert has none or there is none)."""
    own = await read_advert(kv, env)
    if own is not None:
        return True, own.route or env
    family = RouteAdvert.family_entry(env)
    if family is not None:
        advert = await read_advert(kv, family)
        if advert is not None:  # a family's member is routed by the family even when this advert does not list it
            # (the advert of the worker that wrote last; another may have more)
            return env in advert.members, advert.route or env.partition(":")[0]
    return False, env


@dataclass(frozen=True)
class LiveWorker:
    """An env worker's live entry in ``rl_env_workers``."""

    worker: str
    routes: list[str]
    envs: list[str]


async def live_workers(js: JetStreamContext, kv: KeyValue) -> list[LiveWorker]:
    """The env workers whose report has not expired (a value that is not the agreed JSON is skipped)."""
    out: list[LiveWorker] = []
    for key in await bucket_keys(js, ENV_WORKERS_BUCKET):
        value = await read_value(kv, key)
        if value is None:
            continue
        try:
            data = orjson.loads(value)
            out.append(LiveWorker(str(data["worker"]), [str(r) for r in data["routes"]],
                                  [str(e) for e in data["envs"]]))
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            log.warning("envs.bad_worker_report", key=key, error=str(exc))
    return out


def served(workers: Iterable[LiveWorker], env: str) -> bool:
    """Whether some live worker runs ``env``."""
    return any(env in w.envs for w in workers)


class RouteBook:
    """Routes of envs for the publishers (cached ``ROUTE_CACHE_S``) and the live env workers for batch status."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._envs: KeyValue | None = None
        self._workers: KeyValue | None = None
        self._cache: dict[str, tuple[float, str]] = {}
        self._live: tuple[float, list[LiveWorker]] | None = None

    async def _kv(self, bucket: str) -> KeyValue:
        with bus_errors(f"open KV bucket {bucket}"):
            return await self.js.key_value(bucket)

    async def route(self, env: str) -> str:
        """The route of ``env``'s work items (kept ``ROUTE_CACHE_S``)."""
        hit = self._cache.get(env)
        if hit is not None and time.monotonic() - hit[0] < ROUTE_CACHE_S:
            return hit[1]
        return (await self.resolve(env))[1]

    async def resolve(self, env: str) -> tuple[bool, str]:
        """Whether ``env`` is registered and its route, read now (``resolve``; a registration is never cached, so an
        env registered a moment ago is known); the route is kept for ``route``."""
        if self._envs is None:
            self._envs = await self._kv(ENVS_BUCKET)
        registered, route = await resolve(self._envs, env)
        self._cache[env] = (time.monotonic(), route)
        return registered, route

    async def routes(self, envs: Iterable[str]) -> dict[str, str]:
        return {env: await self.route(env) for env in set(envs)}

    async def live(self) -> list[LiveWorker]:
        """The live env workers, read at most every ``LIVE_CACHE_S``."""
        now = time.monotonic()
        if self._live is not None and now - self._live[0] < LIVE_CACHE_S:
            return self._live[1]
        if self._workers is None:
            self._workers = await self._kv(ENV_WORKERS_BUCKET)
        workers = await live_workers(self.js, self._workers)
        self._live = (now, workers)
        return workers
