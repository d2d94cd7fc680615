"""Work items an env worker cannot run (undecodable, wrong type, out of place) go to the dead-letter stream.

The env worker has no database: it republishes the item's bytes on ``WORK_DEAD_LETTER_SUBJECT`` (why, and where
the item came from, in headers; deduplicated by the item's stream sequence), and only once the stream stored that
copy does it terminate the item. The recorder stores every dead-letter message as a row of ``dead_letters``. When
the copy cannot be published the item is handed back (a later delivery tries again; once the deliveries are spent
the max-deliveries advisory dead-letters it through the recorder instead), so a rejected item is never just lost.
"""

from __future__ import annotations

import contextlib

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_REASON_HEADER,
    DEAD_SEQ_HEADER,
    DEAD_SUBJECT_HEADER,
    DEAD_TRUNCATED_HEADER,
    MSG_ID_HEADER,
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


async def reject_work_item(js: JetStreamContext, msg: Msg, reason: str, timeout_s: float) -> bool:
    """Dead-letter ``msg`` (a work item) and terminate it; hand it back when the copy could not be stored.

    Returns whether the item was dead-lettered."""
    data = bytes(msg.data)
    seq = int(msg.metadata.sequence.stream)
    headers = dead_letter_headers(msg.subject, seq, reason, len(data))
    try:
        await js.publish(WORK_DEAD_LETTER_SUBJECT, data[:DEAD_LETTER_MAX_PAYLOAD], timeout=timeout_s, headers=headers)
    except Exception as exc:  # the item stays on the queue: a later delivery (or the advisory) dead-letters it
        log.warning("work_item.dead_letter_failed", stream_seq=seq, error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            await msg.nak(delay=_HANDED_BACK_DELAY_S)
        return False
    log.error("work_item.dead_lettered", stream_seq=seq, reason=reason[:300])
    with contextlib.suppress(Exception):
        await msg.term()
    return True
