"""Route /v1/envs: the environments env workers registered in the KV bucket ``rl_envs``."""

from __future__ import annotations

from fastapi import APIRouter

from rollout_ledger.services.scheduler import env_registry
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep
from rollout_ledger.services.scheduler.api.error_responses import READ_RESPONSES
from rollout_ledger.services.scheduler.schemas import EnvListPublic

router = APIRouter(prefix="/v1/envs", tags=["envs"])


@router.get("", dependencies=[ReadDep], responses=READ_RESPONSES)
async def list_envs(res: ResourcesDep) -> EnvListPublic:
    """Every env some env worker registered (name, description, multi_turn, example_task, registered_by)."""
    return EnvListPublic(envs=await env_registry.list_envs(res.js, res.envs_kv))
