"""Fakes of the product's ports for unit tests, named as fakes: never the only test of what they stand in for."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import EventBase, encode
from rollout_ledger.shared.subjects import event_subject, subject_of


@dataclass(frozen=True)
class Sent:
    """One message a ``FakeProducer`` took."""

    event_type: str
    event_id: str
    data: bytes
    subject: str
    headers: Mapping[str, str] | None


@dataclass
class FakeProducer:
    """A ``Producer`` (rollout_ledger/shared/kit/publisher.py) with no NATS: records what is published and acks it at
    once, or fails the ids in ``refuse`` (the stream's refusal), leaves those in ``silent`` unacked (a lost ack), and
    raises ``BusError`` at the hand-off once ``closed`` (a closed connection)."""

    sent: list[Sent] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    closed: bool = False

    async def publish_nowait(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                             headers: Mapping[str, str] | None = None) -> asyncio.Future[None]:
        if self.closed:
            raise BusError(f"publish of {event_type} failed: ConnectionClosedError", retryable=False)
        self.sent.append(Sent(event_type, event_id, data, subject or event_subject(event_type), headers))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if event_id in self.refuse:
            fut.set_exception(BusError(f"stream refused the event {event_id}"))
        elif event_id not in self.silent:
            fut.set_result(None)
        return fut

    async def publish(self, event_type: str, event_id: str, data: bytes, subject: str | None = None,
                      headers: Mapping[str, str] | None = None) -> None:
        await (await self.publish_nowait(event_type, event_id, data, subject, headers))

    async def publish_event(self, event: EventBase, route: str | None = None) -> None:
        event_type = str(event.type)
        await self.publish(event_type, str(event.event_id), encode(event), subject_of(event_type, route))
