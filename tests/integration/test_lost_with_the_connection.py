"""Replies lost with the connection: a NATS server dies (SIGKILL) between a request and its reply and comes back on
the same port; the client, reconnected, sends the request again at once instead of waiting out its timeout. Both a
stream publish (``StreamPublisher``) and an ack's confirmation (``bus.ack_sync``) are sent again. The server and the
reconnect are real; the stream and the consumer are fake responders (named so) that drop the first copy, as a dying
node does, and answer the next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.msg import Msg

from rollout_ledger.cli.stack.servers import PrivateNats
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from tests.helpers import until

GUARD_S = 120.0
"""How long a test waits for the request to be answered; every timeout of the request itself is far longer, so
only the reconnect can have sent it again in time."""


Listen = Callable[[str, bytes], Awaitable[list[bytes]]]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrivateNats]:
    nats = PrivateNats(tmp_path / "nats")
    nats.start()
    yield nats
    nats.stop()


@pytest_asyncio.fixture
async def responder(server: PrivateNats) -> AsyncIterator[Listen]:
    """``listen(subject, answer)``: a fake responder on its own connection that drops the first request to
    ``subject`` and answers the next ones with ``answer``; the requests it got, once the first came."""
    nc = await bus.connect(server.url, name="fake-responder", initial_wait_s=10)
    got: list[bytes] = []

    async def listen(subject: str, answer: bytes) -> list[bytes]:
        async def respond(msg: Msg) -> None:
            got.append(msg.data)
            if len(got) > 1:  # the first copy died with the server
                await msg.respond(answer)

        await nc.subscribe(subject, cb=respond)
        await nc.flush()
        return got

    yield listen
    await nc.close()


@pytest_asyncio.fixture
async def client(server: PrivateNats) -> AsyncIterator[bus.NATS]:
    nc = await bus.connect(server.url, name="client", initial_wait_s=10)
    yield nc
    await nc.close()


async def test_a_publish_whose_ack_was_lost_is_published_again_at_once(
        server: PrivateNats, client: bus.NATS, responder: Listen) -> None:
    got = await responder("lossy.subject", b'{"stream": "FAKE", "seq": 1}')
    pub = StreamPublisher(client, ack_timeout_s=10 * GUARD_S, retry_for_s=bus.RETRY_FOR_S)
    stored = await pub.publish_nowait("lossy", "e1", b"x", subject="lossy.subject")
    await until(lambda: len(got) == 1, what="the first copy reached the fake stream")
    server.kill()
    server.start()
    await asyncio.wait_for(stored, timeout=GUARD_S)
    assert len(got) >= 2 and set(got) == {b"x"}, "the same bytes again (the same Nats-Msg-Id: stored once)"
    assert pub.retries >= 1 and pub.pending == 0
    await pub.stop()


async def test_an_ack_whose_confirmation_was_lost_is_sent_again_at_once(
        server: PrivateNats, client: bus.NATS, responder: Listen) -> None:
    got = await responder("$JS.ACK.FAKE.fake.1.1.1.0.0", b"")
    msg = Msg(_client=client, subject="work", reply="$JS.ACK.FAKE.fake.1.1.1.0.0", data=b"item")
    acked = asyncio.ensure_future(bus.ack_sync(msg, timeout=10 * GUARD_S))
    await until(lambda: len(got) == 1, what="the first ack reached the fake consumer")
    server.kill()
    server.start()
    await asyncio.wait_for(acked, timeout=GUARD_S)
    assert len(got) >= 2
