"""Routes of /v1/batches: submit a batch (idempotent with a client batch id), read its progress, cancel it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Response, status
from structlog.contextvars import bound_contextvars

from rollout_ledger.services.scheduler import admission, batch_store, env_registry, route_book
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep, StateDep, WriteDep
from rollout_ledger.services.scheduler.api.error_responses import READ_RESPONSES, WRITE_RESPONSES
from rollout_ledger.services.scheduler.schemas import (
    BATCH_ID_PATTERN,
    AdmissionPublic,
    BatchCancelPublic,
    BatchCreate,
    BatchCreatedPublic,
    BatchPublic,
    ErrorPublic,
)
from rollout_ledger.services.scheduler.submit import SubmitRefused, submit_batch
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.lifecycle import EpisodeStatus

log = get_logger(__name__)

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BatchIdPath = Annotated[str, Path(pattern=BATCH_ID_PATTERN, description="The batch id (``[A-Za-z0-9_-]{1,64}``)")]


def _not_found(batch_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"unknown batch {batch_id!r}")


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=[WriteDep],
    responses={
        **WRITE_RESPONSES,
        200: {"model": BatchCreatedPublic, "description": "The batch existed with the same request"},
        400: {"model": ErrorPublic, "description": "Unknown env (the message lists the known ones), or "
                                                   "episodes_per_version that does not fit group_size or has no "
                                                   "staleness bound, or sampling.min_tokens over "
                                                   "sampling.max_tokens (the message names the field)"},
        409: {"model": ErrorPublic, "description": "The batch id exists with a different request"},
        413: {"model": ErrorPublic, "description": "The body is over ROLLOUT_MAX_BODY_BYTES, the batch over "
                                                   "ROLLOUT_MAX_BATCH_EPISODES, a task over ROLLOUT_MAX_TASK_BYTES or "
                                                   "the metadata over ROLLOUT_MAX_METADATA_BYTES"},
    },
)
async def create_batch(body: BatchCreate, state: StateDep, res: ResourcesDep, response: Response) -> BatchCreatedPublic:
    """Store the batch and one episode per (task, sample) in one transaction, then publish their work items."""
    try:
        created = await submit_batch(body, state.settings, state.metrics, res)
    except SubmitRefused as exc:
        raise HTTPException(exc.refusal.value, exc.message) from exc
    response.status_code = status.HTTP_201_CREATED if created.created else status.HTTP_200_OK
    return created


@router.get("/{batch_id}", dependencies=[ReadDep], responses={**READ_RESPONSES, 404: {"model": ErrorPublic}})
async def get_batch(batch_id: BatchIdPath, res: ResourcesDep) -> BatchPublic:
    """Episodes per status, trajectories stored, mean reward of finished episodes, whether all are done, and the
    episodes that wait because no live env worker has the batch's env (``waiting_for_env``)."""
    with batch_store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            batch = await batch_store.get_batch(conn, batch_id)
            if batch is None:
                raise _not_found(batch_id)
            counts = await batch_store.status_counts(conn, batch_id)
            stats = await batch_store.batch_stats(conn, batch_id)
            held = None
            if batch["max_staleness"] is not None:
                held = await admission.standing(conn, batch, await res.admission.versions())
    waiting = counts[EpisodeStatus.REQUESTED]
    served = (not waiting or batch["cancelled_at"] is not None
              or route_book.served(await res.publisher.routes.live(), batch["env"]))
    waiting_for_env = {} if served else {batch["env"]: waiting}
    return BatchPublic(
        batch_id=batch_id,
        env=batch["env"],
        group_size=batch["group_size"],
        sampling=batch["sampling"],
        max_turns=batch["max_turns"],
        context=batch["context"],
        metadata=batch["metadata"],
        num_tasks=batch["num_tasks"],
        num_episodes=batch["num_episodes"],
        counts=counts,
        num_published=stats.num_published,
        num_trajectories=stats.num_trajectories,
        mean_reward=stats.mean_reward,
        done=batch_store.is_done(counts),
        max_staleness=batch["max_staleness"],
        episodes_per_version=batch["episodes_per_version"],
        admission=_admission_public(held),
        waiting_for_env=waiting_for_env,
        created_at=batch["created_at"],
        cancelled_at=batch["cancelled_at"],
    )


def _admission_public(held: admission.Standing | None) -> AdmissionPublic | None:
    if held is None:
        return None
    return AdmissionPublic(
        max_staleness=held.bound.max_staleness, episodes_per_version=held.bound.episodes_per_version,
        base_version=held.bound.base_version, current_version=held.versions.current,
        serving_version=held.versions.serving, admitted=held.admitted, waiting=held.waiting,
        limit=held.decision.limit, held=held.decision.held)


@router.post(
    "/{batch_id}/cancel",
    dependencies=[WriteDep],
    responses={**WRITE_RESPONSES, 404: {"model": ErrorPublic}},
)
async def cancel_batch(batch_id: BatchIdPath, res: ResourcesDep) -> BatchCancelPublic:
    """Cancel a batch (idempotent): waiting episodes become cancelled; env workers end running ones between turns."""
    with bound_contextvars(batch_id=batch_id):
        with batch_store.store_errors("read batch"):
            async with res.engine.connect() as conn:
                batch = await batch_store.get_batch(conn, batch_id)
        if batch is None:
            raise _not_found(batch_id)
        # Tell the env workers first: a worker that takes a waiting episode after this point sees the cancel.
        await env_registry.mark_cancelled(res.cancel_kv, batch_id, batch["cancelled_at"] or datetime.now(UTC))
        with batch_store.store_errors("cancel batch"):
            async with res.engine.begin() as conn:
                cancelled_at, moved = await batch_store.cancel_batch(conn, batch_id)
            async with res.engine.connect() as conn:
                counts = await batch_store.status_counts(conn, batch_id)
        log.info("batch.cancelled", cancelled_now=moved)
        return BatchCancelPublic(batch_id=batch_id, cancelled_at=cancelled_at, cancelled_now=moved, counts=counts)
