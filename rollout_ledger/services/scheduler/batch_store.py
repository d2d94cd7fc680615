"""The scheduler's reads and writes in Postgres (batches, episodes, and the read views of turns, steps, trajectories).

Every status write goes through ``lifecycle.allowed_sources``; database failures leave as ``StoreError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from rollout_ledger.services.scheduler.planning import BatchRunSpec, PlannedEpisode
from rollout_ledger.shared.db import batches, episodes, row_dict, steps, trajectories, turns
from rollout_ledger.shared.db import store_errors as store_errors  # the scheduler's modules use it from here
from rollout_ledger.shared.events import ContextPolicy, SamplingParams
from rollout_ledger.shared.lifecycle import FINISHED, TERMINAL, EpisodeStatus, allowed_sources


async def insert_batch(
    conn: AsyncConnection, batch_row: dict[str, Any], planned: Sequence[PlannedEpisode],
    status: EpisodeStatus = EpisodeStatus.REQUESTED,
) -> datetime | None:
    """Insert the batch and its episodes (``requested``, or ``waiting`` for admission) and return its
    ``created_at``; None (nothing written) when it exists."""
    created_at = (
        await conn.execute(
            pg_insert(batches).values(**batch_row).on_conflict_do_nothing().returning(batches.c.created_at)
        )
    ).scalar()
    if created_at is None:
        return None
    await conn.execute(episodes.insert(), [{**ep.row(), "status": str(status)} for ep in planned])
    return created_at


async def get_batch(conn: AsyncConnection, batch_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(batches).where(batches.c.id == batch_id))).first()
    return row_dict(row) if row is not None else None


async def episode_ids_of(conn: AsyncConnection, batch_id: str) -> list[str]:
    """The batch's episode ids, task-major."""
    rows = await conn.execute(
        select(episodes.c.id).where(episodes.c.batch_id == batch_id).order_by(episodes.c.task_index,
                                                                               episodes.c.group_index)
    )
    return [r[0] for r in rows]


async def status_counts(conn: AsyncConnection, batch_id: str) -> dict[str, int]:
    """Episodes per status, with every status present."""
    counts = {str(s): 0 for s in EpisodeStatus}
    rows = await conn.execute(
        select(episodes.c.status, func.count()).where(episodes.c.batch_id == batch_id).group_by(episodes.c.status)
    )
    for status, n in rows:
        counts[str(status)] = int(n)
    return counts


@dataclass(frozen=True)
class BatchStats:
    """Aggregates of a batch beyond its status counts."""

    num_published: int
    num_trajectories: int
    mean_reward: float | None


async def batch_stats(conn: AsyncConnection, batch_id: str) -> BatchStats:
    finished = sorted(str(s) for s in FINISHED)
    published, mean_reward = (
        await conn.execute(
            select(
                func.count(episodes.c.published_at),
                func.avg(episodes.c.reward).filter(episodes.c.status.in_(finished)),
            ).where(episodes.c.batch_id == batch_id)
        )
    ).one()
    num_traj = (
        await conn.execute(select(func.count()).select_from(trajectories).where(trajectories.c.batch_id == batch_id))
    ).scalar_one()
    return BatchStats(int(published), int(num_traj), float(mean_reward) if mean_reward is not None else None)


def is_done(counts: dict[str, int]) -> bool:
    """Every episode is in a terminal status."""
    return all(n == 0 for status, n in counts.items() if EpisodeStatus(status) not in TERMINAL)


async def cancel_batch(conn: AsyncConnection, batch_id: str) -> tuple[datetime, int]:
    """Stamp ``cancelled_at`` (first time only) and move the batch's episodes that did not start to cancelled.

    Only ``waiting`` and ``requested`` episodes move here; running ones are ended by their env worker between turns.
    """
    cancelled_at = (
        await conn.execute(
            update(batches)
            .where(batches.c.id == batch_id)
            .values(cancelled_at=func.coalesce(batches.c.cancelled_at, func.now()))
            .returning(batches.c.cancelled_at)
        )
    ).scalar_one()
    not_started = (EpisodeStatus.WAITING, EpisodeStatus.REQUESTED)
    sources = [s for s in allowed_sources(EpisodeStatus.CANCELLED) if s in not_started]
    moved = await conn.execute(
        update(episodes)
        .where(episodes.c.batch_id == batch_id, episodes.c.status == func.any(sources))
        .values(status=str(EpisodeStatus.CANCELLED), finished_at=func.now(), updated_at=func.now())
    )
    return cancelled_at, int(moved.rowcount or 0)


async def unpublished(
    conn: AsyncConnection,
    *,
    batch_id: str | None = None,
    min_age_s: float = 0.0,
    limit: int = 1000,
    lock: bool = False,
) -> list[tuple[PlannedEpisode, BatchRunSpec]]:
    """Episodes still ``requested`` whose work item was never acked by the work queue (oldest first).

    With ``lock`` the rows are locked ``FOR UPDATE SKIP LOCKED`` so two schedulers do not republish the same
    episodes at once.
    """
    query = (
        select(
            episodes.c.id, episodes.c.batch_id, episodes.c.group_id, episodes.c.task_index, episodes.c.group_index,
            episodes.c.env, episodes.c.task, batches.c.group_size, batches.c.max_turns, batches.c.sampling,
            batches.c.context,
        )
        .join(batches, batches.c.id == episodes.c.batch_id)
        .where(episodes.c.status == str(EpisodeStatus.REQUESTED), episodes.c.published_at.is_(None))
        .order_by(episodes.c.created_at, episodes.c.id)
        .limit(limit)
    )
    if batch_id is not None:
        query = query.where(episodes.c.batch_id == batch_id)
    if min_age_s > 0:
        query = query.where(episodes.c.created_at < func.now() - timedelta(seconds=min_age_s))
    if lock:
        query = query.with_for_update(of=episodes, skip_locked=True, key_share=True)
    out: list[tuple[PlannedEpisode, BatchRunSpec]] = []
    specs: dict[str, BatchRunSpec] = {}
    for r in await conn.execute(query):
        spec = specs.get(r.batch_id)
        if spec is None:
            context = ContextPolicy.model_validate(r.context) if r.context is not None else None
            spec = BatchRunSpec(r.env, r.group_size, r.max_turns, SamplingParams.model_validate(r.sampling), context)
            specs[r.batch_id] = spec
        out.append(
            (PlannedEpisode(r.id, r.batch_id, r.group_id, r.task_index, r.group_index, r.env, r.task), spec)
        )
    return out


async def get_episode(conn: AsyncConnection, ep_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(episodes).where(episodes.c.id == ep_id))).first()
    return row_dict(row) if row is not None else None


async def episode_turns(conn: AsyncConnection, ep_id: str) -> list[dict[str, Any]]:
    rows = await conn.execute(
        select(turns).where(turns.c.episode_id == ep_id).order_by(turns.c.attempt, turns.c.turn_index,
                                                                   turns.c.event_id)
    )
    return [row_dict(r) for r in rows]


async def episode_steps(conn: AsyncConnection, ep_id: str) -> list[dict[str, Any]]:
    rows = await conn.execute(
        select(steps).where(steps.c.episode_id == ep_id).order_by(steps.c.attempt, steps.c.turn_index,
                                                                   steps.c.event_id)
    )
    return [row_dict(r) for r in rows]


async def get_trajectory(conn: AsyncConnection, ep_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(trajectories).where(trajectories.c.episode_id == ep_id))).first()
    return row_dict(row) if row is not None else None
