"""Wiring of the recorder process: settings, ops HTTP server, Postgres, NATS consumers, and the SIGTERM drain."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from rollout_ledger.shared.db import create_engine
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import Health, Shutdown, sleep_or_stop, ticks
from rollout_ledger.shared.kit.service import ServiceScope, run_main
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.subjects import (
    ADVISORY_CONSUMER,
    ADVISORY_STREAM,
    DEAD_LETTER_CONSUMER,
    DEAD_LETTER_STREAM,
    DEAD_LETTER_SUBJECT_PREFIX,
    EVENTS_STREAM,
    RECORDER_CONSUMER,
    WORK_MAX_DELIVERIES_ADVISORIES,
    ConsumerSpec,
)

from .consumer import AdvisoryConsumer, DeadLetterConsumer, EventConsumer
from .metrics import RecorderMetrics
from .resume_answers import ResumeResponder
from .settings import RecorderSettings
from .store import Store

log = get_logger(__name__)

SERVICE = "recorder"


def advisory_consumer_spec(ack_wait_s: float) -> ConsumerSpec:
    """The recorder's consumer of max-deliveries advisories (unlimited redelivery, one at a time)."""
    return ConsumerSpec(
        stream=ADVISORY_STREAM,
        durable=ADVISORY_CONSUMER,
        filter_subject=WORK_MAX_DELIVERIES_ADVISORIES,
        ack_wait_s=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=1000,
        description="recorder marks episodes failed (infra) when their work item ran out of deliveries",
    )


def dead_letter_consumer_spec(ack_wait_s: float) -> ConsumerSpec:
    """The recorder's consumer of the dead-letter stream (what services without a database rejected)."""
    return ConsumerSpec(
        stream=DEAD_LETTER_STREAM,
        durable=DEAD_LETTER_CONSUMER,
        filter_subject=f"{DEAD_LETTER_SUBJECT_PREFIX}.>",
        ack_wait_s=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=1000,
        description="recorder stores rejected messages (undecodable work items) in dead_letters",
    )


async def _wait_for_store(store: Store, settings: RecorderSettings, shutdown: Shutdown) -> bool:
    """Check the schema, retrying while Postgres is unreachable; False when shutdown came first."""
    backoff = Backoff(settings.retry_initial_s, settings.retry_max_s)
    while not shutdown.requested:
        try:
            await store.check()
            return True
        except StoreError as exc:
            delay = backoff.delay()
            log.warning("recorder.store_unreachable", delay_s=delay, error=str(exc))
            await sleep_or_stop(shutdown, delay)
    return False


async def _poll_pending(psub: JetStreamContext.PullSubscription, metrics: RecorderMetrics, settings: RecorderSettings,
                        shutdown: Shutdown) -> None:
    async for _ in ticks(shutdown, settings.pending_poll_s):
        with bus.best_effort("read the consumer's pending count"):
            info = await psub.consumer_info()
            metrics.pending.set(info.num_pending or 0)


async def run(settings: RecorderSettings, shutdown: Shutdown) -> None:
    """Run the recorder until ``shutdown`` is set, then finish the batch in hand and return."""
    metrics = RecorderMetrics.create()
    health = Health()
    store_ok = {"ok": False}

    def on_store(ok: bool) -> None:
        store_ok["ok"] = ok

    async with ServiceScope(SERVICE, settings, health, metrics.registry) as scope:
        log.info("recorder.http", port=scope.http.port)
        store = Store(create_engine(settings.database_url, pool_size=settings.db_pool_size))
        scope.on_close(store.dispose)
        if not await _wait_for_store(store, settings, shutdown):
            return
        on_store(True)
        nc = await scope.connect()
        js = nc.jetstream()
        await bus.ensure_consumer(js, bus.recorder_consumer_spec(settings.ack_wait_s, settings.max_ack_pending))
        await bus.ensure_consumer(js, advisory_consumer_spec(settings.ack_wait_s))
        await bus.ensure_consumer(js, dead_letter_consumer_spec(settings.ack_wait_s))
        subs: list[JetStreamContext.PullSubscription] = []
        scope.on_close(_unsubscribe, subs)
        events_sub = await js.pull_subscribe_bind(RECORDER_CONSUMER, EVENTS_STREAM)
        advisory_sub = await js.pull_subscribe_bind(ADVISORY_CONSUMER, ADVISORY_STREAM)
        dead_sub = await js.pull_subscribe_bind(DEAD_LETTER_CONSUMER, DEAD_LETTER_STREAM)
        subs += [events_sub, advisory_sub, dead_sub]

        health.checks["store"] = lambda: store_ok["ok"]
        responder = ResumeResponder(store, nc)
        await responder.start()
        scope.on_close(responder.stop)
        producer = StreamPublisher(nc, tracing=scope.tracing, retry_for_s=bus.RETRY_FOR_S)
        await producer.start()
        scope.on_close(producer.stop)
        health.ready = True
        log.info("recorder.ready", batch_size=settings.batch_size)

        events = EventConsumer(settings, store, nc, events_sub, metrics, shutdown, on_store, scope.tracing)
        advisories = AdvisoryConsumer(settings, store, js, producer, advisory_sub, metrics, shutdown)
        rejected = DeadLetterConsumer(settings, store, dead_sub, metrics, shutdown)
        tasks = [asyncio.create_task(events.run(), name="recorder-events"),
                 asyncio.create_task(advisories.run(), name="recorder-advisories"),
                 asyncio.create_task(rejected.run(), name="recorder-dead-letters"),
                 asyncio.create_task(_poll_pending(events_sub, metrics, settings, shutdown), name="recorder-pending")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # a loop that crashed takes the process down (exit non-zero)
        finally:
            health.draining = True
            await cancel_and_wait(tasks, raise_errors=False)
        log.info("recorder.drained")


async def _unsubscribe(subs: list[JetStreamContext.PullSubscription]) -> None:
    for sub in subs:
        with bus.best_effort("unsubscribe"):  # best effort: the connection closes next
            await sub.unsubscribe()


def main() -> None:
    run_main(SERVICE, RecorderSettings, run)
