"""Wiring of the recorder process: settings, ops HTTP server, Postgres, NATS consumers, and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib

from nats.js import JetStreamContext

from rollout_ledger.shared.db import create_engine
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import configure_logging, get_logger
from rollout_ledger.shared.kit.runtime import Health, HttpServer, Shutdown, ops_app, sleep_or_shutdown
from rollout_ledger.shared.kit.tracing import setup_tracing
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
            await sleep_or_shutdown(shutdown, delay)
    return False


async def _poll_pending(psub: JetStreamContext.PullSubscription, metrics: RecorderMetrics, settings: RecorderSettings,
                        shutdown: Shutdown) -> None:
    while not shutdown.requested:
        with contextlib.suppress(Exception):
            info = await psub.consumer_info()
            metrics.pending.set(info.num_pending or 0)
        await sleep_or_shutdown(shutdown, settings.pending_poll_s)


async def run(settings: RecorderSettings, shutdown: Shutdown) -> None:
    """Run the recorder until ``shutdown`` is set, then finish the batch in hand and return."""
    metrics = RecorderMetrics.create()
    health = Health()
    store_ok = {"ok": False}

    def on_store(ok: bool) -> None:
        store_ok["ok"] = ok

    http = HttpServer(ops_app("recorder", health, metrics.registry), settings.http_host, settings.http_port)
    await http.start()
    log.info("recorder.http", port=http.port)
    store = Store(create_engine(settings.database_url, pool_size=settings.db_pool_size))
    nc: bus.NATS | None = None
    subs: list[JetStreamContext.PullSubscription] = []
    tracing = setup_tracing(settings, "recorder")  # off unless a collector is configured (ROLLOUT_TRACING_ENDPOINT)
    try:
        if not await _wait_for_store(store, settings, shutdown):
            return
        on_store(True)
        nc = await bus.connect(settings.nats_url, name=f"recorder-{settings.worker_id}",
                               connect_timeout_s=settings.nats_connect_timeout_s)
        js = nc.jetstream()
        await bus.ensure_topology(js, settings.stream_replicas)
        await bus.ensure_consumer(js, bus.recorder_consumer_spec(settings.ack_wait_s, settings.max_ack_pending))
        await bus.ensure_consumer(js, advisory_consumer_spec(settings.ack_wait_s))
        await bus.ensure_consumer(js, dead_letter_consumer_spec(settings.ack_wait_s))
        events_sub = await js.pull_subscribe_bind(RECORDER_CONSUMER, EVENTS_STREAM)
        advisory_sub = await js.pull_subscribe_bind(ADVISORY_CONSUMER, ADVISORY_STREAM)
        dead_sub = await js.pull_subscribe_bind(DEAD_LETTER_CONSUMER, DEAD_LETTER_STREAM)
        subs += [events_sub, advisory_sub, dead_sub]

        conn = nc
        health.checks["nats"] = lambda: conn.is_connected
        health.checks["store"] = lambda: store_ok["ok"]
        responder = ResumeResponder(store, nc)
        await responder.start()
        health.ready = True
        log.info("recorder.ready", batch_size=settings.batch_size)

        events = EventConsumer(settings, store, nc, events_sub, metrics, shutdown, on_store, tracing)
        advisories = AdvisoryConsumer(settings, store, js, advisory_sub, metrics, shutdown)
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
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await responder.stop()
        log.info("recorder.drained")
    finally:
        health.draining = True
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await bus.close(nc)
        await store.dispose()
        await http.stop()
        await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered


async def _amain(settings: RecorderSettings) -> None:
    shutdown = Shutdown()
    shutdown.install()
    await run(settings, shutdown)


def main() -> None:
    settings = RecorderSettings()
    configure_logging(settings.log_level, settings.log_format, service="recorder")
    asyncio.run(_amain(settings))
