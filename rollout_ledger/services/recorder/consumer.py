"""The recorder's consume loops: event batches to Postgres (ack after commit), max-deliveries advisories of the
work queue (checked against the work consumer, never trusted on their word), and the dead-letter stream.

Ack policy of the event consumer: a batch is acked only after its transaction committed; while Postgres is
down the same batch is retried with exponential backoff and kept alive with in-progress pings, so nothing is
acked that is not stored. Undecodable messages are dead-lettered and terminated; terminal events whose turns
are not all stored yet are nak'ed with a delay. A batch the server rejects as data (not a connection problem)
is replayed one message per transaction so that only the offending message is dead-lettered. With tracing on, each
batch's write joins the trace of every episode it holds events of (traces.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from rollout_ledger.shared.errors import BusError, NewerContractError, SchemaError, StoreError
from rollout_ledger.shared.events import EpisodeFailed, EpisodeRequested, FailureClass, decode, decode_as
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import Producer
from rollout_ledger.shared.kit.runtime import Shutdown, sleep_or_stop
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_REASON_HEADER,
    DEAD_SUBJECT_HEADER,
    DEAD_TRUNCATED_HEADER,
    WORK_CONSUMER,
    WORK_DEAD_LETTER_SUBJECT,
    WORK_STREAM,
    work_consumer_subject,
    work_max_deliveries_advisory,
)

from .metrics import RecorderMetrics
from .recording import NEWER_CONTRACT, Action, BatchOutcome, Delivery, dead_letter_for, record_batch
from .settings import RecorderSettings
from .store import DeadLetter, Store
from .traces import BatchTraces

log = get_logger(__name__)

_NO_MESSAGE_FOUND = 10057
"""JetStream's error code for a message delete of a sequence that is gone (nats-py raises a ServerError, not a
NotFoundError): a replayed advisory whose item was deleted already."""

WORK_QUEUE_SOURCE = "work-queue"
"""``dead_letters.source`` of work items whose env workers kept dying."""
ADVISORY_SOURCE = "recorder-advisories"
"""``dead_letters.source`` of advisories the recorder could not read or does not trust."""
REJECTED_WORK_SOURCE = "env-worker"
"""``dead_letters.source`` of work items an env worker rejected (undecodable): ``stream_seq`` is the sequence in the
dead-letter stream, the work item's own is the stored ``Rollout-Dead-Seq`` header."""
DEAD_LETTER_STREAM_SOURCE = "dead-letter-stream"
"""``dead_letters.source`` of any other message of the dead-letter stream."""

_T = TypeVar("_T")

_MAX_DELIVERIES = 1_000_000
"""An advisory counting more deliveries than this is not NATS's (``max_deliver`` is a handful)."""


class Puller:
    """Fetches of one consumer loop that ride out a NATS outage: a ``BusError`` (the stream's leader being elected
    answers 503, a node gone makes the client reconnect) is logged and fetched again after a pause (0.1 s doubling to
    1 s), never raised: the loop must outlive an election. The pull stays bound to its durable consumer,
    which the cluster keeps (its replicas follow the stream's) and serves again from its new leader."""

    def __init__(self, psub: JetStreamContext.PullSubscription, settings: RecorderSettings, shutdown: Shutdown,
                 what: str) -> None:
        self.psub = psub
        self.settings = settings
        self.shutdown = shutdown
        self.what = what
        # a failed fetch costs the server little: capped at 1 s, so the loop is back within ~1 s of the new leader
        self.backoff = Backoff(min(0.1, settings.retry_initial_s), min(1.0, settings.retry_max_s), jitter=0.5)

    async def fetch(self, batch: int) -> list[Msg]:
        """Up to ``batch`` messages; none on a timeout, or after the pause of a failure."""
        try:
            msgs = await bus.fetch(self.psub, batch, self.settings.fetch_timeout_s)
        except BusError as exc:
            pause = self.backoff.delay()
            log.warning("recorder.fetch_failed", consumer=self.what, error=str(exc), retryable=exc.retryable,
                        pause_s=round(pause, 3))
            await sleep_or_stop(self.shutdown, pause)
            return []
        self.backoff.retries = 0
        return msgs


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
                 metrics: RecorderMetrics, shutdown: Shutdown, on_store: Callable[[bool], None],
                 tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing if tracing is not None else Tracing.off()
        """A batch's write joins the traces its events carry (off: nothing read or made)."""
        self.store = store
        self.nc = nc
        self.psub = psub
        self.metrics = metrics
        self.shutdown = shutdown
        self.on_store = on_store

    async def run(self) -> None:
        """Until shutdown: fetch, write, ack. The batch in hand is always finished first."""
        pull = Puller(self.psub, self.settings, self.shutdown, "events")
        while not self.shutdown.requested:
            msgs = await pull.fetch(self.settings.batch_size)
            if msgs:
                await self.handle(msgs)

    async def handle(self, msgs: list[Msg]) -> None:
        started = time.perf_counter()
        traces = BatchTraces.of(self.tracing, msgs, time.time_ns()) if self.tracing.enabled else None
        batch = [to_delivery(m) for m in msgs]
        async with bus.keep_in_progress(msgs, max(0.5, self.settings.ack_wait_s / 3)):
            outcome = await self._write(batch)
        if outcome is None:
            if traces is not None:
                traces.record(batch, None)
            return  # gave up during shutdown: nothing acked, JetStream redelivers to the next recorder
        await self._settle(msgs, outcome)
        if traces is not None:
            traces.record(batch, outcome)
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
        return await record_batch(self.store, batch, self.settings.assembly_max_deliveries)

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
                    await sleep_or_stop(self.shutdown, delay)
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
            with bus.best_effort("ack or nak a recorded event"):  # a lost ack means a redelivery, which is idempotent
                if action is Action.ACK:
                    await msg.ack()
                elif action is Action.NAK:
                    await msg.nak(delay=delay)
                elif action is Action.PARK:
                    await msg.nak(delay=self.settings.park_delay_s)
                else:
                    await msg.term()
        with bus.best_effort("flush the acks"):
            await self.nc.flush(timeout=5)
        for event_type, n in outcome.processed.items():
            self.metrics.events_processed.labels(type=event_type).inc(n)
        for reason_class, n in outcome.dead_letters.items():
            self.metrics.dead_letters.labels(reason_class=reason_class).inc(n)
        for (failure_class, retried), n in outcome.failures.items():
            self.metrics.attempt_failures.labels(failure_class=failure_class, retried=str(retried).lower()).inc(n)
        self.metrics.trajectories_written.inc(outcome.trajectories)
        self.metrics.terminal_naks.inc(outcome.naks)
        if outcome.parked:
            self.metrics.newer_contract.inc(outcome.parked)
            log.warning("recorder.parked_newer_contract", count=outcome.parked, delay_s=self.settings.park_delay_s)
        if outcome.newest_event_time is not None:
            self.metrics.lag_seconds.set(max(0.0, (datetime.now(UTC) - outcome.newest_event_time).total_seconds()))
        if outcome.dead_letters:
            log.warning("recorder.dead_letters", counts=dict(outcome.dead_letters))


async def settle_with_retry(settings: RecorderSettings, shutdown: Shutdown, msgs: Msg | list[Msg],
                            handle: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``handle`` for messages kept in progress meanwhile, retrying retryable store and bus errors with
    backoff; a non-retryable one (or shutdown) leaves them unacked, redelivered after ``ack_wait``."""
    backoff = Backoff(settings.retry_initial_s, settings.retry_max_s)
    while True:
        try:
            async with bus.keep_in_progress(msgs, max(0.5, settings.ack_wait_s / 3)):
                with bus.bus_errors(what.replace("_", " ")):
                    await handle()
            return
        except (StoreError, BusError) as exc:
            if not exc.retryable or shutdown.requested:
                log.error(f"recorder.{what}_failed", error=str(exc), retryable=exc.retryable)
                return
            delay = backoff.delay()
            log.warning(f"recorder.{what}_retry", delay_s=delay, error=str(exc))
            await sleep_or_stop(shutdown, delay)


class AdvisoryConsumer:
    """Turns max-deliveries advisories of the work queue into dead letters and ``EpisodeFailed(infra)`` events.

    An advisory's body is not trusted: the stream is always ``RL_WORK`` and the consumer a work consumer (the legacy
    ``env-workers`` or a route's ``env-workers-<token>``, in canonical form), named by the advisory's subject too (an
    advisory naming anything else is dead-lettered, and nothing is read or deleted), and its sequence must be a
    work item that consumer delivered and never acked (above its ack floor, at most its delivered sequence),
    stored on that consumer's one subject, after as many deliveries as the consumer allows. Only then is the item
    dead-lettered, its episode failed and the item deleted. (Who may publish advisories at all is NATS's part:
    no service user may publish on ``$JS.EVENT.>``.)
    """

    def __init__(self, settings: RecorderSettings, store: Store, js: JetStreamContext, producer: Producer,
                 psub: JetStreamContext.PullSubscription, metrics: RecorderMetrics, shutdown: Shutdown) -> None:
        self.settings = settings
        self.store = store
        self.js = js
        self.producer = producer
        """Publishes the episode failures of spent work items (the service's one ``StreamPublisher``)."""
        self.psub = psub
        self.metrics = metrics
        self.shutdown = shutdown

    async def run(self) -> None:
        pull = Puller(self.psub, self.settings, self.shutdown, "advisories")
        while not self.shutdown.requested:
            msgs = await pull.fetch(self.settings.advisory_batch_size)
            for msg in msgs:
                await self._with_retry(msg)

    async def _with_retry(self, msg: Msg) -> None:
        await settle_with_retry(self.settings, self.shutdown, msg, lambda: self.handle(msg), "advisory")

    async def _refuse(self, msg: Msg, reason: str) -> None:
        """Dead-letter an advisory that is unreadable or not to be trusted; nothing else happens."""
        async with self.store.transaction() as tx:
            await tx.add_dead_letters([DeadLetter(ADVISORY_SOURCE, msg.subject, int(msg.metadata.sequence.stream),
                                                  reason, bytes(msg.data),
                                                  dict(msg.headers) if msg.headers else None)])
        self.metrics.dead_letters.labels(reason_class="advisory").inc()
        log.error("recorder.advisory_refused", reason=reason)
        await msg.ack()

    async def _unacked_delivery(self, consumer: str, seq: int, deliveries: int) -> str | None:
        """Why work item ``seq`` is not one the work consumer ``consumer`` gave up on (None when it is)."""
        try:
            info = await self.js.consumer_info(WORK_STREAM, consumer)
        except NotFoundError:
            return f"there is no work consumer {consumer!r}"
        except bus.NATS_FAILURES as exc:
            raise bus.as_bus_error(exc, "read the work consumer's state") from exc
        delivered = int(info.delivered.stream_seq or 0) if info.delivered else 0
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        if seq > delivered:
            return f"work item #{seq} was never delivered (the work consumer delivered up to #{delivered})"
        if seq <= floor:
            return f"work item #{seq} was acked (the work consumer's ack floor is #{floor})"
        max_deliver = int(info.config.max_deliver or -1)
        if max_deliver > 0 and deliveries < max_deliver:
            return f"{deliveries} deliveries is fewer than the work consumer's max_deliver {max_deliver}"
        return None

    async def handle(self, msg: Msg) -> None:
        """Dead-letter the work item, publish the episode's infra failure, delete the item, ack the advisory."""
        try:
            adv = orjson.loads(msg.data)
            if not isinstance(adv, dict):
                raise TypeError(f"a JSON {type(adv).__name__}, not an object")
            named = (adv.get("stream"), adv.get("consumer"))
            seq = int(adv["stream_seq"])
            deliveries = int(adv.get("deliveries") or 0)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            await self._refuse(msg, f"unreadable advisory: {type(exc).__name__}: {exc}")
            return
        consumer = named[1] if isinstance(named[1], str) else ""
        work_subject = work_consumer_subject(consumer)
        if (named[0] != WORK_STREAM or work_subject is None
                or msg.subject != work_max_deliveries_advisory(consumer)):
            await self._refuse(msg, f"untrusted advisory: names stream {named[0]!r} consumer {named[1]!r} on "
                                    f"{msg.subject}; only max-deliveries advisories of {WORK_STREAM}'s work consumers "
                                    f"({WORK_CONSUMER} and {WORK_CONSUMER}-<route>) are acted on")
            return
        if not 1 <= seq < 2**63 or not 0 <= deliveries <= _MAX_DELIVERIES:
            await self._refuse(msg, f"untrusted advisory: stream_seq {seq} or deliveries {deliveries} out of range")
            return
        stream = WORK_STREAM  # never the body's: only the work queue's items are ever deleted

        reason = (f"env worker died {deliveries} times running this episode: the work item was delivered "
                  f"{deliveries} times without an ack (max deliveries reached)")
        async with self.store.transaction() as tx:
            # a replayed advisory: the item is stored already (from this consumer's subject: another's is no replay)
            stored = await tx.dead_letter_payload(WORK_QUEUE_SOURCE, seq, work_subject)
        if stored is not None:
            payload = stored
        else:
            why = await self._unacked_delivery(consumer, seq, deliveries)
            if why is not None:
                await self._refuse(msg, f"untrusted advisory: {why}")
                return
            try:
                raw = await self.js.get_msg(stream, seq)
            except NotFoundError:
                await self._refuse(msg, f"untrusted advisory: no work item #{seq} on {stream}")
                return
            except bus.NATS_FAILURES as exc:
                raise bus.as_bus_error(exc, f"read work item {stream}#{seq}") from exc
            payload, subject = bytes(raw.data or b""), str(raw.subject or "")
            if subject != work_subject:
                await self._refuse(msg, f"untrusted advisory: message #{seq} of {stream} is on {subject}, "
                                        f"not {work_subject} (the subject of {consumer})")
                return
            headers = dict(raw.headers) if raw.headers else None
            async with self.store.transaction() as tx:
                await tx.add_dead_letters([DeadLetter(WORK_QUEUE_SOURCE, subject, seq, reason, payload, headers)])
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
            await self.producer.publish_event(failed)
            log.warning("recorder.episode_infra_failed", episode_id=item.episode_id, deliveries=deliveries)
        try:
            await self.js.delete_msg(stream, seq)
        except NotFoundError:
            pass  # already deleted (a replayed advisory)
        except APIError as exc:
            if exc.err_code != _NO_MESSAGE_FOUND:  # JetStream answers "no message found" for a deleted one
                raise BusError(f"cannot delete work item {stream}#{seq}: {exc}") from exc
        except bus.NATS_FAILURES as exc:
            raise bus.as_bus_error(exc, f"delete work item {stream}#{seq}") from exc
        await msg.ack()


class DeadLetterConsumer:
    """Stores the messages of the dead-letter stream (work items an env worker rejected) as ``dead_letters`` rows.

    Everything on the stream is stored as it came, whatever it holds: the rejected message's subject, stream
    sequence and why come from the headers the rejecting service set (``Rollout-Dead-*``); a message without them is
    stored under its own subject. ``stream_seq`` is the message's sequence in the dead-letter stream (a replay
    stores nothing twice); the original sequence is in the stored headers.
    """

    def __init__(self, settings: RecorderSettings, store: Store, psub: JetStreamContext.PullSubscription,
                 metrics: RecorderMetrics, shutdown: Shutdown) -> None:
        self.settings = settings
        self.store = store
        self.psub = psub
        self.metrics = metrics
        self.shutdown = shutdown

    async def run(self) -> None:
        pull = Puller(self.psub, self.settings, self.shutdown, "dead letters")
        while not self.shutdown.requested:
            msgs = await pull.fetch(self.settings.advisory_batch_size)
            if msgs:
                await self._with_retry(msgs)

    async def _with_retry(self, msgs: list[Msg]) -> None:
        await settle_with_retry(self.settings, self.shutdown, msgs, lambda: self.handle(msgs), "dead_letter")

    async def handle(self, msgs: list[Msg]) -> None:
        letters = [dead_letter_of(m) for m in msgs]
        async with self.store.transaction() as tx:
            await tx.add_dead_letters(letters)
        for msg in msgs:
            # a lost ack means a redelivery, which stores nothing twice
            with bus.best_effort("ack a dead-lettered work item"):
                await msg.ack()
        self.metrics.dead_letters.labels(reason_class="rejected_work").inc(len(letters))
        log.warning("recorder.rejected_messages_stored", count=len(letters))


def dead_letter_of(msg: Msg) -> DeadLetter:
    """The ``dead_letters`` row of one message of the dead-letter stream."""
    headers = {str(k): str(v) for k, v in msg.headers.items()} if msg.headers else {}
    subject = headers.get(DEAD_SUBJECT_HEADER) or msg.subject
    reason = headers.get(DEAD_REASON_HEADER) or f"no {DEAD_REASON_HEADER} header"
    if DEAD_TRUNCATED_HEADER in headers:
        reason += f" (payload cut to {DEAD_LETTER_MAX_PAYLOAD} of {headers[DEAD_TRUNCATED_HEADER]} bytes)"
    source = REJECTED_WORK_SOURCE if msg.subject == WORK_DEAD_LETTER_SUBJECT else DEAD_LETTER_STREAM_SOURCE
    return DeadLetter(source, subject, int(msg.metadata.sequence.stream), reason, bytes(msg.data), headers or None)
