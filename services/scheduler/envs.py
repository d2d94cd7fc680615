"""The scheduler's view of the KV buckets: envs registered by env workers (``rl_envs``) and cancelled batches."""

from __future__ import annotations

from datetime import datetime

import orjson
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from rollout_ledger.services.scheduler.schemas import EnvPublic
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import ENVS_BUCKET, env_key, env_name_of_key

log = get_logger(__name__)


async def env_names(kv: KeyValue) -> list[str]:
    """Names of the registered envs, sorted (``remote:<name>`` included: keys are decoded, see ``env_key``)."""
    try:
        return sorted(env_name_of_key(k) for k in await kv.keys())
    except NoKeysError:
        return []
    except Exception as exc:  # nats-py timeouts and connection errors share no base class
        raise BusError(f"cannot list envs in KV bucket {ENVS_BUCKET}: {exc}") from exc


async def is_registered(kv: KeyValue, name: str) -> bool:
    try:
        entry = await kv.get(env_key(name))
    except KeyNotFoundError:  # also a deleted key
        return False
    except Exception as exc:  # see env_names
        raise BusError(f"cannot read env {name!r} from KV: {exc}") from exc
    return entry.value is not None


async def list_envs(kv: KeyValue) -> list[EnvPublic]:
    """Every registered env with its description; a value that is not the agreed JSON keeps just its name."""
    out: list[EnvPublic] = []
    for name in await env_names(kv):
        try:
            entry = await kv.get(env_key(name))
        except KeyNotFoundError:
            continue  # removed meanwhile
        except Exception as exc:  # see env_names
            raise BusError(f"cannot read env {name!r} from KV: {exc}") from exc
        try:
            data = orjson.loads(entry.value or b"{}")
            if not isinstance(data, dict):
                raise ValueError("not an object")
            data["name"] = name
            out.append(EnvPublic.model_validate(data))
        except ValueError as exc:  # orjson.JSONDecodeError and pydantic.ValidationError are ValueErrors
            log.warning("envs.bad_entry", env=name, error=str(exc))
            out.append(EnvPublic(name=name))
    return out


async def mark_cancelled(kv: KeyValue, batch_id: str, when: datetime) -> None:
    """Tell env workers the batch is cancelled (key = batch id, value = ISO time)."""
    try:
        await kv.put(batch_id, when.isoformat().encode())
    except Exception as exc:  # see env_names
        raise BusError(f"cannot mark batch {batch_id} cancelled in KV: {exc}") from exc
