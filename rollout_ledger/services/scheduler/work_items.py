"""Puts episodes' work items on the work queue and records ``published_at``; the outbox republishes what was missed.

The batch and its episodes are committed before anything is published, so a crash between commit and publish
loses nothing: episodes still ``requested`` with ``published_at`` NULL are republished by the outbox loop.
Work items carry a deterministic ``Nats-Msg-Id``, so a republish within the stream's duplicate window is
dropped by JetStream. Each goes to the subject of its env's route (``route_book.RouteBook``), so only env workers
that have the env get it; with no such worker it waits on the queue. With tracing on, each publish is the root
span of its episode's trace, carried in the work item's headers (shared/kit/tracing.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics
from rollout_ledger.services.scheduler.planning import BatchRunSpec, PlannedEpisode
from rollout_ledger.services.scheduler.route_book import RouteBook
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.shared.db import episodes, store_errors
from rollout_ledger.shared.errors import BusError, StoreError
from rollout_ledger.shared.events import EpisodeRequested, encode
from rollout_ledger.shared.ids import requested_id
from rollout_ledger.shared.kit.bus import JetStreamContext
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import Producer
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.kit.tracing import Span, Tracing, end_span
from rollout_ledger.shared.subjects import work_subject

log = get_logger(__name__)


@dataclass(frozen=True)
class PublishResult:
    """Episode ids whose work item the stream acked, and how many were not acked."""

    acked: list[str]
    failed: int
    error: str | None = None


def work_item(ep: PlannedEpisode, spec: BatchRunSpec, produced_by: str) -> EpisodeRequested:
    """The ``EpisodeRequested`` work item of an episode (attempt 1, seq 0; the delivery count sets the attempt)."""
    return EpisodeRequested(
        event_id=requested_id(ep.id),
        episode_id=ep.id,
        batch_id=ep.batch_id,
        attempt=1,
        seq=0,
        produced_by=produced_by,
        env=spec.env,
        task=ep.task,
        group_id=ep.group_id,
        group_index=ep.group_index,
        group_size=spec.group_size,
        sampling=spec.sampling,
        max_turns=spec.max_turns,
        context=spec.context,
    )


async def publish_work_items(
    producer: Producer, items: Sequence[EpisodeRequested], timeout_s: float, routes: Mapping[str, str],
    tracing: Tracing | None = None,
) -> PublishResult:
    """Publish work items through ``producer`` to their env's route (``routes``: env -> route) and wait for their
    acks together (at most ``timeout_s``). With ``tracing`` on, each publish (to its ack) is the root span of its
    episode's trace."""
    if not items:
        return PublishResult([], 0)
    futures: list[tuple[str, asyncio.Future[None]]] = []
    spans: dict[str, Span] = {}
    error: str | None = None
    for ev in items:
        subject = work_subject(routes.get(ev.env) or ev.env)
        headers: dict[str, str] = {}
        if tracing is not None and tracing.enabled:
            span = tracing.root("episode.publish", attributes={
                "rollout.episode_id": ev.episode_id, "rollout.batch_id": ev.batch_id, "rollout.env": ev.env,
                "rollout.attempt_base": ev.attempt_base, "messaging.destination.name": subject})
            if span is not None:
                spans[ev.episode_id] = span
                tracing.inject(headers, span)
        try:
            fut = await producer.publish_nowait(str(ev.type), ev.event_id, encode(ev), subject, headers or None)
        except BusError as exc:  # the connection is closed or stalled: the rest wait for the outbox
            error = str(exc)
            break
        futures.append((ev.episode_id, fut))
    if futures:
        _, pending = await asyncio.wait([f for _, f in futures], timeout=timeout_s)
        for waiting in pending:
            waiting.cancel()  # the outbox publishes it again (the same Nats-Msg-Id: stored once)
        if pending and error is None:
            error = f"{len(pending)} publishes not acked within {timeout_s}s"
    acked: list[str] = []
    for ep_id, fut in futures:
        if fut.cancelled():
            continue
        failure = fut.exception()
        if failure is None:
            acked.append(ep_id)
        elif error is None:
            error = f"{type(failure).__name__}: {failure}"
    if spans:
        _end_publish_spans(spans, set(acked), error)
    return PublishResult(acked, len(items) - len(acked), error)


def _end_publish_spans(spans: Mapping[str, Span], acked: set[str], error: str | None) -> None:
    """End each episode's publish span; one whose work item the stream did not ack is an error (the outbox's
    republish starts another trace, unless JetStream drops it as a duplicate of the one stored)."""
    for ep_id, span in spans.items():
        end_span(span, None if ep_id in acked else error or "not acked")


async def mark_published(conn: AsyncConnection, episode_ids: Sequence[str]) -> int:
    """Stamp ``published_at`` on the episodes not stamped yet. The rows are locked first in id order (``FOR NO KEY
    UPDATE``, which leaves foreign-key checks alone), the order a recorder locks the episode rows it updates in
    (``Tx.lock_episodes``), so waiting for a recorder that is moving them past ``requested`` cannot deadlock; after
    the wait a row the recorder stamped itself is left as it is. Waiting matters: the batch's ``num_published``
    read after this commit must see every stamp."""
    if not episode_ids:
        return 0
    locked = (await conn.execute(
        select(episodes.c.id)
        .where(episodes.c.id == func.any(sorted(set(episode_ids))), episodes.c.published_at.is_(None))
        .order_by(episodes.c.id)
        .with_for_update(key_share=True)
    )).scalars().all()
    if not locked:
        return 0
    result = await conn.execute(
        update(episodes)
        .where(episodes.c.id == func.any(list(locked)), episodes.c.published_at.is_(None))
        .values(published_at=func.now())
    )
    return int(result.rowcount or 0)


class WorkItemPublisher:
    """Publishes work items for stored episodes and stamps ``published_at`` chunk by chunk."""

    def __init__(self, js: JetStreamContext, producer: Producer, engine: AsyncEngine, settings: SchedulerSettings,
                 metrics: SchedulerMetrics, tracing: Tracing | None = None) -> None:
        self.js = js
        self.producer = producer
        """The scheduler's one ``StreamPublisher`` (its ack timeout: ``publish_timeout_s``; no retry of its own:
        what is not acked is the outbox's)."""
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Each work item's publish starts its episode's trace (off: no span, no trace header)."""
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.produced_by = f"scheduler/{settings.worker_id}"
        self.routes = RouteBook(js)
        """The route of each env's work items (from the env workers' adverts), and which env workers are live."""

    async def publish(self, planned: Sequence[PlannedEpisode], spec: BatchRunSpec, source: str,
                      route: str | None = None) -> int:
        """Publish the episodes' work items to their env's route (``route`` when the caller just read it) chunk by
        chunk, stamping ``published_at`` on those the stream acked; returns how many were acked (the rest are left to
        the outbox)."""
        try:
            routes = {spec.env: route if route is not None else await self.routes.route(spec.env)}
        except BusError as exc:  # nothing published: the outbox publishes them once the adverts can be read
            self.metrics.publish_failures.inc(len(planned))
            log.warning("publish.no_route", env=spec.env, episodes=len(planned), error=str(exc))
            return 0
        published = 0
        chunk = self.settings.publish_chunk
        for start in range(0, len(planned), chunk):
            items = [work_item(ep, spec, self.produced_by) for ep in planned[start : start + chunk]]
            result = await publish_work_items(self.producer, items, self.settings.publish_timeout_s, routes,
                                              self.tracing)
            if result.acked:
                try:
                    with store_errors("stamp published_at"):
                        async with self.engine.begin() as conn:
                            await mark_published(conn, result.acked)
                except StoreError as exc:
                    # The work items are on the queue; the outbox may republish them (deduplicated by id).
                    log.warning("publish.stamp_failed", episodes=len(result.acked), error=str(exc))
            published += len(result.acked)
            self.metrics.episodes_published.labels(source).inc(len(result.acked))
            if result.failed:
                self.metrics.publish_failures.inc(result.failed)
                log.warning("publish.incomplete", acked=len(result.acked), failed=result.failed, error=result.error)
                break
        return published

    async def publish_pending(self, batch_id: str) -> int:
        """Publish the batch's episodes that are still waiting for their work item (idempotent replays)."""
        with batch_store.store_errors("read unpublished episodes"):
            async with self.engine.connect() as conn:
                rows = await batch_store.unpublished(conn, batch_id=batch_id, limit=self.settings.max_batch_episodes)
        if not rows:
            return 0
        return await self.publish([ep for ep, _ in rows], rows[0][1], source="replay")

    async def republish_once(self) -> int:
        """One outbox pass: republish up to ``republish_limit`` forgotten episodes, locked against other replicas."""
        with batch_store.store_errors("outbox pass"):
            async with self.engine.begin() as conn:
                rows = await batch_store.unpublished(
                    conn, min_age_s=self.settings.republish_grace_s, limit=self.settings.republish_limit, lock=True
                )
                if not rows:
                    return 0
                items = [work_item(ep, spec, self.produced_by) for ep, spec in rows]
                routes = await self.routes.routes(item.env for item in items)
                result = await publish_work_items(self.producer, items, self.settings.publish_timeout_s, routes,
                                                  self.tracing)
                await mark_published(conn, result.acked)
        self.metrics.episodes_published.labels("outbox").inc(len(result.acked))
        self.metrics.episodes_republished.inc(len(result.acked))
        if result.failed:
            self.metrics.publish_failures.inc(result.failed)
            raise BusError(f"outbox: {result.failed} of {len(items)} work items not published: {result.error}")
        log.info("outbox.republished", episodes=len(result.acked))
        return len(result.acked)

    async def run_outbox(self, stop: asyncio.Event, on_pass: Callable[[bool], None] | None = None) -> None:
        """Every ``republish_interval_s`` until ``stop``: republish forgotten episodes (and report DB health)."""
        async for _ in ticks(stop, self.settings.republish_interval_s):
            ok = True
            try:
                while await self.republish_once() >= self.settings.republish_limit and not stop.is_set():
                    pass
            except StoreError as exc:
                ok = False
                log.warning("outbox.store_error", error=str(exc))
            except BusError as exc:
                log.warning("outbox.bus_error", error=str(exc))
            if on_pass is not None:
                on_pass(ok)
