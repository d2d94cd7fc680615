"""Submitting a batch: the checks that refuse a request, the idempotent replay of a repeated one, and the one
transaction that stores the batch and its episodes before their work items are published (or admission holds them).

HTTP-free: a refused request raises ``SubmitRefused`` with its ``Refusal``, which the route (api/batches.py) turns into
413, 400 or 409 with the message as it is; ``SubmitResult.created`` says 201 or 200.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from structlog.contextvars import bound_contextvars

from rollout_ledger.services.scheduler import batch_store, env_registry, route_book
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics
from rollout_ledger.services.scheduler.planning import (
    BatchRunSpec,
    PlannedEpisode,
    json_size,
    new_batch_id,
    plan_episodes,
    request_hash,
)
from rollout_ledger.services.scheduler.schemas import BatchCreate, BatchCreatedPublic
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.state import Resources
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.lifecycle import EpisodeStatus

log = get_logger(__name__)


class Refusal(enum.Enum):
    """Why a submit is refused (the HTTP status the route answers)."""

    TOO_LARGE = 413
    """The batch, a task or the metadata is over its deployment limit (``ROLLOUT_MAX_*``)."""
    INVALID = 400
    """The request contradicts itself or the deployment (an unknown env, a run-ahead without a staleness bound)."""
    CONFLICT = 409
    """The batch id is taken by another request (or was removed while this one was stored)."""


class SubmitRefused(Exception):
    """The batch is not submitted; the message names the field and says what to change."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.message = message


def status_url(batch_id: str) -> str:
    return f"/v1/batches/{batch_id}"


def check_limits(body: BatchCreate, settings: SchedulerSettings) -> None:
    """``TOO_LARGE`` for a batch over ``max_batch_episodes``, metadata over ``max_metadata_bytes`` or a task over
    ``max_task_bytes`` (the first found, in that order)."""
    num_episodes = len(body.tasks) * body.group_size
    if num_episodes > settings.max_batch_episodes:
        raise SubmitRefused(
            Refusal.TOO_LARGE,
            f"batch has {len(body.tasks)} tasks x group_size {body.group_size} = {num_episodes} episodes; "
            f"the limit is {settings.max_batch_episodes} (ROLLOUT_MAX_BATCH_EPISODES): split it",
        )
    metadata_size = json_size(body.metadata)
    if metadata_size > settings.max_metadata_bytes:
        raise SubmitRefused(
            Refusal.TOO_LARGE,
            f"metadata is {metadata_size} bytes as JSON; the limit is {settings.max_metadata_bytes} "
            "(ROLLOUT_MAX_METADATA_BYTES)",
        )
    for i, task in enumerate(body.tasks):
        size = json_size(task)
        if size > settings.max_task_bytes:
            raise SubmitRefused(
                Refusal.TOO_LARGE,
                f"tasks[{i}] is {size} bytes as JSON; the limit is {settings.max_task_bytes} (ROLLOUT_MAX_TASK_BYTES)",
            )


def check_consistent(body: BatchCreate, max_staleness: int | None) -> None:
    """``INVALID`` for ``episodes_per_version`` without a staleness bound or not a multiple of ``group_size``, and
    for ``sampling.min_tokens`` over ``sampling.max_tokens``."""
    if body.episodes_per_version is not None:
        if max_staleness is None:
            raise SubmitRefused(
                Refusal.INVALID,
                "episodes_per_version: it bounds the run-ahead of a staleness bound: set max_staleness too "
                "(this deployment has no ROLLOUT_MAX_STALENESS)",
            )
        if body.episodes_per_version % body.group_size:
            raise SubmitRefused(
                Refusal.INVALID,
                f"episodes_per_version: {body.episodes_per_version} is not a multiple of group_size "
                f"{body.group_size}: admission starts whole groups",
            )
    if body.sampling.min_tokens > body.sampling.max_tokens:
        raise SubmitRefused(
            Refusal.INVALID,
            f"sampling.min_tokens: {body.sampling.min_tokens} is over sampling.max_tokens "
            f"{body.sampling.max_tokens}: a turn ends at max_tokens",
        )


async def check_env(body: BatchCreate, settings: SchedulerSettings, res: Resources) -> str | None:
    """``INVALID`` for an env no env worker registered (with ``require_registered_env``); a family member only a live
    worker lists is known. Returns the env's route as the check read it (None when nothing was checked)."""
    if not settings.require_registered_env:
        return None
    registered, route = await res.publisher.routes.resolve(body.env)
    if not registered and not route_book.served(await res.publisher.routes.live(), body.env):
        known = await env_registry.env_names(res.js, res.envs_kv)
        listed = ", ".join(known) if known else "none registered yet (start an env worker)"
        raise SubmitRefused(Refusal.INVALID, f"unknown env {body.env!r}; known envs: {listed}")
    return route


def batch_row(body: BatchCreate, batch_id: str, rhash: str, max_staleness: int | None,
              base_version: int | None) -> dict[str, Any]:
    """The ``batches`` row of a new batch."""
    return {
        "id": batch_id,
        "env": body.env,
        "group_size": body.group_size,
        "max_turns": body.max_turns,
        "sampling": body.sampling.model_dump(mode="json"),
        "context": body.context.model_dump(mode="json") if body.context is not None else None,
        "num_tasks": len(body.tasks),
        "num_episodes": len(body.tasks) * body.group_size,
        "request_hash": rhash,
        "metadata": body.metadata,
        "max_staleness": max_staleness,
        "episodes_per_version": body.episodes_per_version,
        "admission_base_version": base_version,
    }


async def submit_batch(body: BatchCreate, settings: SchedulerSettings, metrics: SchedulerMetrics,
                       res: Resources) -> BatchCreatedPublic:
    """Store the batch and one episode per (task, sample) in one transaction, then publish their work items (or let
    admission publish what the staleness bound allows). A repeated request with the same ``batch_id`` is replayed
    (``created`` false); ``SubmitRefused`` when the request cannot be submitted."""
    check_limits(body, settings)
    max_staleness = body.max_staleness if body.max_staleness is not None else settings.max_staleness
    check_consistent(body, max_staleness)
    rhash = request_hash(body)
    batch_id = body.batch_id or new_batch_id()
    with bound_contextvars(batch_id=batch_id):
        if body.batch_id is not None:
            existing = await _read_batch(res, batch_id)
            if existing is not None:
                return await replay(res, existing, rhash)
        route = await check_env(body, settings, res)

        planned = plan_episodes(batch_id, body.env, body.tasks, body.group_size)
        bounded = max_staleness is not None
        base_version = (await res.admission.versions()).current if bounded else None
        row = batch_row(body, batch_id, rhash, max_staleness, base_version)
        t0 = time.perf_counter()
        with batch_store.store_errors("insert batch"):
            async with res.engine.begin() as conn:
                created_at = await batch_store.insert_batch(
                    conn, row, planned, EpisodeStatus.WAITING if bounded else EpisodeStatus.REQUESTED)
        t1 = time.perf_counter()
        if created_at is None:  # a concurrent request with the same batch id won the insert
            existing = await _read_batch(res, batch_id)
            if existing is None:
                raise SubmitRefused(Refusal.CONFLICT, f"batch {batch_id!r} was created and removed meanwhile")
            return await replay(res, existing, rhash)

        metrics.batches_submitted.inc()
        metrics.episodes_submitted.inc(len(planned))
        published, num_waiting = await _start(res, body, planned, bounded, route)
        log.info("batch.submitted", env=body.env, num_tasks=len(body.tasks), num_episodes=len(planned),
                 published=published, max_staleness=max_staleness, insert_ms=round((t1 - t0) * 1000, 1),
                 publish_ms=round((time.perf_counter() - t1) * 1000, 1))
        return BatchCreatedPublic(
            batch_id=batch_id,
            created=True,
            env=body.env,
            num_tasks=len(body.tasks),
            group_size=body.group_size,
            num_episodes=len(planned),
            request_hash=rhash,
            episode_ids=[ep.id for ep in planned],
            num_published=published,
            num_waiting=num_waiting,
            status_url=status_url(batch_id),
            created_at=created_at,
        )


async def _read_batch(res: Resources, batch_id: str) -> dict[str, Any] | None:
    with batch_store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            return await batch_store.get_batch(conn, batch_id)


async def _start(res: Resources, body: BatchCreate, planned: list[PlannedEpisode], bounded: bool,
                 route: str | None) -> tuple[int, int]:
    """Publish a stored batch's work items (to ``route`` when the env check read it), or hand a bounded batch to
    admission; (published, waiting)."""
    if not bounded:
        return await res.publisher.publish(planned, BatchRunSpec.of(body), source="submit", route=route), 0
    # admission publishes what the bound lets start now, and the rest as the versions advance
    batch_id = planned[0].batch_id
    await res.admission.admit([batch_id])  # (or a pass running meanwhile did: read what they left)
    with batch_store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            published = (await batch_store.batch_stats(conn, batch_id)).num_published
            num_waiting = (await batch_store.status_counts(conn, batch_id))[EpisodeStatus.WAITING]
    return published, num_waiting


async def replay(res: Resources, existing: dict[str, Any], rhash: str) -> BatchCreatedPublic:
    """A repeated submit: ``CONFLICT`` when the request differs, else the stored batch (publishing what is still
    unpublished)."""
    batch_id = str(existing["id"])
    if existing["request_hash"] != rhash:
        raise SubmitRefused(
            Refusal.CONFLICT,
            f"batch {batch_id!r} already exists with a different request (request_hash {existing['request_hash']}, "
            f"this request {rhash}); repeat the original request or use a new batch_id",
        )
    republished = await res.publisher.publish_pending(batch_id)
    with batch_store.store_errors("read batch"):
        async with res.engine.connect() as conn:
            ids = await batch_store.episode_ids_of(conn, batch_id)
            stats = await batch_store.batch_stats(conn, batch_id)
            counts = await batch_store.status_counts(conn, batch_id)
    log.info("batch.replayed", republished=republished)
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
        status_url=status_url(batch_id),
        created_at=existing["created_at"],
    )
