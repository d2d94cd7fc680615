"""The work items an env worker does not run, on real NATS: a rejected item's copy lands on the dead-letter stream
with its origin and reason in one-line headers (payload cut to 1 MiB), and when that copy cannot be stored the item
is handed back, not terminated; an item handed back for another worker is republished as a new message (same bytes,
a parked count, a new id) without spending a delivery. All through the worker's producer."""

from __future__ import annotations

from rollout_ledger.services.env_worker.refusals import dead_letter_headers, hand_back, reject_work_item
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_LETTER_STREAM,
    DEAD_REASON_HEADER,
    DEAD_SEQ_HEADER,
    DEAD_SUBJECT_HEADER,
    DEAD_TRUNCATED_HEADER,
    MSG_ID_HEADER,
    PARKED_HEADER,
    WORK_CONSUMER,
    WORK_STREAM,
    WORK_SUBJECT,
)


def test_headers_are_one_line_of_ascii() -> None:
    h = dead_letter_headers(WORK_SUBJECT, 7, "bad\r\nthing: ünïcode \x00" + "x" * 5000, DEAD_LETTER_MAX_PAYLOAD + 1)
    reason = h[DEAD_REASON_HEADER]
    assert reason.startswith("bad thing: \\xfcn\\xefcode") and len(reason) <= 1000 + 3 * 20
    assert reason.isascii() and reason.isprintable() and "\\x00" in reason
    assert (h[DEAD_SUBJECT_HEADER], h[DEAD_SEQ_HEADER], h[DEAD_TRUNCATED_HEADER]) == (
        WORK_SUBJECT, "7", str(DEAD_LETTER_MAX_PAYLOAD + 1))
    assert DEAD_TRUNCATED_HEADER not in dead_letter_headers(WORK_SUBJECT, 7, "r", 10)


async def test_rejected_item_is_copied_then_terminated(nc: bus.NATS) -> None:
    js = nc.jetstream()
    await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=3, max_ack_pending=10))
    big = b"\x00" * (DEAD_LETTER_MAX_PAYLOAD + 10)
    await js.publish(WORK_SUBJECT, big)
    work = await js.pull_subscribe_bind(WORK_CONSUMER, WORK_STREAM)
    [msg] = await work.fetch(1, timeout=5)
    assert await reject_work_item(StreamPublisher(nc, ack_timeout_s=5), msg, "undecodable work item: nope")
    copy = await js.get_msg(DEAD_LETTER_STREAM, 1)
    assert copy.data == big[:DEAD_LETTER_MAX_PAYLOAD] and copy.headers is not None
    assert copy.headers[DEAD_SEQ_HEADER] == "1" and copy.headers[DEAD_TRUNCATED_HEADER] == str(len(big))
    assert await bus.fetch(work, 1, 0.5) == []  # terminated: never delivered again
    await work.unsubscribe()


async def test_item_is_handed_back_when_the_copy_cannot_be_stored(nc: bus.NATS) -> None:
    js = nc.jetstream()
    await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=3, max_ack_pending=10))
    await js.delete_stream(DEAD_LETTER_STREAM)  # no stream stores rl.deadletters.work: the publish fails
    await js.publish(WORK_SUBJECT, b"garbage")
    work = await js.pull_subscribe_bind(WORK_CONSUMER, WORK_STREAM)
    [msg] = await work.fetch(1, timeout=5)
    assert not await reject_work_item(StreamPublisher(nc, ack_timeout_s=1), msg, "undecodable work item: nope")
    [again] = await work.fetch(1, timeout=10)  # handed back (after the nak delay), not lost
    assert again.data == b"garbage" and again.metadata.num_delivered == 2
    await again.term()
    await work.unsubscribe()


async def test_a_handed_back_item_is_a_new_message_and_spends_no_delivery(nc: bus.NATS) -> None:
    js = nc.jetstream()
    await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=3, max_ack_pending=10))
    await js.publish(WORK_SUBJECT, b"item", headers={MSG_ID_HEADER: "b.0.0:requested", "traceparent": "t"})
    work = await js.pull_subscribe_bind(WORK_CONSUMER, WORK_STREAM)
    [msg] = await work.fetch(1, timeout=5)
    producer = StreamPublisher(nc, ack_timeout_s=5)
    await hand_back(producer, msg, delay_s=0.0, timeout_s=5)
    [again] = await work.fetch(1, timeout=5)
    assert again.data == b"item" and again.metadata.num_delivered == 1, "a new message: its first delivery"
    assert again.headers == {MSG_ID_HEADER: "b.0.0:requested:parked1", PARKED_HEADER: "1", "traceparent": "t"}
    await hand_back(producer, again, delay_s=0.0, timeout_s=5)
    [third] = await work.fetch(1, timeout=5)
    assert third.headers is not None and third.headers[MSG_ID_HEADER] == "b.0.0:requested:parked2"
    assert (await js.stream_info(WORK_STREAM)).state.messages == 1, "each hand-back acked the message it replaced"
    await third.term()
    await work.unsubscribe()
    await producer.stop()

