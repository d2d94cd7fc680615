"""The KV buckets the scheduler shares with env workers: the registered envs (``rl_envs``) and their public
descriptions, and the cancel marks of batches (``rl_cancelled``) the workers watch.

Reads never create a consumer: the keys come from the bucket's stream info (its subjects), the values from direct
gets (``KeyValue.keys()`` opens a watcher, an ephemeral consumer per call that outlives the request). How an env's
work items are routed is route_book.py's.
"""

from __future__ import annotations

from datetime import datetime

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.schemas import EnvPublic
from rollout_ledger.shared.kit.bus import NATS_FAILURES, as_bus_error, bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import ENVS_BUCKET, env_name_of_key

log = get_logger(__name__)


KV_PREFIX = f"$KV.{ENVS_BUCKET}."


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Keys with a message in the bucket's stream (deleted ones included: their marker is a message)."""
    prefix = f"$KV.{bucket}."
    with bus_errors(f"list the keys of KV bucket {bucket}"):
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(s[len(prefix):] for s in (info.state.subjects or {}) if s.startswith(prefix))


async def env_keys(js: JetStreamContext) -> list[str]:
    """Keys of ``rl_envs`` (see ``bucket_keys``)."""
    return await bucket_keys(js, ENVS_BUCKET)


async def read_value(kv: KeyValue, key: str) -> bytes | None:
    """The value of ``key`` (an ``env_key``); None when there is none or it was deleted."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:  # also a deleted key
        return None
    except NATS_FAILURES as exc:
        raise as_bus_error(exc, f"read env {env_name_of_key(key)!r} from KV") from exc
    return entry.value


async def env_names(js: JetStreamContext, kv: KeyValue) -> list[str]:
    """Names of the registered envs, sorted (``remote:<name>`` included: keys are decoded, see ``env_key``)."""
    return sorted([env_name_of_key(k) for k in await env_keys(js) if await read_value(kv, k) is not None])


async def list_envs(js: JetStreamContext, kv: KeyValue) -> list[EnvPublic]:
    """Every registered env with its description; a value that is not the agreed JSON keeps just its name."""
    out: list[EnvPublic] = []
    for key in await env_keys(js):
        name = env_name_of_key(key)
        value = await read_value(kv, key)
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
    except NATS_FAILURES as exc:
        raise as_bus_error(exc, f"mark batch {batch_id} cancelled in KV") from exc
