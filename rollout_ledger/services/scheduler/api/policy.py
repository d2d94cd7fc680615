"""Routes of /v1/policy: a trainer announces a policy version; anyone reads what the inference workers serve."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status

from rollout_ledger.services.scheduler import policy_registry
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep, WriteDep
from rollout_ledger.services.scheduler.api.error_responses import READ_RESPONSES, WRITE_RESPONSES
from rollout_ledger.services.scheduler.batch_store import store_errors
from rollout_ledger.services.scheduler.schemas import (
    ErrorPublic,
    PolicyPublic,
    PolicyVersionCreate,
    PolicyVersionPublic,
    WorkerPolicyPublic,
)
from rollout_ledger.shared.kit.logging import get_logger

router = APIRouter(prefix="/v1/policy", tags=["policy"])
log = get_logger(__name__)


@router.post(
    "/versions",
    status_code=status.HTTP_201_CREATED,
    response_model=PolicyVersionPublic,
    dependencies=[WriteDep],
    responses={**WRITE_RESPONSES,
               200: {"model": PolicyVersionPublic,
                     "description": "the same version was announced by the same request before"},
               409: {"model": ErrorPublic,
                     "description": "the version exists with other values, or is not above the newest"}},
)
async def announce_version(body: PolicyVersionCreate, res: ResourcesDep, response: Response) -> PolicyVersionPublic:
    """Record the version and announce it on the bus: every inference worker loads it and serves it (its swap
    mode says how the generations in flight are treated)."""
    try:
        recorded = await policy_registry.record_version(res.engine, body)
    except policy_registry.VersionConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    announced = False
    if recorded.newest:
        announced = await policy_registry.announce(res.policy_kv, policy_registry.announcement_of(recorded.row))
        res.admission.nudge()  # a new version may let waiting episodes start
    if not recorded.created:
        response.status_code = status.HTTP_200_OK
    log.info("policy.version_announced", version=body.version, created=recorded.created, announced=announced,
             mode=str(body.mode))
    return PolicyVersionPublic(**{k: recorded.row[k] for k in ("version", "checkpoint", "mode", "notes",
                                                                "created_at")},
                               created=recorded.created, announced=announced)


@router.get("", response_model=PolicyPublic, dependencies=[ReadDep], responses=READ_RESPONSES)
async def get_policy(res: ResourcesDep) -> PolicyPublic:
    """The current version, each inference worker's latest report, and running episodes per version."""
    with store_errors("reading the policy"):
        async with res.engine.connect() as conn:
            current = await policy_registry.current_version(conn)
            in_flight = await policy_registry.in_flight_by_version(conn)
    reports = await policy_registry.worker_reports(res.policy_workers_kv, res.js)
    return PolicyPublic(
        current=PolicyVersionPublic(**{k: current[k] for k in ("version", "checkpoint", "mode", "notes",
                                                               "created_at")}) if current else None,
        workers=[WorkerPolicyPublic(worker_id=r.worker_id, serving=r.serving, version=r.version, state=r.state,
                                    error=r.error, engine=r.engine, reported_at=r.time) for r in reports],
        in_flight=in_flight,
    )
