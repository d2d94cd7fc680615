"""Publishing encoded events to the event stream, acks resolved through one reply inbox per publisher.

``bus.publish_event`` awaits ``js.publish``, a core NATS request: nats-py wraps every one in ``asyncio.wait_for``
(a new task) and a fresh future, and ``js.publish_async`` adds a semaphore, random inbox tokens and a parsed
``PubAck`` per message. Workers publish an event per turn, where that overhead costs more than the turn's own
work. ``StreamPublisher`` publishes the way ``publish_async`` does, its acks coming back through a
``ReplyInbox`` (``inbox.py``: one wildcard subscription, one deadline sweeper, no task or timer per message).

Same contract as ``publish_event``: the subject is ``rl.events.<type>`` (or the given subject), ``Nats-Msg-Id``
is the ``event_id``, and a publish succeeds only once the stream has stored the event (or reported it as a
duplicate of a stored one); otherwise its future fails with ``BusError``. With tracing on, the headers also carry
the trace context of the span current at the publish (shared/kit/tracing.py).
"""

from __future__ import annotations

import asyncio

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.inbox import ReplyInbox
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import MSG_ID_HEADER, event_subject


def _resolve_ack(fut: asyncio.Future[None], msg: Msg) -> None:
    """A stream's ack: stored (or a duplicate of a stored event), else the stream's refusal."""
    try:
        ack = orjson.loads(msg.data)
    except orjson.JSONDecodeError:
        fut.set_exception(BusError(f"unreadable stream ack: {msg.data[:200]!r}"))
        return
    error = ack.get("error") if isinstance(ack, dict) else None
    if error is not None or not isinstance(ack, dict) or "stream" not in ack:
        fut.set_exception(BusError(f"stream refused the event: {error or ack}"))
        return
    fut.set_result(None)


class StreamPublisher:
    """Publishes pre-encoded events to a stream and resolves one future per stream ack."""

    def __init__(self, nc: NATS, ack_timeout_s: float = 10.0, tracing: Tracing | None = None) -> None:
        self.nc = nc
        self.ack_timeout_s = ack_timeout_s
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Writes the current span's trace context beside ``Nats-Msg-Id`` (off: nothing)."""
        self._inbox: ReplyInbox[None] = ReplyInbox(
            nc, ack_timeout_s, resolve=_resolve_ack,
            on_timeout=lambda _label: BusError(f"no stream ack within {ack_timeout_s}s"),
            on_no_responders=lambda _label: BusError("no stream stores this subject (no responders)"))

    @property
    def started(self) -> bool:
        return self._inbox.started

    @property
    def pending(self) -> int:
        """Publishes whose ack has not come yet."""
        return self._inbox.pending

    async def start(self) -> None:
        """Subscribe to the ack inbox and start the deadline sweeper (idempotent)."""
        await self._inbox.start()

    async def stop(self) -> None:
        """Stop listening for acks; publishes still waiting fail with ``BusError``."""
        await self._inbox.stop(lambda: BusError("stream publisher stopped"))

    async def publish_nowait(self, event_type: str, event_id: str, data: bytes,
                             subject: str | None = None) -> asyncio.Future[None]:
        """Publish ``data`` (an encoded event); return the future of the stream's ack.

        The future fails with ``BusError`` when the stream refuses the event or no ack comes within
        ``ack_timeout_s``; a failure to hand the message to the client raises ``BusError`` at once.
        """
        if not self._inbox.started:
            await self.start()
        token, reply, fut = self._inbox.open(event_type)
        try:
            await self.nc.publish(subject or event_subject(event_type), data, reply=reply,
                                  headers=self.tracing.inject({MSG_ID_HEADER: event_id}))
        except Exception as exc:  # nats-py raises several unrelated types (closed, reconnecting, ...)
            self._inbox.close(token)
            raise BusError(f"publish of {event_type} failed: {exc}") from exc
        return fut

    async def publish(self, event_type: str, event_id: str, data: bytes, subject: str | None = None) -> None:
        """Publish ``data`` and return once the stream has stored it; ``BusError`` if not."""
        await (await self.publish_nowait(event_type, event_id, data, subject))

    def sweep(self) -> int:
        """Fail the publishes whose ack is overdue; returns how many."""
        return self._inbox.sweep()
