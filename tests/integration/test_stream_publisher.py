"""StreamPublisher against a real JetStream: stored with its Nats-Msg-Id, dedupe, refusals and overdue acks."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.subjects import EVENTS_STREAM


async def test_publish_is_stored_once_per_event_id(nc: bus.NATS) -> None:
    pub = StreamPublisher(nc, ack_timeout_s=5.0)
    await pub.start()
    js = nc.jetstream()
    before = (await js.stream_info(EVENTS_STREAM)).state.messages
    await pub.publish("step.completed", "e1", b"one")
    futures = [await pub.publish_nowait("step.completed", f"e{i}", b"x") for i in range(1, 51)]
    await asyncio.gather(*futures)  # e1 again is a duplicate: acknowledged, not stored twice
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == before + 50
    assert pub.pending == 0
    await pub.stop()


async def test_subject_without_a_stream_fails(nc: bus.NATS) -> None:
    pub = StreamPublisher(nc, ack_timeout_s=5.0)
    with pytest.raises(BusError):
        await pub.publish("nothing", "e1", b"x", subject="no.stream.here")
    await pub.stop()


async def test_an_ack_that_never_comes_fails_after_the_timeout(nc: bus.NATS) -> None:
    async def never_ack(_msg: Msg) -> None:
        return None

    silent = await nc.subscribe("silent.subject", cb=never_ack)  # a responder, so no 503, but no ack either
    pub = StreamPublisher(nc, ack_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(BusError, match="no stream ack"):
        await pub.publish("silent", "e1", b"x", subject="silent.subject")
    assert 0.3 <= time.monotonic() - started < 2.0
    assert pub.pending == 0
    await silent.unsubscribe()
    await pub.stop()


async def test_the_trace_context_rides_beside_the_msg_id(nc: bus.NATS) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rollout_ledger.shared.events import EpisodeCancelled
    from rollout_ledger.shared.kit.tracing import TRACEPARENT_HEADER, Tracing
    from rollout_ledger.shared.subjects import MSG_ID_HEADER, event_subject

    tracing = Tracing.with_exporter("test", InMemorySpanExporter(), batch=False)
    pub = StreamPublisher(nc, ack_timeout_s=5.0, tracing=tracing)
    js = nc.jetstream()
    before = (await js.stream_info(EVENTS_STREAM)).state.messages
    with tracing.span("episode") as span:
        assert span is not None
        await pub.publish("step.completed", "traced-1", b"one")
        await pub.publish("step.completed", "traced-1", b"one")  # a republish: still deduplicated by its id
        cancelled = EpisodeCancelled(event_id="b.0.0:a1:end", episode_id="b.0.0", batch_id="b", attempt=1, seq=1,
                                     produced_by="test")
        await pub.publish_event(cancelled)
    ctx = span.get_span_context()
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == before + 2
    for subject, msg_id in (("step.completed", "traced-1"), ("episode.cancelled", "b.0.0:a1:end")):
        stored = await js.get_last_msg(EVENTS_STREAM, event_subject(subject))
        headers = stored.headers or {}
        assert headers[MSG_ID_HEADER] == msg_id
        assert headers[TRACEPARENT_HEADER].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    untraced = StreamPublisher(nc, ack_timeout_s=5.0)  # tracing off (the default): the headers are as they were
    await untraced.publish("step.completed", "untraced-1", b"two")
    stored = await js.get_last_msg(EVENTS_STREAM, event_subject("step.completed"))
    assert stored.headers == {MSG_ID_HEADER: "untraced-1"}
    await pub.stop()
    await untraced.stop()
