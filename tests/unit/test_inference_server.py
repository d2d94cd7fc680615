"""The inference worker's server against real NATS (the fake engine): a request sent again with the same id (a
requester's recovery after a NATS restart) joins the one the worker took, in flight or answered, and is never
generated twice; one whose first copy ended in an error reply is a request of its own again; heartbeats say so. A
request that asks for progress hears from the worker while it is generated, one that does not hears only its reply."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from nats.aio.msg import Msg

from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.services.inference_worker.metrics import InferenceMetrics
from rollout_ledger.services.inference_worker.server import (
    InferenceServer,
    TakenRequests,
    WorkerIdentity,
    progress_bodies,
)
from rollout_ledger.shared.events import InferenceRequested, SamplingParams, TurnGenerated, decode_as, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    ERROR_HEADER,
    INFER_CANCEL,
    PROGRESS_EVERY_HEADER,
    PROGRESS_MIN_S,
    PROGRESS_TO_HEADER,
    infer_progress_subject,
    infer_worker_subject,
    progress_asked,
)
from tests.helpers import until

DELAY_S = 3.0
"""Each generation of the fake engine: the copy below arrives while the first is generated."""


def request(rid: str, max_tokens: int = 8) -> InferenceRequested:
    return InferenceRequested(event_id=rid, episode_id="b.0.0", batch_id="b", attempt=1, seq=1, produced_by="test",
                              request_id=rid, turn_index=0, prompt_token_ids=np.arange(10, dtype=np.int32),
                              sampling=SamplingParams(), max_tokens=max_tokens, reply_seq=1)


@pytest.fixture
async def served(nc: bus.NATS, model_dir: str) -> Any:
    engine = FakeEngine(model_dir, delay_s=DELAY_S)
    metrics = InferenceMetrics.create()
    srv = InferenceServer(nc, engine, WorkerIdentity("w-resend", 0, 8, 60.0), metrics)
    await srv.start()
    yield srv, metrics
    await srv.drain(5)


@pytest.fixture
async def replies(nc: bus.NATS) -> Any:
    """``(inbox, got)``: a reply subject and the replies that came to it, in order."""
    got: list[Msg] = []

    async def take(m: Msg) -> None:
        got.append(m)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=take)
    yield inbox, got
    await sub.unsubscribe()


def count(metrics: InferenceMetrics, outcome: str) -> float:
    return float(metrics.outcome[outcome]._value.get())


async def test_a_copy_of_a_request_in_flight_or_answered_is_not_generated_again(nc: bus.NATS, served: Any,
                                                                                 replies: Any) -> None:
    srv, metrics = served
    inbox, got = replies
    assert srv.heartbeat_payload()["takes_resent"] is True
    subject = infer_worker_subject("w-resend")
    data = encode(request("b.0.0:a1:t0:r1"))
    await nc.publish(subject, data, reply=inbox)
    await until(lambda: srv.inflight == 1, 5.0)
    await nc.publish(subject, data, reply=inbox)  # the recovery's copy, while the first is generated
    await until(lambda: count(metrics, "resent") == 1, 5.0)
    assert count(metrics, "ok") == 0 and srv.inflight == 1  # joined to the generation in flight
    await until(lambda: count(metrics, "ok") == 1, 2 * DELAY_S + 5.0)
    await nc.flush()
    await until(lambda: len(got) == 1, 5.0)
    assert decode_as(got[0].data, TurnGenerated).request_id == "b.0.0:a1:t0:r1"
    # answered already: a later copy is joined too (its turn is on RL_EVENTS), nothing generated or replied
    await nc.publish(subject, data, reply=inbox)
    await until(lambda: count(metrics, "resent") == 2, 5.0)
    await asyncio.sleep(0)
    assert count(metrics, "ok") == 1 and srv.inflight == 0


async def test_a_request_answered_with_an_error_is_taken_again(nc: bus.NATS, served: Any, replies: Any) -> None:
    srv, metrics = served
    inbox, got = replies
    subject = infer_worker_subject("w-resend")
    data = encode(request("b.0.0:a1:t1:r1"))
    await nc.publish(subject, data, reply=inbox)
    await until(lambda: srv.inflight == 1 and "b.0.0:a1:t1:r1" in srv._active, 5.0)
    await nc.publish(INFER_CANCEL, b"b.0.0:a1:t1:r1")  # aborted: answered with a (retryable) error
    await until(lambda: len(got) == 1, 5.0)
    assert (got[0].headers or {}).get(ERROR_HEADER) == "InferenceError"
    await nc.publish(subject, data, reply=inbox)  # the same id again: generated this time
    await until(lambda: len(got) == 2, 2 * DELAY_S + 5.0)
    assert decode_as(got[1].data, TurnGenerated).request_id == "b.0.0:a1:t1:r1"
    assert count(metrics, "resent") == 0 and count(metrics, "aborted") == 1 and count(metrics, "ok") == 1


async def test_a_copy_at_capacity_is_joined_not_refused(nc: bus.NATS, model_dir: str, replies: Any) -> None:
    """A worker at capacity refuses new requests as overloaded (the requester tries another worker), but a copy of
    one of its own generations is joined: an error reply would fail the try and the turn would be generated twice."""
    metrics = InferenceMetrics.create()
    srv = InferenceServer(nc, FakeEngine(model_dir, delay_s=DELAY_S), WorkerIdentity("w-full", 0, 1, 60.0), metrics)
    await srv.start()
    inbox, got = replies
    try:
        subject = infer_worker_subject("w-full")
        await nc.publish(subject, encode(request("b.0.0:a1:t2:r1")), reply=inbox)
        await until(lambda: srv.inflight == 1, 5.0)
        await nc.publish(subject, encode(request("b.0.0:a1:t2:r1")), reply=inbox)  # a copy: joined
        await nc.publish(subject, encode(request("b.0.1:a1:t0:r1")), reply=inbox)  # another request: refused
        await until(lambda: len(got) == 1, 5.0)
        assert (got[0].headers or {}).get(ERROR_HEADER) == "Overloaded"
        assert count(metrics, "resent") == 1 and count(metrics, "overloaded") == 1 and count(metrics, "ok") == 0
        await until(lambda: len(got) == 2, 2 * DELAY_S + 5.0)
        assert decode_as(got[1].data, TurnGenerated).request_id == "b.0.0:a1:t2:r1"
    finally:
        await srv.drain(5)


def test_taken_ids_are_forgotten_after_the_memory() -> None:
    taken = TakenRequests(memory_s=900.0)
    assert taken.take("a", "inbox.1", now=1000.0) and not taken.take("a", "inbox.1", now=1000.0)
    assert taken.take("b", "inbox.2", now=1900.0)
    assert not taken.take("a", "inbox.1", now=1900.0)  # exactly as old as the memory: still a copy
    assert taken.take("a", "inbox.1", now=1900.001) and not taken.take("b", "inbox.2", now=1900.001)
    assert len(taken) == 2
    taken.forget("b")
    assert taken.take("b", "inbox.2", now=1900.002)


def test_at_most_max_taken_ids_are_remembered_the_oldest_go_first() -> None:
    taken = TakenRequests(memory_s=900.0, max_taken=3)
    for i, rid in enumerate("abcd"):
        assert taken.take(rid, "inbox", now=float(i))
    assert len(taken) == 3 and "a" not in taken and all(r in taken for r in "bcd")
    assert taken.take("a", "inbox", now=5.0)  # forgotten: served again (its turn is stored once by the stream)


def test_the_same_id_to_another_reply_subject_is_not_a_copy() -> None:
    """Another requester (or a retry of its own with a new inbox) asking with an id taken here is served: only the
    recovery's copy carries the reply subject of the request taken."""
    taken = TakenRequests()
    assert taken.take("a", "inbox.1", now=0.0)
    assert taken.is_copy("a", "inbox.1") and not taken.is_copy("a", "inbox.2")
    assert taken.take("a", "inbox.2", now=1.0) and taken.is_copy("a", "inbox.2")


async def test_a_request_asking_for_progress_is_named_on_its_progress_subject_until_its_reply(
        nc: bus.NATS, served: Any, replies: Any) -> None:
    """Every ``Rollout-Progress-Every`` seconds while the worker holds the request, a message on the requester's
    progress subject names its reply subject; the reply subject gets only the reply, and once it came the request
    is due no progress again."""
    srv, metrics = served
    inbox, got = replies
    progress: list[tuple[float, bytes]] = []

    async def take(m: Msg) -> None:
        progress.append((asyncio.get_running_loop().time(), m.data))

    to = infer_progress_subject("req1")
    sub = await nc.subscribe(to, cb=take)
    try:
        sent = asyncio.get_running_loop().time()
        await nc.publish(infer_worker_subject("w-resend"), encode(request("b.0.0:a1:t3:r1")), reply=inbox,
                         headers={PROGRESS_TO_HEADER: to, PROGRESS_EVERY_HEADER: "0.5"})
        await until(lambda: count(metrics, "ok") == 1, 2 * DELAY_S + 5.0)
        await nc.flush()
        await until(lambda: len(got) == 1, 5.0, "the reply")
        replied = asyncio.get_running_loop().time()
    finally:
        await sub.unsubscribe()
    assert decode_as(got[0].data, TurnGenerated).request_id == "b.0.0:a1:t3:r1"
    assert progress and {data for _, data in progress} == {inbox.encode()}
    # held DELAY_S (3 s), named every 0.5 s on a 0.25 s tick: never silent for long while it was held
    marks = [sent] + [at for at, _ in progress] + [replied]
    assert len(progress) >= 2 and max(b - a for a, b in pairwise(marks)) < DELAY_S
    assert await srv.say_progress(float("inf")) == 0  # answered: nothing is due for it any more


async def test_a_request_without_progress_hears_only_its_reply(nc: bus.NATS, served: Any, replies: Any) -> None:
    """An older requester asks for no progress: none is sent for its request."""
    srv, metrics = served
    inbox, got = replies
    await nc.publish(infer_worker_subject("w-resend"), encode(request("b.0.0:a1:t4:r1")), reply=inbox)
    await until(lambda: srv.inflight == 1, 5.0)
    assert await srv.say_progress(float("inf")) == 0  # held, but nobody asked to hear of it
    await until(lambda: count(metrics, "ok") == 1, 2 * DELAY_S + 5.0)
    await nc.flush()
    await until(lambda: len(got) == 1, 5.0)
    assert decode_as(got[0].data, TurnGenerated).request_id == "b.0.0:a1:t4:r1"


def test_progress_is_asked_with_a_subject_of_its_own_and_an_interval() -> None:
    to = infer_progress_subject("req1")
    assert progress_asked(None) is None and progress_asked({}) is None
    assert progress_asked({PROGRESS_TO_HEADER: to, PROGRESS_EVERY_HEADER: "30"}) == (to, 30.0)
    # raised to the loop's tick
    assert progress_asked({PROGRESS_TO_HEADER: to, PROGRESS_EVERY_HEADER: "0.001"}) == (to, PROGRESS_MIN_S)
    assert progress_asked({PROGRESS_EVERY_HEADER: "30"}) is None  # nowhere to say it
    for bad in ("", "soon", "0", "-1", "nan", "inf"):
        assert progress_asked({PROGRESS_TO_HEADER: to, PROGRESS_EVERY_HEADER: bad}) is None, bad
    # a worker never publishes progress outside the progress subjects, whatever a request names
    for elsewhere in ("rl.events.turn.generated", "rl.infer.progress", "rl.infer.progress.", "rl.infer.progress.>",
                      "rl.infer.progress.a.b", "rl.infer.progress.*", "_INBOX.x"):
        assert progress_asked({PROGRESS_TO_HEADER: elsewhere, PROGRESS_EVERY_HEADER: "1"}) is None, elsewhere


def test_progress_for_many_requests_comes_in_bodies_of_bounded_size() -> None:
    replies = [f"_INBOX.env-worker.abcdef.{i}" for i in range(5000)]
    bodies = progress_bodies(replies, max_bytes=4096)
    assert len(bodies) > 1 and all(len(b) <= 4096 for b in bodies)
    assert [line.decode() for b in bodies for line in b.split(b"\n")] == replies  # every one, once, in order
    assert progress_bodies([]) == [] and progress_bodies(["x" * 10], max_bytes=4) == [b"x" * 10]
