"""Publishing encoded events to the event stream with one ack inbox and one deadline sweeper per connection.

``bus.publish_event`` awaits ``js.publish``, a core NATS request: nats-py wraps every one in ``asyncio.wait_for``
(a new task) and a fresh future, and ``js.publish_async`` adds a semaphore, random inbox tokens and a parsed
``PubAck`` per message. Workers publish an event per turn, where that overhead costs more than the turn's own
work. ``StreamPublisher`` publishes the way ``publish_async`` does (acks come back through one wildcard inbox
subscription) with neither a task nor a timer per message: every ack has the same timeout, so the waiting acks
are in deadline order and one sweeper task fails the overdue ones from the front.

Same contract as ``publish_event``: the subject is ``rl.events.<type>`` (or the given subject), ``Nats-Msg-Id``
is the ``event_id``, and a publish succeeds only once the stream has stored the event (or reported it as a
duplicate of a stored one); otherwise its future fails with ``BusError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.subjects import event_subject

_NO_RESPONDERS = "503"


class StreamPublisher:
    """Publishes pre-encoded events to a stream and resolves one future per stream ack."""

    def __init__(self, nc: NATS, ack_timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.ack_timeout_s = ack_timeout_s
        self._prefix = ""
        self._tokens = itertools.count(1)
        self._waiting: dict[str, tuple[asyncio.Future[None], float]] = {}
        """token -> (ack future, deadline); insertion order is deadline order (one timeout for all)."""
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._starting: asyncio.Lock | None = None

    @property
    def started(self) -> bool:
        return self._sub is not None

    @property
    def pending(self) -> int:
        """Publishes whose ack has not come yet."""
        return len(self._waiting)

    async def start(self) -> None:
        """Subscribe to the ack inbox and start the deadline sweeper (idempotent)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sub is not None:
                return
            prefix = f"{self.nc.new_inbox()}."
            self._sub = await self.nc.subscribe(f"{prefix}*", cb=self._on_ack)
            self._prefix = prefix
            self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        """Stop listening for acks; publishes still waiting fail with ``BusError``."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        waiting, self._waiting = self._waiting, {}
        for fut, _ in waiting.values():
            if not fut.done():
                fut.set_exception(BusError("stream publisher stopped"))

    async def publish_nowait(self, event_type: str, event_id: str, data: bytes,
                             subject: str | None = None) -> asyncio.Future[None]:
        """Publish ``data`` (an encoded event); return the future of the stream's ack.

        The future fails with ``BusError`` when the stream refuses the event or no ack comes within
        ``ack_timeout_s``; a failure to hand the message to the client raises ``BusError`` at once.
        """
        if self._sub is None:
            await self.start()
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting[token] = (fut, loop.time() + self.ack_timeout_s)
        try:
            await self.nc.publish(subject or event_subject(event_type), data, reply=self._prefix + token,
                                  headers={"Nats-Msg-Id": event_id})
        except Exception as exc:  # nats-py raises several unrelated types (closed, reconnecting, ...)
            self._waiting.pop(token, None)
            raise BusError(f"publish of {event_type} failed: {exc}") from exc
        return fut

    async def publish(self, event_type: str, event_id: str, data: bytes, subject: str | None = None) -> None:
        """Publish ``data`` and return once the stream has stored it; ``BusError`` if not."""
        await (await self.publish_nowait(event_type, event_id, data, subject))

    async def _sweep_forever(self) -> None:
        interval = min(1.0, max(0.01, self.ack_timeout_s / 10))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    def sweep(self) -> int:
        """Fail the publishes whose ack is overdue; returns how many."""
        now = asyncio.get_running_loop().time()
        overdue: list[str] = []
        for token, (_, deadline) in self._waiting.items():
            if deadline > now:
                break
            overdue.append(token)
        for token in overdue:
            fut, _ = self._waiting.pop(token)
            if not fut.done():
                fut.set_exception(BusError(f"no stream ack within {self.ack_timeout_s}s"))
        return len(overdue)

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if entry is None or entry[0].done():
            return
        fut = entry[0]
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS and not msg.data:
            fut.set_exception(BusError("no stream stores this subject (no responders)"))
            return
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
