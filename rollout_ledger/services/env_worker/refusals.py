"""Work items this env worker does not run: handed back for another worker, or dead-lettered.

An item of a newer contract, or of an env this worker lacks, is another worker's: ``hand_back`` puts it back on the
queue without spending a delivery. An item that cannot be run at all (undecodable, wrong type) goes to the
dead-letter stream (``reject_work_item``). Both publish through the worker's producer (shared/kit/publisher.py).

The env worker has no database: it republishes the item's bytes on ``WORK_DEAD_LETTER_SUBJECT`` (why, and where
the item came from, in headers; deduplicated by the item's stream sequence), and only once the stream stored that
copy does it terminate the item. The recorder stores every dead-letter message as a row of ``dead_letters``. When
the copy cannot be published the item is handed back (a later delivery tries again; once the deliveries are spent
the max-deliveries advisory dead-letters it through the recorder instead), so a rejected item is never just lost.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.bus import ack_sync, best_effort, keep_in_progress
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import Producer
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_REASON_HEADER,
    DEAD_SEQ_HEADER,
    DEAD_SUBJECT_HEADER,
    DEAD_TRUNCATED_HEADER,
    MSG_ID_HEADER,
    PARKED_HEADER,
    WORK_DEAD_LETTER_SUBJECT,
)

log = get_logger(__name__)

_HANDED_BACK_DELAY_S = 2.0


def dead_letter_headers(subject: str, stream_seq: int, reason: str, size: int) -> dict[str, str]:
    """Headers of the dead-letter copy of a message (header values are one line of printable ASCII: control and
    non-ASCII characters of the reason are escaped)."""
    headers = {
        MSG_ID_HEADER: f"dead:{subject}:{stream_seq}",
        DEAD_SUBJECT_HEADER: subject,
        DEAD_SEQ_HEADER: str(stream_seq),
        DEAD_REASON_HEADER: " ".join(reason.split())[:1000].encode("unicode_escape").decode("ascii"),
    }
    if size > DEAD_LETTER_MAX_PAYLOAD:
        headers[DEAD_TRUNCATED_HEADER] = str(size)
    return headers


async def reject_work_item(producer: Producer, msg: Msg, reason: str) -> bool:
    """Dead-letter ``msg`` (a work item) and terminate it; hand it back when the copy could not be stored.

    Returns whether the item was dead-lettered."""
    data = bytes(msg.data)
    seq = int(msg.metadata.sequence.stream)
    headers = dead_letter_headers(msg.subject, seq, reason, len(data))
    try:
        await producer.publish("work_item.dead_letter", headers[MSG_ID_HEADER], data[:DEAD_LETTER_MAX_PAYLOAD],
                               WORK_DEAD_LETTER_SUBJECT, headers)
    except BusError as exc:  # the item stays on the queue: a later delivery (or the advisory) dead-letters it
        log.warning("work_item.dead_letter_failed", stream_seq=seq, error=str(exc))
        with best_effort("nak a handed-back item"):
            await msg.nak(delay=_HANDED_BACK_DELAY_S)
        return False
    log.error("work_item.dead_lettered", stream_seq=seq, reason=reason[:300])
    with best_effort("terminate a refused item"):
        await msg.term()
    return True


async def hand_back(producer: Producer, msg: Msg, delay_s: float, timeout_s: float = 10.0) -> None:
    """Put a work item this worker cannot run (a newer contract major, or an env it lacks: an item of the legacy
    subject or of a family member it does not have) back on the queue for another worker, on the same subject,
    without spending its deliveries: after ``delay_s`` (reporting progress meanwhile, so it is not redelivered
    here), republish the same bytes as a new message (through ``producer``: retried while the failure passes) and ack
    this one. A nak would count a delivery, and after ``max_deliver`` of them the episode would fail during a rolling
    upgrade. If the republish fails the item is nak'ed (one delivery spent) and ``BusError`` raised."""
    headers = dict(msg.headers or {})
    try:
        parked = int(headers.get(PARKED_HEADER) or 0) + 1
    except ValueError:  # a header we did not write: count from here
        parked = 1
    original_id = headers.pop(MSG_ID_HEADER, None) or f"{msg.subject}:{msg.metadata.sequence.stream}"
    msg_id = f"{original_id.split(':parked', 1)[0]}:parked{parked}"  # the producer writes it as Nats-Msg-Id
    headers[PARKED_HEADER] = str(parked)
    async with keep_in_progress(msg, max(0.5, delay_s / 3)):
        await asyncio.sleep(delay_s)
    try:
        await producer.publish("work_item.hand_back", msg_id, bytes(msg.data), msg.subject, headers)
    except BusError:
        with best_effort("nak an item to retry"):
            await msg.nak(delay=delay_s)
        raise
    await ack_sync(msg, timeout_s)
