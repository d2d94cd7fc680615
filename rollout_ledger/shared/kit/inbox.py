"""One reply inbox for many outstanding requests: a wildcard subscription, a future per request, one sweeper.

nats-py's ``request`` (and ``js.publish``, a request too) wraps every call in ``asyncio.wait_for`` (a task) and a
fresh future. Our hot paths send a request per turn (an event's stream ack, an inference request), where that
overhead costs more than the turn's own work. A ``ReplyInbox`` subscribes once to ``<inbox>.*`` and hands each
request a reply subject ``<inbox>.<token>`` and a future. Every request of one inbox has the same timeout, so
the waiting requests are in deadline order and one sweeper task fails the overdue ones from the front: no
task or timer per request. A request can also be failed from outside (``fail``: the inference client does so
when a worker's heartbeats stop).

A reply may be lost with the connection: the request or its reply died with a NATS node (SIGKILL, or a rolling
restart of a cluster) while the client reconnected to another. An inbox given ``on_reconnect`` fails the requests
opened before a reconnect with that error as soon as the sweeper sees the client's reconnect count grow (its next
tick), so its owner can send them again at once instead of waiting out their timeout; without it they wait.

A request may take longer than the timeout and still be alive: its owner, told so (the inference worker says every
few seconds that it still generates a turn: ``PROGRESS_TO_HEADER`` in shared/subjects.py), calls ``extend`` with the
request's reply subject, which moves its deadline to a full timeout from now. The moved request goes to the back of
the deadline order, where its new deadline belongs.

Used by ``publisher.StreamPublisher`` (stream acks) and the env worker's inference client (turn replies); each
says how a reply resolves its future (``resolve``) and what a timeout or NATS's no-responders reply raises.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.shared.kit.bus import best_effort
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.subjects import NO_RESPONDERS_STATUS, STATUS_HEADER

T = TypeVar("T")

RECONNECT_LOOK_S = 0.25
"""How often an inbox given ``on_reconnect`` looks at the client's reconnect count (a dictionary read)."""


def is_no_responders(msg: Msg) -> bool:
    """NATS's own reply to a request that no subscriber took."""
    headers = msg.headers
    return headers is not None and headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS and not msg.data


class ReplyInbox(Generic[T]):
    """Futures of outstanding requests, resolved by replies on one wildcard inbox subscription."""

    def __init__(self, nc: NATS, timeout_s: float, *,
                 resolve: Callable[[asyncio.Future[T], Msg], None],
                 on_timeout: Callable[[str], Exception],
                 on_no_responders: Callable[[str], Exception],
                 on_reconnect: Callable[[str], Exception] | None = None) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._resolve = resolve
        self._on_timeout = on_timeout
        self._on_no_responders = on_no_responders
        self._on_reconnect = on_reconnect
        self._reconnects = 0
        """The client's reconnect count at the sweeper's last look."""
        self._prefix = ""
        self._tokens = itertools.count(1)
        self._waiting: dict[str, tuple[asyncio.Future[T], float, str]] = {}
        """token -> (future, deadline, label); insertion order is deadline order (one timeout for all)."""
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._starting: asyncio.Lock | None = None

    @property
    def started(self) -> bool:
        return self._sub is not None

    @property
    def pending(self) -> int:
        """Requests whose reply has not come yet."""
        return len(self._waiting)

    async def start(self) -> None:
        """Subscribe to the inbox and start the deadline sweeper (idempotent)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sub is not None:
                return
            prefix = f"{self.nc.new_inbox()}."
            self._sub = await self.nc.subscribe(f"{prefix}*", cb=self._on_reply)
            self._prefix = prefix
            self._reconnects = self._reconnect_count()
            self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self, error: Callable[[], Exception]) -> None:
        """Stop listening; requests still waiting fail with ``error()``."""
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
            self._sweeper = None
        if self._sub is not None:
            with best_effort("unsubscribe the reply inbox"):
                await self._sub.unsubscribe()
            self._sub = None
        waiting, self._waiting = self._waiting, {}
        for fut, _, _ in waiting.values():
            if not fut.done():
                fut.set_exception(error())

    def open(self, label: str) -> tuple[str, str, asyncio.Future[T]]:
        """A new request: ``(token, reply subject, future)``; ``label`` names it in timeout errors. The inbox must
        be started."""
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        fut: asyncio.Future[T] = loop.create_future()
        self._waiting[token] = (fut, loop.time() + self.timeout_s, label)
        return token, self._prefix + token, fut

    def close(self, token: str) -> None:
        """Forget a request (answered, failed or given up by its caller); a late reply is then ignored."""
        self._waiting.pop(token, None)

    def sweep(self) -> int:
        """Fail the requests whose reply is overdue; returns how many."""
        now = asyncio.get_running_loop().time()
        overdue: list[str] = []
        for token, (_, deadline, _) in self._waiting.items():
            if deadline > now:
                break
            overdue.append(token)
        for token in overdue:
            fut, _, label = self._waiting.pop(token)
            if not fut.done():
                fut.set_exception(self._on_timeout(label))
        return len(overdue)

    def _reconnect_count(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    def reconnected(self) -> int:
        """With ``on_reconnect``: when the client reconnected since the last look, fail every request still waiting
        (each was opened before this look, so maybe before the reconnect) with ``on_reconnect``; how many."""
        reconnects = self._reconnect_count()
        if self._on_reconnect is None or reconnects == self._reconnects:
            return 0
        self._reconnects = reconnects
        waiting, self._waiting = self._waiting, {}
        for fut, _, label in waiting.values():
            if not fut.done():
                fut.set_exception(self._on_reconnect(label))
        return len(waiting)

    async def _sweep_forever(self) -> None:
        interval = min(1.0, max(0.01, self.timeout_s / 10))
        if self._on_reconnect is not None:
            interval = min(interval, RECONNECT_LOOK_S)
        while True:
            await asyncio.sleep(interval)
            self.reconnected()
            self.sweep()

    def extend(self, reply: str) -> bool:
        """A sign of life of the request whose reply subject is ``reply``: its deadline is a full timeout from now;
        whether it still waits."""
        if not self._prefix or not reply.startswith(self._prefix):
            return False
        token = reply[len(self._prefix):]
        entry = self._waiting.pop(token, None)
        if entry is None or entry[0].done():
            return False
        fut, _, label = entry
        self._waiting[token] = (fut, asyncio.get_running_loop().time() + self.timeout_s, label)
        return True

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if entry is None or entry[0].done():
            return
        fut, _, label = entry
        if is_no_responders(msg):
            fut.set_exception(self._on_no_responders(label))
        else:
            self._resolve(fut, msg)
