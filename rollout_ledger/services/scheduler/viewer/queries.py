"""The viewer's reads in Postgres: batch list, a batch's episodes (filtered), its reward histogram and failures,
a group's siblings, an episode's trajectory, steps, turns and logprob audits. Read-only; the scheduler's login.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from rollout_ledger.shared.db import (
    attempt_failures,
    attempt_resumes,
    batches,
    episodes,
    logprob_audits,
    row_dict,
    steps,
    trajectories,
    turns,
)

HISTOGRAM_BINS = 10


@dataclass(frozen=True)
class EpisodeFilter:
    """What the episode list keeps: every given field must match (None: any)."""

    env: str | None = None
    status: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    """A weight version that sampled some of its kept turns."""
    failure_class: str | None = None


def version_label(versions: Sequence[int] | None) -> str:
    """``v3``; ``v2-3`` for an episode sampled across a weight swap; ``none`` before any sampled turn."""
    if not versions:
        return "none"
    low, high = min(versions), max(versions)
    return f"v{low}" if low == high else f"v{low}-{high}"


async def list_batches(conn: AsyncConnection, limit: int, offset: int) -> tuple[int, list[dict[str, Any]]]:
    """How many batches there are, and one page of them, newest first, each with its counts per status and mean
    reward."""
    total = int((await conn.execute(select(func.count()).select_from(batches))).scalar() or 0)
    query = select(batches.c.id, batches.c.env, batches.c.num_tasks, batches.c.group_size, batches.c.num_episodes,
                   batches.c.created_at, batches.c.cancelled_at, batches.c.max_staleness)
    rows = [row_dict(r) for r in await conn.execute(
        query.order_by(batches.c.created_at.desc(), batches.c.id).limit(limit).offset(offset))]
    if not rows:
        return total, []
    ids = [r["id"] for r in rows]
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    rewards: dict[str, float | None] = {}
    stat_rows = await conn.execute(
        select(episodes.c.batch_id, episodes.c.status, func.count(), func.avg(episodes.c.reward))
        .where(episodes.c.batch_id.in_(ids)).group_by(episodes.c.batch_id, episodes.c.status))
    sums: dict[str, tuple[float, int]] = {}
    for batch_id, status, count, mean in stat_rows:
        counts[batch_id][status] = int(count)
        if mean is not None:
            reward_sum, n = sums.get(batch_id, (0.0, 0))
            sums[batch_id] = (reward_sum + float(mean) * int(count), n + int(count))
    for batch_id, (reward_sum, n) in sums.items():
        rewards[batch_id] = reward_sum / n if n else None
    for r in rows:
        r["counts"] = counts.get(r["id"], {})
        r["mean_reward"] = rewards.get(r["id"])
    return total, rows


def _filters(batch_id: str, f: EpisodeFilter) -> list[Any]:
    conds: list[Any] = [episodes.c.batch_id == batch_id]
    if f.env is not None:
        conds.append(episodes.c.env == f.env)
    if f.status is not None:
        conds.append(episodes.c.status == f.status)
    if f.reward_min is not None:
        conds.append(episodes.c.reward >= f.reward_min)
    if f.reward_max is not None:
        conds.append(episodes.c.reward <= f.reward_max)
    if f.version is not None:
        conds.append(episodes.c.weight_versions.any(f.version))
    if f.failure_class is not None:
        conds.append(episodes.c.failure_class == f.failure_class)
    return conds


async def list_episodes(conn: AsyncConnection, batch_id: str, f: EpisodeFilter, limit: int,
                        offset: int) -> tuple[int, list[dict[str, Any]]]:
    """How many episodes of the batch match, and one page of them in task and group order."""
    where = and_(*_filters(batch_id, f))
    total = int((await conn.execute(select(func.count()).select_from(episodes).where(where))).scalar() or 0)
    query = (
        select(episodes.c.id, episodes.c.group_id, episodes.c.task_index, episodes.c.group_index, episodes.c.env,
               episodes.c.status, episodes.c.attempt, episodes.c.reward, episodes.c.num_turns,
               episodes.c.stop_reason, episodes.c.failure_class, episodes.c.failure_reason,
               episodes.c.weight_versions, trajectories.c.num_tokens, trajectories.c.num_sampled_tokens,
               trajectories.c.num_segments)
        .select_from(episodes.outerjoin(trajectories, trajectories.c.episode_id == episodes.c.id))
        .where(where).order_by(episodes.c.task_index, episodes.c.group_index).limit(limit).offset(offset)
    )
    return total, [row_dict(r) for r in await conn.execute(query)]


@dataclass
class Histogram:
    """Rewards of one env and weight version, counted in the batch-wide bins."""

    env: str
    version: str
    counts: list[int]
    n: int
    mean: float


@dataclass
class BatchSummary:
    """The viewer's batch page: reward histograms, failures and the filter choices."""

    edges: list[float]
    histograms: list[Histogram]
    failures: dict[str, int]
    """Failed episodes by failure class."""
    attempt_failures: dict[str, dict[str, int]]
    """Every failed attempt by class: ``{"retried": n, "final": m}``."""
    envs: list[str]
    versions: list[int]
    statuses: dict[str, int] = field(default_factory=dict)


def range_edges(low: float, high: float, bins: int = HISTOGRAM_BINS) -> list[float]:
    """``bins + 1`` edges from ``low`` to ``high`` (a one-value range is widened by 0.5 each side)."""
    if math.isclose(low, high):
        low, high = low - 0.5, high + 0.5
    step = (high - low) / bins
    return [low + i * step for i in range(bins)] + [high]


def bin_edges(rewards: Sequence[float], bins: int = HISTOGRAM_BINS) -> list[float]:
    """The edges over the rewards' range; ``[0, 1]`` for none."""
    return range_edges(min(rewards), max(rewards), bins) if rewards else [0.0, 1.0]


def bin_of(edges: Sequence[float], value: float) -> int:
    """The bin of ``value``; the last bin is closed on the right. ``_SUMMARY_GROUPS`` computes the same in SQL,
    with the same float8 operations in the same order, so both put a value on an edge in the same bin."""
    bins = len(edges) - 1
    index = int((value - edges[0]) / (edges[-1] - edges[0]) * bins)
    return max(0, min(bins - 1, index))


_REWARD_RANGE = text("SELECT min(reward), max(reward) FROM episodes WHERE batch_id = :batch_id")

_SUMMARY_GROUPS = text("""
SELECT env, status, failure_class, weight_versions,
       CASE WHEN reward IS NOT NULL THEN
           least(greatest(floor((reward - :low) / (:high - :low) * :bins), 0), :bins - 1)::int
       END AS bin,
       count(*) AS n, sum(reward) AS total
FROM episodes WHERE batch_id = :batch_id
GROUP BY env, status, failure_class, weight_versions, bin
""")
"""A batch's episodes counted by everything the summary shows: one pass over the batch's rows in Postgres, a
few hundred groups back (envs x statuses x failure classes x version sets x bins), however large the batch."""


async def attempt_failures_by_class(conn: AsyncConnection, batch_id: str) -> dict[str, dict[str, int]]:
    """Every failed attempt of the batch by class: ``{"env": {"retried": n, "final": m}}``."""
    attempts: dict[str, dict[str, int]] = defaultdict(lambda: {"retried": 0, "final": 0})
    for fc, retried, count in await conn.execute(
            select(attempt_failures.c.failure_class, attempt_failures.c.retried, func.count())
            .where(attempt_failures.c.batch_id == batch_id)
            .group_by(attempt_failures.c.failure_class, attempt_failures.c.retried)):
        attempts[fc]["retried" if retried else "final"] += int(count)
    return dict(attempts)


async def batch_summary(conn: AsyncConnection, batch_id: str) -> BatchSummary:
    """Reward histograms per env and version span in batch-wide bins, failures, statuses and filter choices,
    counted in Postgres (``_SUMMARY_GROUPS``)."""
    low, high = (await conn.execute(_REWARD_RANGE, {"batch_id": batch_id})).one()
    edges = range_edges(float(low), float(high)) if low is not None else [0.0, 1.0]
    params = {"batch_id": batch_id, "low": edges[0], "high": edges[-1], "bins": len(edges) - 1}
    counts: dict[tuple[str, str], list[int]] = {}
    totals: dict[tuple[str, str], float] = defaultdict(float)
    failures: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    envs: set[str] = set()
    versions: set[int] = set()
    for env, status, failure_class, weight_versions, bin_, n, total in await conn.execute(_SUMMARY_GROUPS, params):
        envs.add(env)
        statuses[status] += n
        versions.update(weight_versions or ())
        if status == "failed":
            failures[failure_class or "unknown"] += n
        if bin_ is not None:
            key = (env, version_label(weight_versions))
            counts.setdefault(key, [0] * (len(edges) - 1))[bin_] += n
            totals[key] += float(total)
    histograms = [Histogram(env, label, c, sum(c), totals[(env, label)] / sum(c))
                  for (env, label), c in sorted(counts.items())]
    return BatchSummary(edges=edges, histograms=histograms, failures=dict(failures),
                        attempt_failures=await attempt_failures_by_class(conn, batch_id), envs=sorted(envs),
                        versions=sorted(versions),
                        statuses=dict(statuses))


async def group_siblings(conn: AsyncConnection, batch_id: str, task_index: int) -> list[dict[str, Any]]:
    """The episodes of one task (a GRPO group) in group order, with their trajectories where recorded."""
    query = (
        select(episodes.c.id, episodes.c.group_id, episodes.c.group_index, episodes.c.env, episodes.c.status,
               episodes.c.reward, episodes.c.failure_class, episodes.c.weight_versions, trajectories.c.token_ids,
               trajectories.c.loss_mask, trajectories.c.prompt_len)
        .select_from(episodes.outerjoin(trajectories, trajectories.c.episode_id == episodes.c.id))
        .where(episodes.c.batch_id == batch_id, episodes.c.task_index == task_index)
        .order_by(episodes.c.group_index)
    )
    return [row_dict(r) for r in await conn.execute(query)]


async def episode_detail(conn: AsyncConnection, episode_id: str) -> dict[str, Any] | None:
    """The trajectory with its episode's task position, the kept steps and turns, and its logprob audits;
    None when the episode has no trajectory."""
    traj = (await conn.execute(
        select(trajectories, episodes.c.task_index, episodes.c.group_index, episodes.c.stop_reason,
               episodes.c.failure_reason)
        .select_from(trajectories.join(episodes, episodes.c.id == trajectories.c.episode_id))
        .where(trajectories.c.episode_id == episode_id))).first()
    if traj is None:
        return None
    detail = row_dict(traj)
    attempt = detail["attempt"]
    detail["steps"] = [row_dict(r) for r in await conn.execute(
        select(steps.c.turn_index, steps.c.action, steps.c.observation, steps.c.reward, steps.c.terminated,
               steps.c.truncated, steps.c.drift, steps.c.new_segment, steps.c.info, steps.c.step_ms,
               steps.c.reused_from)
        .where(steps.c.episode_id == episode_id, steps.c.attempt == attempt, steps.c.superseded.is_(False))
        .order_by(steps.c.turn_index))]
    # the turns the kept steps name (a resumed attempt's carried-over turns belong to the attempt that made them)
    kept = (select(steps.c.turn_event_id)
            .where(steps.c.episode_id == episode_id, steps.c.attempt == attempt, steps.c.superseded.is_(False)))
    detail["turns"] = [row_dict(r) for r in await conn.execute(
        select(turns.c.turn_index, turns.c.attempt, turns.c.weight_version, turns.c.version_runs,
               func.cardinality(turns.c.token_ids).label("num_ids"), turns.c.finish_reason, turns.c.engine,
               turns.c.worker_id, turns.c.queue_ms, turns.c.generate_ms, turns.c.cached_tokens)
        .where(turns.c.episode_id == episode_id, turns.c.event_id.in_(kept))
        .order_by(turns.c.turn_index))]
    resume = (await conn.execute(
        select(attempt_resumes.c.mode, attempt_resumes.c.from_attempt, attempt_resumes.c.turns_recorded,
               attempt_resumes.c.turns_unstepped, attempt_resumes.c.reason)
        .where(attempt_resumes.c.episode_id == episode_id, attempt_resumes.c.attempt == attempt))).first()
    detail["resume"] = row_dict(resume) if resume is not None else None
    detail["audits"] = [row_dict(r) for r in await conn.execute(
        select(logprob_audits.c.source, logprob_audits.c.checkpoint, logprob_audits.c.engine,
               logprob_audits.c.num_tokens, logprob_audits.c.mean_abs_delta, logprob_audits.c.p99_abs_delta,
               logprob_audits.c.max_abs_delta, logprob_audits.c.created_at, logprob_audits.c.token_logprobs)
        .where(logprob_audits.c.episode_id == episode_id, logprob_audits.c.attempt == attempt)
        .order_by(logprob_audits.c.created_at))]
    return detail
