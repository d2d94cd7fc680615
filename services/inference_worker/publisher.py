"""Publishing turns to the event stream and awaiting each stream ack without a task or request per publish.

``shared.bus.publish_event`` awaits ``js.publish``, which is a core NATS request: nats-py wraps every one in
``asyncio.wait_for`` (a new task) and a fresh future lookup, which costs more than the fake engine's whole
turn. The worker publishes one event per request at high rates, so it publishes the way nats-py's
``publish_async`` does, with the acks coming back through one wildcard inbox subscription, but awaits each
ack under its own deadline (a publish whose ack never comes fails with ``BusError`` and frees its slot).
Same contract as ``publish_event``: the subject ``rl.events.<type>``, ``Nats-Msg-Id`` = ``event_id``, and
success only once the stream has stored the event (or reported it as a duplicate of a stored one).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.shared.bus import msg_id_headers
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.subjects import event_subject

_NO_RESPONDERS = "503"


class StreamPublisher:
    """Publishes pre-encoded events to RL_EVENTS and awaits the stream's ack for each."""

    def __init__(self, nc: NATS, ack_timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.ack_timeout_s = ack_timeout_s
        self._prefix = ""
        self._tokens = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._prefix = f"{self.nc.new_inbox()}."
        self._sub = await self.nc.subscribe(f"{self._prefix}*", cb=self._on_ack)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(BusError("stream publisher stopped"))

    async def publish(self, event_type: str, event_id: str, data: bytes) -> None:
        """Publish ``data`` (an encoded event) and return once the stream has stored it; ``BusError`` if not."""
        token = str(next(self._tokens))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[token] = fut
        try:
            await self.nc.publish(event_subject(event_type), data, reply=self._prefix + token,
                                  headers=msg_id_headers(event_id))
            async with asyncio.timeout(self.ack_timeout_s):
                await fut
        except TimeoutError:
            raise BusError(f"no stream ack for {event_type} {event_id} within {self.ack_timeout_s}s") from None
        except BusError:
            raise
        except Exception as exc:  # nats-py raises several unrelated types (closed, reconnecting, ...)
            raise BusError(f"publish of {event_type} failed: {exc}") from exc
        finally:
            del self._waiting[token]

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._waiting.get(msg.subject[len(self._prefix):])
        if fut is None or fut.done():
            return
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
