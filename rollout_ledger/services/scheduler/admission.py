"""Staleness bounded at admission: which waiting episodes of a bounded batch may start now, and the loop that
moves them ``waiting -> requested`` and publishes their work items.

Design note.

- A batch with a staleness bound k (its ``max_staleness``, or the deployment's ``ROLLOUT_MAX_STALENESS`` at
  submission, stored with it) stores its episodes ``waiting``: no work item exists, so nothing can start them.
  Admission is the only writer of ``waiting -> requested`` (through ``lifecycle.allowed_sources``), one batch at
  a time under a per-batch advisory lock, so two schedulers never admit past the bound together.
- Versions. ``current`` is the newest version a trainer announced (``rl_policy``; the newest any worker serves if
  that is higher, e.g. workers started on a version nobody announced). ``serving`` is the LOWEST version a live
  inference worker serves (``rl_policy_workers``): the version a starting episode may be generated with. With no
  live report, a worker that starts serves the announced version, so ``serving = current``.
- The rule (AReaL's, in our terms):
  1. staleness: an episode starts only while ``current - serving <= k``; when the trainer pushed versions the
     workers do not serve yet, episodes wait rather than start on weights more than k versions old;
  2. run-ahead, with ``episodes_per_version`` B (the trainer's consumption per version): at most
     ``(current - base + k + 1) x B`` episodes of the batch are admitted in all, base being the version announced
     when the batch was stored. The trainer's progress is counted in versions it pushed, not in a consumer cursor
     position: any number of readers (or a re-read) may follow the ledger, and a push is the trainer's own
     statement that it consumed a step. With k = 0 and B = the trainer's batch, generation is strictly on-policy:
     step n+1's episodes start only once version base+n+1 serves.
- Whole groups only (a GRPO group shares one task and is trained together), in task order.
- A pass runs at batch creation, when a version is announced or a worker report arrives (``nudge``), and every
  ``ROLLOUT_ADMISSION_INTERVAL_S``. A crash between the status change and the publish loses nothing: the episode is
  ``requested`` without ``published_at`` and the outbox publishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from sqlalchemy import and_, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics
from rollout_ledger.services.scheduler.planning import BatchRunSpec, PlannedEpisode
from rollout_ledger.services.scheduler.policy_registry import worker_reports
from rollout_ledger.services.scheduler.work_items import WorkItemPublisher
from rollout_ledger.shared.db import episodes
from rollout_ledger.shared.errors import BusError, StoreError
from rollout_ledger.shared.events import ContextPolicy, SamplingParams
from rollout_ledger.shared.kit.bus import bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import parse_announcement
from rollout_ledger.shared.lifecycle import EpisodeStatus, allowed_sources
from rollout_ledger.shared.policy_versions import WorkerPolicyReport
from rollout_ledger.shared.subjects import POLICY_KEY

log = get_logger(__name__)

_LOCK = "rollout-ledger:admission:"
"""Advisory lock name prefix (+ batch id) serialising one batch's admissions across scheduler replicas."""


@dataclass(frozen=True)
class Versions:
    """The policy versions admission compares (see the module docstring)."""

    current: int
    """The newest announced version."""
    serving: int
    """The lowest version a live inference worker serves (``current`` when none reports)."""
    reporting: int = field(default=0, compare=False)
    """Inference workers with a live report (for ``rollout_inference_workers_live``; not part of the rule)."""

    @classmethod
    def of(cls, announced: int | None, reports: Sequence[WorkerPolicyReport]) -> Versions:
        serving = [r.serving for r in reports if r.serving is not None]
        current = max([announced or 0, *serving])
        return cls(current=current, serving=min(serving) if serving else current, reporting=len(reports))

    @property
    def gap(self) -> int:
        """How many versions behind the announced one a starting episode would be generated."""
        return max(0, self.current - self.serving)


@dataclass(frozen=True)
class Bound:
    """A batch's admission bound."""

    max_staleness: int
    episodes_per_version: int | None
    base_version: int
    group_size: int

    def limit(self, versions: Versions) -> int | None:
        """Episodes that may be admitted in all at ``versions`` (None: no run-ahead bound)."""
        if self.episodes_per_version is None:
            return None
        steps = max(0, versions.current - self.base_version) + self.max_staleness + 1
        return steps * self.episodes_per_version


@dataclass(frozen=True)
class Decision:
    """How many waiting episodes to admit now (a multiple of the group size), and why the rest are held."""

    admit: int
    limit: int | None
    held: str | None


def decide(bound: Bound, versions: Versions, admitted: int, waiting: int) -> Decision:
    """The admission rule (pure): whole groups, while the gap is within k and the run-ahead within its limit."""
    limit = bound.limit(versions)
    if waiting <= 0:
        return Decision(0, limit, None)
    if versions.gap > bound.max_staleness:
        return Decision(0, limit, f"inference workers serve version {versions.serving}, {versions.gap} behind the "
                                  f"announced {versions.current}: more than max_staleness {bound.max_staleness}")
    room = waiting if limit is None else min(waiting, max(0, limit - admitted))
    admit = room - room % bound.group_size
    if admit == 0:
        return Decision(0, limit, f"run-ahead: {admitted} episodes admitted, the limit at version "
                                  f"{versions.current} is {limit} (({versions.current} - {bound.base_version} + "
                                  f"{bound.max_staleness} + 1) x {bound.episodes_per_version}); the next "
                                  "version lets more start")
    return Decision(admit, limit, None if admit == waiting else "run-ahead: admitted up to the limit")


async def read_versions(policy_kv: KeyValue, workers_kv: KeyValue, js: JetStreamContext) -> Versions:
    """The announced version and the live workers' reports, from the bus (``BusError`` when unreadable)."""
    with bus_errors("read the announced policy version"):
        try:
            entry = await policy_kv.get(POLICY_KEY)
        except KeyNotFoundError:
            entry = None
    announcement = parse_announcement(entry.value if entry is not None else None)
    return Versions.of(announcement.version if announcement else None, await worker_reports(workers_kv, js))


def bound_of(batch: dict[str, Any]) -> Bound | None:
    """The batch's bound (the k stored with it: its own or the deployment's at submission); None when unbounded."""
    k = batch["max_staleness"]
    if k is None:
        return None
    return Bound(max_staleness=int(k), episodes_per_version=batch["episodes_per_version"],
                 base_version=int(batch["admission_base_version"] or 0), group_size=int(batch["group_size"]))


@dataclass(frozen=True)
class Standing:
    """A bounded batch's admission state, for ``GET /v1/batches/{id}``."""

    bound: Bound
    versions: Versions
    admitted: int
    waiting: int
    decision: Decision


async def standing(conn: AsyncConnection, batch: dict[str, Any], versions: Versions) -> Standing | None:
    bound = bound_of(batch)
    if bound is None:
        return None
    admitted, waiting = await _counts(conn, str(batch["id"]))
    return Standing(bound, versions, admitted, waiting, decide(bound, versions, admitted, waiting))


async def _counts(conn: AsyncConnection, batch_id: str) -> tuple[int, int]:
    waiting = episodes.c.status == str(EpisodeStatus.WAITING)
    row = (await conn.execute(
        select(func.count().filter(~waiting), func.count().filter(waiting)).where(episodes.c.batch_id == batch_id)
    )).one()
    return int(row[0]), int(row[1])


async def admit_batch(conn: AsyncConnection, batch_id: str,
                      versions: Versions) -> tuple[list[PlannedEpisode], BatchRunSpec | None]:
    """In the caller's transaction, under the batch's lock: move the episodes the rule admits to ``requested``
    (whole groups, task order), stamping ``admitted_version``; returns them and the batch's run spec."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": _LOCK + batch_id})
    batch = await batch_store.get_batch(conn, batch_id)
    if batch is None or batch["cancelled_at"] is not None:
        return [], None
    bound = bound_of(batch)
    admitted, waiting = await _counts(conn, batch_id)
    decision = decide(bound, versions, admitted, waiting) if bound is not None else Decision(waiting, None, None)
    if decision.admit == 0:
        return [], None
    chosen = (
        select(episodes.c.id)
        .where(episodes.c.batch_id == batch_id, episodes.c.status == str(EpisodeStatus.WAITING))
        .order_by(episodes.c.task_index, episodes.c.group_index)
        .limit(decision.admit)
    ).scalar_subquery()
    rows = (await conn.execute(
        update(episodes)
        .where(and_(episodes.c.id == func.any(func.array(chosen)),
                    episodes.c.status == func.any(allowed_sources(EpisodeStatus.REQUESTED))))
        .values(status=str(EpisodeStatus.REQUESTED), admitted_version=versions.current, updated_at=func.now())
        .returning(episodes.c.id, episodes.c.group_id, episodes.c.task_index, episodes.c.group_index,
                   episodes.c.env, episodes.c.task)
    )).all()
    planned = sorted((PlannedEpisode(r.id, batch_id, r.group_id, r.task_index, r.group_index, r.env, r.task)
                      for r in rows), key=lambda ep: (ep.task_index, ep.group_index))
    context = ContextPolicy.model_validate(batch["context"]) if batch["context"] is not None else None
    spec = BatchRunSpec(batch["env"], batch["group_size"], batch["max_turns"],
                        SamplingParams.model_validate(batch["sampling"]), context)
    return planned, spec


async def waiting_by_batch(conn: AsyncConnection) -> dict[str, int]:
    """Batch id -> its waiting episodes, for the batches that have some, oldest batch first (one scan of the
    partial index ``ix_episodes_waiting``)."""
    rows = await conn.execute(
        select(episodes.c.batch_id, func.count()).where(episodes.c.status == str(EpisodeStatus.WAITING))
        .group_by(episodes.c.batch_id).order_by(func.min(episodes.c.created_at)))
    return {r[0]: int(r[1]) for r in rows}


class Admission:
    """Runs admission passes (see the module docstring) and publishes what they admit."""

    def __init__(self, engine: AsyncEngine, publisher: WorkItemPublisher, policy_kv: KeyValue, workers_kv: KeyValue,
                 metrics: SchedulerMetrics, *, interval_s: float) -> None:
        self.engine = engine
        self.publisher = publisher
        self.policy_kv = policy_kv
        self.workers_kv = workers_kv
        self.metrics = metrics
        self.interval_s = interval_s
        self._nudged = asyncio.Event()
        self._lock = asyncio.Lock()
        self._progress_at = time.monotonic()
        """When admission last admitted some episode or found none waiting (``rollout_admission_stalled_seconds``)."""

    def nudge(self) -> None:
        """Run a pass soon (a version was announced, a worker reported, a bounded batch was stored)."""
        self._nudged.set()

    async def versions(self) -> Versions:
        """The versions admission compares now; sets the policy gauges (staleness, live inference workers)."""
        versions = await read_versions(self.policy_kv, self.workers_kv, self.publisher.js)
        self.metrics.policy_announced.set(versions.current)
        self.metrics.policy_serving.set(versions.serving)
        self.metrics.policy_staleness.set(versions.gap)
        self.metrics.inference_workers_live.set(versions.reporting)
        return versions

    async def admit(self, batch_ids: Sequence[str] | None = None) -> int:
        """One pass over ``batch_ids`` (every batch with waiting episodes by default); episodes admitted. A full
        pass (the default) also sets ``rollout_episodes_waiting`` and ``rollout_admission_stalled_seconds``."""
        async with self._lock:  # one pass at a time in this process (the advisory lock covers the others)
            versions = await self.versions()
            waiting: int | None = None
            if batch_ids is None:
                with batch_store.store_errors("finding batches with waiting episodes"):
                    async with self.engine.connect() as conn:
                        by_batch = await waiting_by_batch(conn)
                batch_ids = list(by_batch)
                waiting = sum(by_batch.values())
            total = 0
            for batch_id in batch_ids:
                with batch_store.store_errors(f"admitting episodes of batch {batch_id}"):
                    async with self.engine.begin() as conn:
                        planned, spec = await admit_batch(conn, batch_id, versions)
                if not planned or spec is None:
                    continue
                total += len(planned)
                self.metrics.episodes_admitted.inc(len(planned))
                log.info("admission.admitted", batch_id=batch_id, episodes=len(planned), current=versions.current,
                         serving=versions.serving)
                # a failed publish leaves them requested without published_at: the outbox publishes them
                await self.publisher.publish(planned, spec, source="admission")
            if waiting is not None:
                self._gauge_waiting(max(0, waiting - total), admitted=total > 0)
            elif total > 0:
                self._progress_at = time.monotonic()
            self.metrics.admission_passes.inc()
            return total

    def _gauge_waiting(self, left: int, *, admitted: bool) -> None:
        """After a full pass: ``left`` episodes still wait; stalled while some wait and none were admitted."""
        now = time.monotonic()
        if left == 0 or admitted:
            self._progress_at = now
        self.metrics.episodes_waiting.set(left)
        self.metrics.admission_stalled.set(0.0 if left == 0 else now - self._progress_at)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: a pass every ``interval_s`` or sooner when nudged."""
        while not stop.is_set():
            self._nudged.clear()  # before the pass: a nudge during it asks for another
            try:
                await self.admit()
            except (StoreError, BusError) as exc:
                log.warning("admission.pass_failed", error=str(exc))
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._nudged.wait())]
            try:
                await asyncio.wait(waits, timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await w
