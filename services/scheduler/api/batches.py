"""Routes of /v1/batches: submit a batch (idempotent with a client batch id), read its progress, cancel it."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Response, status
from structlog.contextvars import bound_contextvars

from rollout_ledger.services.scheduler import admission, envs, store
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep, StateDep, WriteDep
from rollout_ledger.services.scheduler.api.errors import READ_RESPONSES, WRITE_RESPONSES
from rollout_ledger.services.scheduler.planning import (
    BatchRunSpec,
    json_size,
    new_batch_id,
    plan_episodes,
    request_hash,
)
from rollout_ledger.services.scheduler.schemas import (
    BATCH_ID_PATTERN,
    AdmissionPublic,
    BatchCancelPublic,
    BatchCreate,
    BatchCreatedPublic,
    BatchPublic,
    ErrorPublic,
)
from rollout_ledger.services.scheduler.state import Resources
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.lifecycle import EpisodeStatus

log = get_logger(__name__)

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BatchIdPath = Annotated[str, Path(pattern=BATCH_ID_PATTERN, description="The batch id (``[A-Za-z0-9_-]{1,64}``)")]


def _status_url(batch_id: str) -> str:
    return f"/v1/batches/{batch_id}"


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
    settings = state.settings
    num_episodes = len(body.tasks) * body.group_size
    if num_episodes > settings.max_batch_episodes:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"batch has {len(body.tasks)} tasks x group_size {body.group_size} = {num_episodes} episodes; "
            f"the limit is {settings.max_batch_episodes} (ROLLOUT_MAX_BATCH_EPISODES): split it",
        )
    metadata_size = json_size(body.metadata)
    if metadata_size > settings.max_metadata_bytes:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"metadata is {metadata_size} bytes as JSON; the limit is {settings.max_metadata_bytes} "
            "(ROLLOUT_MAX_METADATA_BYTES)",
        )
    for i, task in enumerate(body.tasks):
        size = json_size(task)
        if size > settings.max_task_bytes:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                f"tasks[{i}] is {size} bytes as JSON; the limit is {settings.max_task_bytes} (ROLLOUT_MAX_TASK_BYTES)",
            )
    max_staleness = body.max_staleness if body.max_staleness is not None else settings.max_staleness
    if body.episodes_per_version is not None:
        if max_staleness is None:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST,
                "episodes_per_version: it bounds the run-ahead of a staleness bound: set max_staleness too "
                "(this deployment has no ROLLOUT_MAX_STALENESS)",
            )
        if body.episodes_per_version % body.group_size:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST,
                f"episodes_per_version: {body.episodes_per_version} is not a multiple of group_size "
                f"{body.group_size}: admission starts whole groups",
            )
    if body.sampling.min_tokens > body.sampling.max_tokens:
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST,
            f"sampling.min_tokens: {body.sampling.min_tokens} is over sampling.max_tokens "
            f"{body.sampling.max_tokens}: a turn ends at max_tokens",
        )
    rhash = request_hash(body)
    batch_id = body.batch_id or new_batch_id()
    with bound_contextvars(batch_id=batch_id):
        if body.batch_id is not None:
            with store.store_errors("read batch"):
                async with res.engine.connect() as conn:
                    existing = await store.get_batch(conn, batch_id)
            if existing is not None:
                return await _replay(res, existing, rhash, response)
        if (settings.require_registered_env and not await envs.is_registered(res.envs_kv, body.env)
                and not envs.served(await res.publisher.routes.live(), body.env)):  # a member only a live worker lists
            known = await envs.env_names(res.js, res.envs_kv)
            listed = ", ".join(known) if known else "none registered yet (start an env worker)"
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"unknown env {body.env!r}; known envs: {listed}")

        planned = plan_episodes(batch_id, body.env, body.tasks, body.group_size)
        bounded = max_staleness is not None
        base_version = (await res.admission.versions()).current if bounded else None
        batch_row: dict[str, Any] = {
            "id": batch_id,
            "env": body.env,
            "group_size": body.group_size,
            "max_turns": body.max_turns,
            "sampling": body.sampling.model_dump(mode="json"),
            "context": body.context.model_dump(mode="json") if body.context is not None else None,
            "num_tasks": len(body.tasks),
            "num_episodes": num_episodes,
            "request_hash": rhash,
            "metadata": body.metadata,
            "max_staleness": max_staleness,
            "episodes_per_version": body.episodes_per_version,
            "admission_base_version": base_version,
        }
        t0 = time.perf_counter()
        with store.store_errors("insert batch"):
            async with res.engine.begin() as conn:
                created_at = await store.insert_batch(
                    conn, batch_row, planned, EpisodeStatus.WAITING if bounded else EpisodeStatus.REQUESTED)
        t1 = time.perf_counter()
        if created_at is None:  # a concurrent request with the same batch id won the insert
            with store.store_errors("read batch"):
                async with res.engine.connect() as conn:
                    existing = await store.get_batch(conn, batch_id)
            if existing is None:
                raise HTTPException(status.HTTP_409_CONFLICT, f"batch {batch_id!r} was created and removed meanwhile")
            return await _replay(res, existing, rhash, response)

        state.metrics.batches_submitted.inc()
        state.metrics.episodes_submitted.inc(num_episodes)
        spec = BatchRunSpec(body.env, body.group_size, body.max_turns, body.sampling.to_event(),
                            body.context.to_event() if body.context is not None else None)
        num_waiting = 0
        if bounded:  # admission publishes what the bound lets start now, and the rest as the versions advance
            await res.admission.admit([batch_id])  # (or a pass running meanwhile did: read what they left)
            with store.store_errors("read batch"):
                async with res.engine.connect() as conn:
                    published = (await store.batch_stats(conn, batch_id)).num_published
                    num_waiting = (await store.status_counts(conn, batch_id))[EpisodeStatus.WAITING]
        else:
            published = await res.publisher.publish(planned, spec, source="submit")
        log.info("batch.submitted", env=body.env, num_tasks=len(body.tasks), num_episodes=num_episodes,
                 published=published, max_staleness=max_staleness, insert_ms=round((t1 - t0) * 1000, 1),
                 publish_ms=round((time.perf_counter() - t1) * 1000, 1))
        response.status_code = status.HTTP_201_CREATED
        return BatchCreatedPublic(
            batch_id=batch_id,
            created=True,
            env=body.env,
            num_tasks=len(body.tasks),
            group_size=body.group_size,
            num_episodes=num_episodes,
            request_hash=rhash,
            episode_ids=[ep.id for ep in planned],
            num_published=published,
            num_waiting=num_waiting,
            status_url=_status_url(batch_id),
            created_at=created_at,
        )


async def _replay(res: Resources, existing: dict[str, Any], rhash: str, response: Response) -> BatchCreatedPublic:
    """A repeated POST: 409 when the request differs, else the stored batch (publishing what is still unpublished)."""
    batch_id = str(existing["id"])
    if existing["request_hash"] != rhash:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"batch {batch_id!r} already exists with a different request (request_hash {existing['request_hash']}, "
            f"this request {rhash}); repeat the original request or use a new batch_id",
        )
    republished = await res.publisher.publish_pending(batch_id)
    with store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            ids = await store.episode_ids_of(conn, batch_id)
            stats = await store.batch_stats(conn, batch_id)
            counts = await store.status_counts(conn, batch_id)
    log.info("batch.replayed", republished=republished)
    response.status_code = status.HTTP_200_OK
    return BatchCreatedPublic(
        batch_id=batch_id,
        created=False,
        env=existing["env"],
        num_tasks=existing["num_tasks"],
        group_size=existing["group_size"],
        num_episodes=existing["num_episodes"],
        request_hash=rhash,
        episode_ids=ids,
        num_published=stats.num_published,
        num_waiting=counts[EpisodeStatus.WAITING],
        status_url=_status_url(batch_id),
        created_at=existing["created_at"],
    )


@router.get("/{batch_id}", dependencies=[ReadDep], responses={**READ_RESPONSES, 404: {"model": ErrorPublic}})
async def get_batch(batch_id: BatchIdPath, res: ResourcesDep) -> BatchPublic:
    """Episodes per status, trajectories stored, mean reward of finished episodes, whether all are done, and the
    episodes that wait because no live env worker has the batch's env (``waiting_for_env``)."""
    with store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            batch = await store.get_batch(conn, batch_id)
            if batch is None:
                raise _not_found(batch_id)
            counts = await store.status_counts(conn, batch_id)
            stats = await store.batch_stats(conn, batch_id)
            held = None
            if batch["max_staleness"] is not None:
                held = await admission.standing(conn, batch, await res.admission.versions())
    waiting = counts[EpisodeStatus.REQUESTED]
    if waiting and batch["cancelled_at"] is None and not envs.served(await res.publisher.routes.live(), batch["env"]):
        waiting_for_env = {batch["env"]: waiting}
    else:
        waiting_for_env = {}
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
        done=store.is_done(counts),
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
        with store.store_errors("read batch"):
            async with res.engine.connect() as conn:
                batch = await store.get_batch(conn, batch_id)
        if batch is None:
            raise _not_found(batch_id)
        # Tell the env workers first: a worker that takes a waiting episode after this point sees the cancel.
        await envs.mark_cancelled(res.cancel_kv, batch_id, batch["cancelled_at"] or datetime.now(UTC))
        with store.store_errors("cancel batch"):
            async with res.engine.begin() as conn:
                cancelled_at, moved = await store.cancel_batch(conn, batch_id)
            async with res.engine.connect() as conn:
                counts = await store.status_counts(conn, batch_id)
        log.info("batch.cancelled", cancelled_now=moved)
        return BatchCancelPublic(batch_id=batch_id, cancelled_at=cancelled_at, cancelled_now=moved, counts=counts)
