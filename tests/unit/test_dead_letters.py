"""The env worker's dead letters on real NATS: a rejected work item's copy lands on the dead-letter stream with its
origin and reason in one-line headers (payload cut to 1 MiB); when that copy cannot be stored the item is handed
back, not terminated."""

from __future__ import annotations

from rollout_ledger.services.env_worker.dead_letters import dead_letter_headers, reject_work_item
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_LETTER_STREAM,
    DEAD_REASON_HEADER,
    DEAD_SEQ_HEADER,
    DEAD_SUBJECT_HEADER,
    DEAD_TRUNCATED_HEADER,
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
    assert await reject_work_item(js, msg, "undecodable work item: nope", timeout_s=5)
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
    assert not await reject_work_item(js, msg, "undecodable work item: nope", timeout_s=1)
    [again] = await work.fetch(1, timeout=10)  # handed back (after the nak delay), not lost
    assert again.data == b"garbage" and again.metadata.num_delivered == 2
    await again.term()
    await work.unsubscribe()
