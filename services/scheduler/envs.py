"""The scheduler's view of the KV buckets: envs registered by env workers (``rl_envs``) and cancelled batches.

Reads never create a consumer: the keys come from the bucket's stream info (its subjects), the values from direct
gets (``KeyValue.keys()`` opens a watcher, an ephemeral consumer per call that outlives the request).
"""

from __future__ import annotations

from datetime import datetime

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.schemas import EnvPublic
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import ENVS_BUCKET, env_key, env_name_of_key

log = get_logger(__name__)


KV_PREFIX = f"$KV.{ENVS_BUCKET}."


async def env_keys(js: JetStreamContext) -> list[str]:
    """Keys with a message in the bucket's stream (deleted ones included: their marker is a message)."""
    try:
        info = await js.stream_info(f"KV_{ENVS_BUCKET}", subjects_filter=f"{KV_PREFIX}>")
    except Exception as exc:  # nats-py timeouts and connection errors share no base class
        raise BusError(f"cannot list envs in KV bucket {ENVS_BUCKET}: {exc}") from exc
    return sorted(s[len(KV_PREFIX):] for s in (info.state.subjects or {}) if s.startswith(KV_PREFIX))


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


async def is_registered(kv: KeyValue, name: str) -> bool:
    return await _value(kv, env_key(name)) is not None


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
            out.append(EnvPublic.model_validate(data))
        except ValueError as exc:  # orjson.JSONDecodeError and pydantic.ValidationError are ValueErrors
            log.warning("envs.bad_entry", env=name, error=str(exc))
            out.append(EnvPublic(name=name))
    return sorted(out, key=lambda env: env.name)


async def mark_cancelled(kv: KeyValue, batch_id: str, when: datetime) -> None:
    """Tell env workers the batch is cancelled (key = batch id, value = ISO time)."""
    try:
        await kv.put(batch_id, when.isoformat().encode())
    except Exception as exc:  # see env_names
        raise BusError(f"cannot mark batch {batch_id} cancelled in KV: {exc}") from exc
