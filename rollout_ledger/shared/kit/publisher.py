"""The one producer: every message a service puts on a JetStream stream (events, work items, hand-backs, dead
letters) goes through a ``StreamPublisher``, its acks resolved through one reply inbox per publisher.

nats-py's ``js.publish`` is a core NATS request: nats-py wraps every one in ``asyncio.wait_for`` (a new task) and a
fresh future, and ``js.publish_async`` adds a semaphore, random inbox tokens and a parsed ``PubAck`` per message.
Workers publish an event per turn, where that overhead costs more than the turn's own work. ``StreamPublisher``
publishes the way ``publish_async`` does, its acks coming back through a ``ReplyInbox`` (``inbox.py``: one wildcard
subscription, one deadline sweeper, no task or timer per message). Components take a ``Producer`` (this class, or
the fake of tests/fakes.py in unit tests).

The contract: the subject is ``rl.events.<type>`` (or the given subject), ``Nats-Msg-Id``
is the ``event_id``, and a publish succeeds only once the stream has stored the event (or reported it as a
duplicate of a stored one); otherwise its future fails with ``BusError``. With tracing on, the headers also carry
the trace context of the span current at the publish (shared/kit/tracing.py).

A passing failure (no responders or no ack while a JetStream cluster elects the stream's leader, a stream's 5xx)
is published again, the same bytes and ``Nats-Msg-Id`` (stored once), after a pause of 0.1 s doubling to 2 s,
until ``retry_for_s`` after the first publish (the services give ``bus.RETRY_FOR_S``); only then does the future
fail. A publish whose ack had not come when the connection was re-established (a NATS node lost with the publish
or its ack) is sent again at once, not after ``ack_timeout_s`` (``ReplyInbox``'s ``on_reconnect``). The retry costs
nothing while nothing fails: a done-callback on the ack's future, no task per message.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import EventBase, encode
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.bus import bus_errors
from rollout_ledger.shared.kit.inbox import ReplyInbox
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import MSG_ID_HEADER, event_subject, subject_of

log = get_logger(__name__)


def _resolve_ack(fut: asyncio.Future[None], msg: Msg) -> None:
    """A stream's ack: stored (or a duplicate of a stored event), else the stream's refusal."""
    try:
        ack = orjson.loads(msg.data)
    except orjson.JSONDecodeError:
        fut.set_exception(BusError(f"unreadable stream ack: {msg.data[:200]!r}"))
        return
    error = ack.get("error") if isinstance(ack, dict) else None
    if error is not None or not isinstance(ack, dict) or "stream" not in ack:
        code = error.get("code") if isinstance(error, dict) else None
        passing = isinstance(code, int) and code >= 500  # e.g. 503 while the stream elects a leader
        fut.set_exception(BusError(f"stream refused the event: {error or ack}", retryable=passing))
        return
    fut.set_result(None)


@dataclass
class _Publish:
    """One event being published until stored: what to send again, and until when."""

    event_type: str
    event_id: str
    data: bytes
    subject: str | None
    headers: Mapping[str, str] | None
    deadline: float
    backoff: Backoff


class Producer(Protocol):
    """What a component publishes to a stream through: ``StreamPublisher``, or a fake in unit tests
    (``tests/fakes.py``). Every product publish goes through one."""

    async def publish_nowait(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                             headers: Mapping[str, str] | None = None) -> asyncio.Future[None]: ...

    async def publish(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                      headers: Mapping[str, str] | None = None) -> None: ...

    async def publish_event(self, event: EventBase, route: str | None = None) -> None: ...


class StreamPublisher:
    """Publishes pre-encoded events to a stream and resolves one future per stream ack."""

    def __init__(self, nc: NATS, ack_timeout_s: float = 10.0, tracing: Tracing | None = None,
                 retry_for_s: float = 0.0) -> None:
        self.nc = nc
        self.ack_timeout_s = ack_timeout_s
        self.retry_for_s = retry_for_s
        """How long a passing failure is published again (0, the default: the first failure fails the future;
        services pass ``bus.RETRY_FOR_S``)."""
        self.retries = 0
        """Publishes sent again after a passing failure, so far."""
        self._again: set[asyncio.Task[None]] = set()
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Writes the current span's trace context beside ``Nats-Msg-Id`` (off: nothing)."""
        self._inbox: ReplyInbox[None] = ReplyInbox(
            nc, ack_timeout_s, resolve=_resolve_ack,
            on_timeout=lambda _label: BusError(f"no stream ack within {ack_timeout_s}s"),
            on_no_responders=lambda _label: BusError("no stream stores this subject (no responders)"),
            on_reconnect=(lambda _label: BusError("reconnected before the stream's ack")) if retry_for_s > 0 else None)

    @property
    def started(self) -> bool:
        return self._inbox.started

    @property
    def pending(self) -> int:
        """Publishes whose ack has not come yet (or that wait to be sent again)."""
        return self._inbox.pending + len(self._again)

    async def start(self) -> None:
        """Subscribe to the ack inbox and start the deadline sweeper (idempotent)."""
        await self._inbox.start()

    async def stop(self) -> None:
        """Stop listening for acks; publishes still waiting (or waiting to be sent again) fail with ``BusError``."""
        for task in list(self._again):
            task.cancel()
        await self._inbox.stop(lambda: BusError("stream publisher stopped", retryable=False))

    async def publish_nowait(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                             headers: Mapping[str, str] | None = None) -> asyncio.Future[None]:
        """Publish ``data`` (an encoded event, or a message's bytes) to ``subject`` (default: the event type's); return
        the future of the stream's ack. ``event_type`` names the message in logs and errors; ``event_id`` is its
        ``Nats-Msg-Id``. ``headers`` are sent beside it, and when given they carry the trace context themselves (a
        work item's root span); without them, the current span's is written.

        The future fails with ``BusError`` when the stream refuses the event, or when a passing failure (no ack
        within ``ack_timeout_s``, no responders) lasts beyond ``retry_for_s``; a failure to hand the message to the
        client raises ``BusError`` at once.
        """
        fut = await self._send(event_type, event_id, data, subject, headers)
        if self.retry_for_s <= 0:
            return fut
        loop = asyncio.get_running_loop()
        stored: asyncio.Future[None] = loop.create_future()
        job = _Publish(event_type, event_id, data, subject, headers, loop.time() + self.retry_for_s,
                       Backoff(0.1, 2.0, jitter=0.5))
        fut.add_done_callback(functools.partial(self._settled, stored, job))
        return stored

    async def _send(self, event_type: str, event_id: str, data: bytes, subject: str | None,
                    headers: Mapping[str, str] | None) -> asyncio.Future[None]:
        if not self._inbox.started:
            await self.start()
        token, reply, fut = self._inbox.open(event_type)
        sent = {**headers, MSG_ID_HEADER: event_id} if headers else self.tracing.inject({MSG_ID_HEADER: event_id})
        try:
            with bus_errors(f"publish of {event_type}"):
                await self.nc.publish(subject or event_subject(event_type), data, reply=reply, headers=sent)
        except BusError:
            self._inbox.close(token)
            raise
        return fut

    def _settled(self, stored: asyncio.Future[None], job: _Publish, fut: asyncio.Future[None]) -> None:
        """One try's ack came (or failed): resolve ``stored``, or publish again after a pause."""
        if stored.done():
            return
        if fut.cancelled():
            stored.cancel()
            return
        exc = fut.exception()
        if exc is None:
            stored.set_result(None)
            return
        loop = asyncio.get_running_loop()
        pause = job.backoff.delay()
        if not (isinstance(exc, BusError) and exc.retryable) or loop.time() + pause > job.deadline:
            stored.set_exception(exc)
            return
        task = loop.create_task(self._send_again(stored, job, pause, exc))
        self._again.add(task)
        task.add_done_callback(self._again.discard)

    async def _send_again(self, stored: asyncio.Future[None], job: _Publish, pause: float, why: BaseException) -> None:
        self.retries += 1
        log.debug("publisher.retry", event_type=job.event_type, event_id=job.event_id, pause_s=round(pause, 3),
                 error=str(why))
        try:
            await asyncio.sleep(pause)
            if stored.done():  # given up by its caller meanwhile
                return
            fut = await self._send(job.event_type, job.event_id, job.data, job.subject, job.headers)
        except asyncio.CancelledError:
            if not stored.done():
                stored.set_exception(BusError("stream publisher stopped", retryable=False))
            raise
        except BusError as exc:
            if not stored.done():
                stored.set_exception(exc)
            return
        fut.add_done_callback(functools.partial(self._settled, stored, job))

    async def publish(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                      headers: Mapping[str, str] | None = None) -> None:
        """Publish ``data`` and return once the stream has stored it; ``BusError`` if not."""
        await (await self.publish_nowait(event_type, event_id, data, subject, headers))

    async def publish_event(self, event: EventBase, route: str | None = None) -> None:
        """Publish ``event`` to its subject (a work item: to its env's ``route``, ``subject_of``) and return once the
        stream has stored it; ``BusError`` if not."""
        event_type = str(event.type)
        await self.publish(event_type, str(event.event_id), encode(event), subject_of(event_type, route))
