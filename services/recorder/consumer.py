"""The recorder's consume loops: event batches to Postgres (ack after commit), and max-deliveries advisories.

Ack policy of the event consumer: a batch is acked only after its transaction committed; while Postgres is
down the same batch is retried with exponential backoff and kept alive with in-progress pings, so nothing is
acked that is not stored. Undecodable messages are dead-lettered and terminated; terminal events whose turns
are not all stored yet are nak'ed with a delay. A batch the server rejects as data (not a connection problem)
is replayed one message per transaction so that only the offending message is dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rollout_ledger.shared.errors import BusError, NewerContractError, SchemaError, StoreError
from rollout_ledger.shared.events import EpisodeFailed, EpisodeRequested, FailureClass, decode, decode_as
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import Shutdown, sleep_or_shutdown
from rollout_ledger.shared.subjects import WORK_STREAM

from .metrics import RecorderMetrics
from .recording import NEWER_CONTRACT, Action, BatchOutcome, Delivery, dead_letter_for, record_batch
from .settings import RecorderSettings
from .store import DeadLetter, Store

log = get_logger(__name__)

WORK_QUEUE_SOURCE = "work-queue"
"""``dead_letters.source`` of work items whose env workers kept dying."""
ADVISORY_SOURCE = "recorder-advisories"
"""``dead_letters.source`` of advisories the recorder could not read."""

_T = TypeVar("_T")


def to_delivery(msg: Msg) -> Delivery:
    """Decode a fetched message; a payload that is not a valid event becomes a delivery with ``error`` set."""
    meta = msg.metadata
    d = Delivery(stream_seq=int(meta.sequence.stream), subject=msg.subject, deliveries=int(meta.num_delivered),
                 payload=bytes(msg.data), headers=dict(msg.headers) if msg.headers else None)
    try:
        d.event = decode(msg.data)
    except NewerContractError as exc:
        d.error, d.error_class = f"newer contract: {exc}", NEWER_CONTRACT
    except SchemaError as exc:
        d.error, d.error_class = f"schema: {exc}", "schema"
    except Exception as exc:  # any other failure to parse the bytes is still a poison message
        d.error, d.error_class = f"undecodable: {type(exc).__name__}: {exc}", "undecodable"
    return d


class EventConsumer:
    """Fetches event batches, writes each in one transaction, then acks, naks or terminates every message."""

    def __init__(self, settings: RecorderSettings, store: Store, nc: NATS, psub: JetStreamContext.PullSubscription,
                 metrics: RecorderMetrics, shutdown: Shutdown, on_store: Callable[[bool], None]) -> None:
        self.settings = settings
        self.store = store
        self.nc = nc
        self.psub = psub
        self.metrics = metrics
        self.shutdown = shutdown
        self.on_store = on_store

    async def run(self) -> None:
        """Until shutdown: fetch, write, ack. The batch in hand is always finished first."""
        while not self.shutdown.requested:
            msgs = await bus.fetch(self.psub, self.settings.batch_size, self.settings.fetch_timeout_s)
            if msgs:
                await self.handle(msgs)

    async def handle(self, msgs: list[Msg]) -> None:
        started = time.perf_counter()
        batch = [to_delivery(m) for m in msgs]
        async with bus.keep_in_progress(msgs, max(0.5, self.settings.ack_wait_s / 3)):
            outcome = await self._write(batch)
        if outcome is None:
            return  # gave up during shutdown: nothing acked, JetStream redelivers to the next recorder
        await self._settle(msgs, outcome)
        self.metrics.batch_seconds.observe(time.perf_counter() - started)

    async def _write(self, batch: list[Delivery]) -> BatchOutcome | None:
        try:
            return await self._retrying(lambda: self._once(batch))
        except StoreError as exc:
            if exc.retryable:
                return None
            log.warning("recorder.batch_rejected", error=str(exc), size=len(batch))
            return await self._one_by_one(batch)

    async def _once(self, batch: list[Delivery]) -> BatchOutcome:
        async with self.store.transaction() as tx:
            return await record_batch(tx, batch, self.settings.assembly_max_deliveries)

    async def _retrying(self, op: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``op`` until it succeeds or fails non-retryably; retryable store errors back off (cap ~5 s).

        During shutdown the retries stop after ``drain_timeout_s`` and the last error is raised.
        """
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        give_up_at: float | None = None
        attempt = 0
        while True:
            try:
                result = await op()
            except StoreError as exc:
                if not exc.retryable:
                    self.on_store(True)
                    raise
                attempt += 1
                self.on_store(False)
                self.metrics.store_retries.inc()
                delay = backoff.delay()
                log.warning("recorder.store_retry", attempt=attempt, delay_s=delay, error=str(exc))
                if self.shutdown.requested:
                    give_up_at = give_up_at or time.monotonic() + self.settings.drain_timeout_s
                    if time.monotonic() >= give_up_at:
                        log.error("recorder.store_down_at_shutdown", error=str(exc))
                        raise
                    await asyncio.sleep(delay)
                else:
                    await sleep_or_shutdown(self.shutdown, delay)
                continue
            self.on_store(True)
            return result

    async def _one_by_one(self, batch: list[Delivery]) -> BatchOutcome | None:
        merged = BatchOutcome(actions=[])
        for d in batch:
            try:
                part = await self._retrying(functools.partial(self._once, [d]))
            except StoreError as exc:
                if exc.retryable:
                    return None
                part = await self._retrying(functools.partial(self._reject, d, exc))
            merged.actions += part.actions
            merged.processed.update(part.processed)
            merged.dead_letters.update(part.dead_letters)
            merged.trajectories += part.trajectories
            merged.naks += part.naks
            merged.parked += part.parked
            if part.newest_event_time and (merged.newest_event_time is None
                                           or part.newest_event_time > merged.newest_event_time):
                merged.newest_event_time = part.newest_event_time
        return merged

    async def _reject(self, d: Delivery, exc: StoreError) -> BatchOutcome:
        async with self.store.transaction() as tx:
            await tx.add_dead_letters([dead_letter_for(d, f"store rejected: {exc}")])
        log.error("recorder.dead_letter", stream_seq=d.stream_seq, reason=str(exc))
        out = BatchOutcome(actions=[Action.TERM])
        out.dead_letters["store_rejected"] += 1
        return out

    async def _settle(self, msgs: list[Msg], outcome: BatchOutcome) -> None:
        delay = self.settings.assembly_retry_delay_s
        for msg, action in zip(msgs, outcome.actions, strict=True):
            with contextlib.suppress(Exception):  # a lost ack means a redelivery, which is idempotent
                if action is Action.ACK:
                    await msg.ack()
                elif action is Action.NAK:
                    await msg.nak(delay=delay)
                elif action is Action.PARK:
                    await msg.nak(delay=self.settings.park_delay_s)
                else:
                    await msg.term()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=5)
        for event_type, n in outcome.processed.items():
            self.metrics.events_processed.labels(type=event_type).inc(n)
        for reason_class, n in outcome.dead_letters.items():
            self.metrics.dead_letters.labels(reason_class=reason_class).inc(n)
        self.metrics.trajectories_written.inc(outcome.trajectories)
        self.metrics.terminal_naks.inc(outcome.naks)
        if outcome.parked:
            self.metrics.newer_contract.inc(outcome.parked)
            log.warning("recorder.parked_newer_contract", count=outcome.parked, delay_s=self.settings.park_delay_s)
        if outcome.newest_event_time is not None:
            self.metrics.lag_seconds.set(max(0.0, (datetime.now(UTC) - outcome.newest_event_time).total_seconds()))
        if outcome.dead_letters:
            log.warning("recorder.dead_letters", counts=dict(outcome.dead_letters))


class AdvisoryConsumer:
    """Turns max-deliveries advisories of the work queue into dead letters and ``EpisodeFailed(infra)`` events."""

    def __init__(self, settings: RecorderSettings, store: Store, js: JetStreamContext,
                 psub: JetStreamContext.PullSubscription, metrics: RecorderMetrics, shutdown: Shutdown) -> None:
        self.settings = settings
        self.store = store
        self.js = js
        self.psub = psub
        self.metrics = metrics
        self.shutdown = shutdown

    async def run(self) -> None:
        while not self.shutdown.requested:
            msgs = await bus.fetch(self.psub, self.settings.advisory_batch_size, self.settings.fetch_timeout_s)
            for msg in msgs:
                await self._with_retry(msg)

    async def _with_retry(self, msg: Msg) -> None:
        backoff = Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)
        while True:
            try:
                async with bus.keep_in_progress(msg, max(0.5, self.settings.ack_wait_s / 3)):
                    await self.handle(msg)
                return
            except (StoreError, BusError) as exc:
                if not exc.retryable or self.shutdown.requested:
                    log.error("recorder.advisory_failed", error=str(exc), retryable=exc.retryable)
                    return  # not acked: redelivered after ack_wait
                delay = backoff.delay()
                log.warning("recorder.advisory_retry", delay_s=delay, error=str(exc))
                await sleep_or_shutdown(self.shutdown, delay)

    async def handle(self, msg: Msg) -> None:
        """Dead-letter the work item, publish the episode's infra failure, delete the item, ack the advisory."""
        try:
            adv = orjson.loads(msg.data)
            stream = str(adv.get("stream") or WORK_STREAM)
            seq = int(adv["stream_seq"])
            deliveries = int(adv.get("deliveries") or 0)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            async with self.store.transaction() as tx:
                await tx.add_dead_letters([DeadLetter(ADVISORY_SOURCE, msg.subject, int(msg.metadata.sequence.stream),
                                                      f"unreadable advisory: {exc}", bytes(msg.data), None)])
            self.metrics.dead_letters.labels(reason_class="advisory").inc()
            await msg.ack()
            return

        payload: bytes | None
        subject = ""
        headers: dict[str, str] | None = None
        try:
            raw = await self.js.get_msg(stream, seq)
            payload, subject = bytes(raw.data or b""), str(raw.subject or "")
            headers = dict(raw.headers) if raw.headers else None
        except NotFoundError:
            payload = None
        except Exception as exc:
            raise BusError(f"cannot read work item {stream}#{seq}: {exc}") from exc

        reason = (f"env worker died {deliveries} times running this episode: the work item was delivered "
                  f"{deliveries} times without an ack (max deliveries reached)")
        async with self.store.transaction() as tx:
            if payload is None:
                payload = await tx.dead_letter_payload(WORK_QUEUE_SOURCE, seq)  # replay: already stored
            else:
                await tx.add_dead_letters([DeadLetter(WORK_QUEUE_SOURCE, subject, seq, reason, payload, headers)])
        if payload is None:
            log.warning("recorder.advisory_without_work_item", stream=stream, stream_seq=seq)
            await msg.ack()
            return
        self.metrics.dead_letters.labels(reason_class="work_queue").inc()

        try:
            item = decode_as(payload, EpisodeRequested)
        except SchemaError as exc:
            log.error("recorder.advisory_bad_work_item", stream_seq=seq, error=str(exc))
        else:
            failed = EpisodeFailed(
                event_id=f"{item.episode_id}:infra-failed", episode_id=item.episode_id, batch_id=item.batch_id,
                attempt=max(1, deliveries), seq=1, produced_by=f"recorder/{self.settings.worker_id}",
                failure_class=FailureClass.INFRA, reason=reason, num_turns=0, retryable=False,
            )
            await bus.publish_event(self.js, failed)
            log.warning("recorder.episode_infra_failed", episode_id=item.episode_id, deliveries=deliveries)
        try:
            await self.js.delete_msg(stream, seq)
        except NotFoundError:
            pass  # already deleted (a replayed advisory)
        except Exception as exc:
            raise BusError(f"cannot delete work item {stream}#{seq}: {exc}") from exc
        await msg.ack()
