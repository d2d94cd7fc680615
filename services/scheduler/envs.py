"""The scheduler's view of the KV buckets: envs registered by env workers (``rl_envs``) and the routes of their work
items, which env workers are live (``rl_env_workers``), and cancelled batches.

Reads never create a consumer: the keys come from the bucket's stream info (its subjects), the values from direct
gets (``KeyValue.keys()`` opens a watcher, an ephemeral consumer per call that outlives the request).

Routing: an env's work items go to ``rl.work.episodes.<token of its route>`` (shared/subjects.py). The route is the
``route`` of the env's advert; a family (``rg:<dataset>``) is advertised as one entry ``rg:*`` listing its
``members`` with the family's route. An env nobody advertised is routed by its own name (its items wait there until
a worker with it starts).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.schemas import EnvPublic
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import ENV_WORKERS_BUCKET, ENVS_BUCKET, env_key, env_name_of_key

log = get_logger(__name__)


KV_PREFIX = f"$KV.{ENVS_BUCKET}."
FAMILY_SUFFIX = ":*"
"""A family's one advert is ``<family>:*`` (env workers' routing.py writes it)."""
ROUTE_CACHE_S = 10.0
"""How long the scheduler keeps an env's route before reading its advert again."""
LIVE_CACHE_S = 2.0
"""How long the scheduler keeps the list of live env workers (batch status reads it; one read per worker)."""


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Keys with a message in the bucket's stream (deleted ones included: their marker is a message)."""
    prefix = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    except Exception as exc:  # nats-py timeouts and connection errors share no base class
        raise BusError(f"cannot list the keys of KV bucket {bucket}: {exc}") from exc
    return sorted(s[len(prefix):] for s in (info.state.subjects or {}) if s.startswith(prefix))


async def env_keys(js: JetStreamContext) -> list[str]:
    """Keys of ``rl_envs`` (see ``bucket_keys``)."""
    return await bucket_keys(js, ENVS_BUCKET)


async def _value(kv: KeyValue, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:  # also a deleted key
        return None
    except Exception as exc:  # see env_keys
        raise BusError(f"cannot read env {env_name_of_key(key)!r} from KV: {exc}") from exc
    return entry.value


async def env_names(js: JetStreamContext, kv: KeyValue) -> list[str]:
    """Names of the registered envs, sorted (``remote:<name>`` included: keys are decoded, see ``env_key``)."""
    return sorted([env_name_of_key(k) for k in await env_keys(js) if await _value(kv, k) is not None])


async def _advert(kv: KeyValue, name: str) -> dict[str, Any] | None:
    """The advert of ``name`` (an env or a family's ``<family>:*``) as a JSON object; ``{}`` for a value that is not
    one (an env registered by hand), None when there is none."""
    value = await _value(kv, env_key(name))
    if value is None:
        return None
    try:
        data = orjson.loads(value or b"{}")
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def family_advert_name(env: str) -> str | None:
    """The advert that would list ``env`` as a family member (``rg:*`` for ``rg:leg_counting``), None for a name
    without a family prefix."""
    family, sep, member = env.partition(":")
    return f"{family}{FAMILY_SUFFIX}" if sep and family and member and env != f"{family}{FAMILY_SUFFIX}" else None


async def resolve(kv: KeyValue, env: str) -> tuple[bool, str]:
    """Whether ``env`` is registered (its own advert, or a member listed by its family's advert) and its route (the
    advert's ``route``; the env's name when the advert has none or there is none)."""
    own = await _advert(kv, env)
    if own is not None:
        route = own.get("route")
        return True, route if isinstance(route, str) and route else env
    family = family_advert_name(env)
    if family is not None:
        adv = await _advert(kv, family)
        if adv is not None:  # a family's member is routed by the family even when this advert does not list it
            members = adv.get("members")  # (the advert of the worker that wrote last; another may have more)
            route = adv.get("route")
            return (isinstance(members, list) and env in members,
                    route if isinstance(route, str) and route else env.partition(":")[0])
    return False, env


async def is_registered(kv: KeyValue, name: str) -> bool:
    return (await resolve(kv, name))[0]


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
        value = await _value(kv, key)
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
        try:
            return await self.js.key_value(bucket)
        except Exception as exc:  # see env_keys
            raise BusError(f"cannot open KV bucket {bucket}: {exc}") from exc

    async def route(self, env: str) -> str:
        """The route of ``env``'s work items."""
        now = time.monotonic()
        hit = self._cache.get(env)
        if hit is not None and now - hit[0] < ROUTE_CACHE_S:
            return hit[1]
        if self._envs is None:
            self._envs = await self._kv(ENVS_BUCKET)
        _, route = await resolve(self._envs, env)
        self._cache[env] = (now, route)
        return route

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


async def list_envs(js: JetStreamContext, kv: KeyValue) -> list[EnvPublic]:
    """Every registered env with its description; a value that is not the agreed JSON keeps just its name."""
    out: list[EnvPublic] = []
    for key in await env_keys(js):
        name = env_name_of_key(key)
        value = await _value(kv, key)
        if value is None:
            continue  # deleted (or removed meanwhile)
        try:
            data = orjson.loads(value or b"{}")
            if not isinstance(data, dict):
                raise ValueError("not an object")
            data["name"] = name
            if not data.get("route"):  # an advert without one (a previous release's, an agent's): routed by name
                data["route"] = name
            out.append(EnvPublic.model_validate(data))
        except ValueError as exc:  # orjson.JSONDecodeError and pydantic.ValidationError are ValueErrors
            log.warning("envs.bad_entry", env=name, error=str(exc))
            out.append(EnvPublic(name=name, route=name))
    return sorted(out, key=lambda env: env.name)


async def mark_cancelled(kv: KeyValue, batch_id: str, when: datetime) -> None:
    """Tell env workers the batch is cancelled (key = batch id, value = ISO time)."""
    try:
        await kv.put(batch_id, when.isoformat().encode())
    except Exception as exc:  # see env_names
        raise BusError(f"cannot mark batch {batch_id} cancelled in KV: {exc}") from exc
