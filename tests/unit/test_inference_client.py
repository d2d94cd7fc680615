"""The inference client against real NATS: heartbeat registry, sticky routing, failover and the retry budget.

The inference workers here are tiny in-test responders speaking the fixed protocol (request/reply on the
worker's subject or ``INFER_ANY``, error replies with ``Rollout-Error`` headers, heartbeats).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from structlog.testing import capture_logs

from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.inference_workers import choose
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import (
    FinishReason,
    InferenceRequested,
    SamplingParams,
    TurnGenerated,
    decode_as,
    dumps,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    INFER_ANY,
    INFER_CANCEL,
    INFER_HEARTBEAT,
    INFER_QUEUE,
    event_subject,
    infer_pool_subject,
    infer_worker_subject,
)
from tests.helpers import until

BEAT_S = 0.1
"""The in-test workers' heartbeat interval (the client fixture's timeout is 0.5 s: five beats)."""


class Responder:
    """An in-test inference worker: ``mode`` is reply, silent, retryable, fatal, lost_reply (the turn is stored on
    RL_EVENTS, as a worker does before replying, and the reply never arrives: a NATS restart in between),
    lost_request (the first copy never arrives) or lost_error (the first copy is taken, the second joined to it, and
    its error reply never arrives)."""

    def __init__(self, nc: bus.NATS, worker_id: str, mode: str = "reply", capacity: int = 8,
                 join_any: bool = False, pool: str | None = None, takes_resent: bool = False) -> None:
        self.nc, self.worker_id, self.mode, self.capacity, self.join_any = nc, worker_id, mode, capacity, join_any
        self.takes_resent = takes_resent
        """Says so in its heartbeats (as inference workers of this release do)."""
        self.pool = pool
        """A model pool's worker: it takes that pool's queue group only, and sends no heartbeat."""
        self.requests: list[InferenceRequested] = []
        self.draining = False
        self.inflight = 0
        self._subs: list[Subscription] = []
        self._beat: asyncio.Task[None] | None = None

    async def start(self, heartbeat: bool = True) -> Responder:
        if self.pool is not None:
            self._subs.append(await self.nc.subscribe(infer_pool_subject(self.pool), queue=f"pool-{self.pool}",
                                                      cb=self._on_request))
            await self.nc.flush()
            return self
        self._subs.append(await self.nc.subscribe(infer_worker_subject(self.worker_id), cb=self._on_request))
        if self.join_any:
            self._subs.append(await self.nc.subscribe(INFER_ANY, queue=INFER_QUEUE, cb=self._on_request))
        if heartbeat:
            await self.beat()
            self._beat = asyncio.create_task(self._beat_forever())
        await self.nc.flush()
        return self

    async def beat(self) -> None:
        await self.nc.publish(INFER_HEARTBEAT, dumps({
            "worker_id": self.worker_id, "subject": infer_worker_subject(self.worker_id), "inflight": self.inflight,
            "capacity": self.capacity, "weight_version": 0, "engine": "test", "draining": self.draining,
            "time": time.time(), "every_s": BEAT_S, **({"takes_resent": True} if self.takes_resent else {})}))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            await self.beat()

    def stop_heartbeats(self) -> None:
        if self._beat is not None:
            self._beat.cancel()

    async def stop(self) -> None:
        self.stop_heartbeats()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_request(self, msg: Msg) -> None:
        req = decode_as(msg.data, InferenceRequested)
        self.requests.append(req)
        if self.mode == "silent":
            return
        if self.mode == "lost_request":  # died with the server: never seen; a copy sent again is served
            self.mode = "reply"
            return
        if self.mode == "lost_error":  # taken; a copy is joined, then its error reply is refused (and forgotten)
            if len(self.requests) == 2:
                self.mode = "reply"  # the id forgotten: the next copy is a request of its own
            return
        await self.serve(req, msg.reply)

    async def serve(self, req: InferenceRequested, reply: str = "") -> None:
        """Answer ``req`` as ``mode`` says (a reply to ``reply``, or the turn stored and no reply)."""
        if self.mode in ("retryable", "fatal"):
            retryable = "true" if self.mode == "retryable" else "false"
            headers = {"Rollout-Error": "EngineError", "Rollout-Retryable": retryable}
            await self.nc.publish(reply, b"engine said no", headers=headers)
            return
        turn = TurnGenerated(
            event_id=req.request_id, episode_id=req.episode_id, batch_id=req.batch_id, attempt=req.attempt,
            seq=req.reply_seq, produced_by=f"test/{self.worker_id}", request_id=req.request_id,
            turn_index=req.turn_index, prompt_len=len(req.prompt_token_ids), token_ids=np.asarray([5, 6, 2]),
            logprobs=np.zeros(3, dtype=np.float32), finish_reason=FinishReason.STOP, weight_version=0,
            engine="test", worker_id=self.worker_id, queue_ms=0.0, generate_ms=0.0)
        if self.mode == "lost_reply":
            await self.nc.jetstream().publish(event_subject("turn.generated"), encode(turn),
                                              headers={"Nats-Msg-Id": turn.event_id})
            return
        await self.nc.publish(reply, encode(turn))


def request_builder(turn: int = 0) -> Any:
    def build(try_no: int) -> InferenceRequested:
        rid = f"b.0.0:a1:t{turn}:r{try_no}"
        return InferenceRequested(event_id=rid, episode_id="b.0.0", batch_id="b", attempt=1, seq=2 * turn + 1,
                                  produced_by="test", request_id=rid, turn_index=turn,
                                  prompt_token_ids=np.arange(10, dtype=np.int32), sampling=SamplingParams(),
                                  max_tokens=8, reply_seq=2 * turn + 1)
    return build


@pytest.fixture
async def client(nc: bus.NATS) -> Any:
    retries: list[int] = []
    c = InferenceClient(nc, InferenceClientConfig(request_timeout_s=5.0, max_tries=3, backoff_initial_s=0.01,
                                                  backoff_max_s=0.05, heartbeat_timeout_s=0.5),
                        on_retry=lambda: retries.append(1))
    c.retries = retries
    await c.start()
    yield c
    await c.stop()


async def test_no_worker_known_goes_to_infer_any(nc: bus.NATS, client: InferenceClient) -> None:
    anon = await Responder(nc, "anon", join_any=True).start(heartbeat=False)
    turn = await client.generate(request_builder())
    assert turn.worker_id == "anon" and turn.request_id == "b.0.0:a1:t0:r1"
    assert client.workers == {}
    await anon.stop()


async def test_sticky_then_least_loaded_and_draining(nc: bus.NATS, client: InferenceClient) -> None:
    w1 = await Responder(nc, "w1").start()
    w2 = await Responder(nc, "w2").start()
    await until(lambda: set(client.workers) == {"w1", "w2"}, 5.0)
    for _ in range(3):
        assert (await client.generate(request_builder(), prefer="w2")).worker_id == "w2"
    assert len(w2.requests) == 3 and not w1.requests
    # least loaded without a preference
    client.workers["w2"].local_inflight = 5
    assert choose(client.workers) is client.workers["w1"]
    # a full sticky worker is left for the least loaded one
    client.workers["w2"].local_inflight = 8
    assert choose(client.workers, prefer="w2") is client.workers["w1"]
    client.workers["w2"].local_inflight = 0
    # a draining worker gets no new requests, even when it is the sticky one
    w2.draining = True
    await until(lambda: client.workers["w2"].draining, 5.0)
    assert (await client.generate(request_builder(), prefer="w2")).worker_id == "w1"
    await w1.stop()
    await w2.stop()


async def test_failover_when_heartbeats_stop(nc: bus.NATS, client: InferenceClient) -> None:
    hung = await Responder(nc, "hung", mode="silent").start()
    good = await Responder(nc, "good").start()
    await until(lambda: set(client.workers) == {"hung", "good"}, 5.0)
    started = time.monotonic()
    task = asyncio.create_task(client.generate(request_builder(), prefer="hung"))
    await until(lambda: len(hung.requests) == 1, 5.0)
    hung.stop_heartbeats()
    turn = await task
    elapsed = time.monotonic() - started
    assert turn.worker_id == "good" and turn.request_id == "b.0.0:a1:t0:r2"
    assert elapsed < 2.0, "failover must not wait for the request timeout (5 s here)"
    assert "hung" not in client.workers
    assert client.retries == [1]
    await hung.stop()
    await good.stop()


async def test_a_stalled_loop_reaps_no_live_worker(nc: bus.NATS, client: InferenceClient) -> None:
    """This client's own loop blocked for twice the heartbeat timeout: the beats of that time are unread when the
    reaper wakes, late. It excuses the workers instead of failing over a live one's turns."""
    live = await Responder(nc, "live").start()
    await until(lambda: "live" in client.workers, 5.0)
    with capture_logs() as logs:
        time.sleep(1.0)  # noqa: ASYNC251 -- blocking this event loop (the client's, and the responder's) is the point
        await asyncio.sleep(0.3)
    assert "live" in client.workers
    assert [e["event"] for e in logs if e["event"].startswith("inference.")] == ["inference.loop_stalled"]
    live.stop_heartbeats()  # a real silence afterwards is still noticed
    await until(lambda: "live" not in client.workers, timeout_s=2.0)
    await live.stop()


async def test_a_heartbeat_timeout_close_to_the_interval_is_warned_once(nc: bus.NATS,
                                                                          client: InferenceClient) -> None:
    with capture_logs() as logs:
        steady = await Responder(nc, "steady").start()
        await until(lambda: "steady" in client.workers, 5.0)
        await steady.beat()
        await nc.publish(INFER_HEARTBEAT, dumps({"worker_id": "slow", "subject": infer_worker_subject("slow"),
                                                 "every_s": 0.4}))
        await until(lambda: "slow" in client.workers, 5.0)
        await nc.publish(INFER_HEARTBEAT, dumps({"worker_id": "slow", "subject": infer_worker_subject("slow"),
                                                 "every_s": 0.4}))
        await nc.flush()
        await asyncio.sleep(0.05)
    warned = [e for e in logs if e["event"] == "inference.heartbeat_timeout_short"]
    assert [(e["worker"], e["heartbeat_s"], e["heartbeat_timeout_s"]) for e in warned] == [("slow", 0.4, 0.5)]
    await steady.stop()


async def test_failover_on_no_responders_and_retryable_errors(nc: bus.NATS, client: InferenceClient) -> None:
    ghost = Responder(nc, "ghost")  # heartbeats but nobody listens on its subject
    await ghost.beat()
    flaky = await Responder(nc, "flaky", mode="retryable").start()
    await until(lambda: {"ghost", "flaky"} <= set(client.workers), 5.0)
    good = await Responder(nc, "good").start()
    await until(lambda: "good" in client.workers, 5.0)
    client.workers["good"].local_inflight = 100  # least preferred: tried last
    client.workers["flaky"].local_inflight = 1
    turn = await client.generate(request_builder(), prefer="ghost")
    client.workers["good"].local_inflight -= 100
    assert turn.worker_id == "good" and turn.request_id.endswith(":r3")
    assert [r.request_id for r in flaky.requests] == ["b.0.0:a1:t0:r2"]
    await flaky.stop()
    await good.stop()


async def test_non_retryable_error_fails_at_once(nc: bus.NATS, client: InferenceClient) -> None:
    bad = await Responder(nc, "bad", mode="fatal").start()
    await Responder(nc, "good").start()
    await until(lambda: {"bad", "good"} <= set(client.workers), 5.0)
    with pytest.raises(InferenceError) as info:
        await client.generate(request_builder(), prefer="bad")
    assert info.value.retryable is False and "EngineError" in str(info.value)
    assert len(bad.requests) == 1
    await bad.stop()


async def test_budget_exhausted_without_workers(nc: bus.NATS, client: InferenceClient) -> None:
    with pytest.raises(InferenceError) as info:
        await client.generate(request_builder(turn=2))
    assert info.value.retryable is True and "3 tries" in str(info.value)
    assert client.retries == [1, 1]


async def test_request_timeout_counts_as_a_try(nc: bus.NATS) -> None:
    c = InferenceClient(nc, InferenceClientConfig(request_timeout_s=0.3, max_tries=2, backoff_initial_s=0.0,
                                                  heartbeat_timeout_s=30.0))
    await c.start()
    slow = await Responder(nc, "slow", mode="silent").start()
    await until(lambda: "slow" in c.workers, 5.0)
    started = time.monotonic()
    with pytest.raises(InferenceError):
        await c.generate(request_builder())
    assert 0.3 <= time.monotonic() - started < 3.0  # one timeout, then no responders on INFER_ANY
    assert [r.request_id for r in slow.requests] == ["b.0.0:a1:t0:r1"]  # try 2 went to INFER_ANY (excluded)
    await slow.stop()
    await c.stop()


async def _cancels(nc: bus.NATS) -> tuple[list[str], Subscription]:
    """The request ids cancelled on ``INFER_CANCEL`` (what an inference worker listens to), as they come."""
    cancels: list[str] = []

    async def on_cancel(msg: Msg) -> None:
        cancels.append(msg.data.decode())

    sub = await nc.subscribe(INFER_CANCEL, cb=on_cancel)
    await nc.flush()
    return cancels, sub


async def test_a_try_that_timed_out_is_cancelled_on_its_worker(nc: bus.NATS) -> None:
    """The worker of a try that timed out may still be generating it: the client cancels that try (its own request
    id) before the next one, so the engine does not go on with a turn nobody waits for. A try that had no
    responders is cancelled too (nobody runs it: nothing happens)."""
    cancels, sub = await _cancels(nc)
    c = InferenceClient(nc, InferenceClientConfig(request_timeout_s=0.3, max_tries=2, backoff_initial_s=0.0,
                                                  heartbeat_timeout_s=30.0))
    await c.start()
    slow = await Responder(nc, "slow", mode="silent").start()
    await until(lambda: "slow" in c.workers, 5.0)
    with pytest.raises(InferenceError):
        await c.generate(request_builder())
    assert [r.request_id for r in slow.requests] == ["b.0.0:a1:t0:r1"]
    await until(lambda: cancels == ["b.0.0:a1:t0:r1", "b.0.0:a1:t0:r2"], 5.0, "each failed try cancelled, in order")
    await sub.unsubscribe()
    await slow.stop()
    await c.stop()


async def test_a_model_pool_is_asked_on_its_queue_group_within_the_same_budget(nc: bus.NATS,
                                                                              client: InferenceClient) -> None:
    """An env's own LLM (``pool``): its requests go to the pool's queue group, never to a policy worker, and are
    tried again and cancelled like a turn; the error names the pool."""
    policy = await Responder(nc, "policy-0").start()
    await until(lambda: "policy-0" in client.workers, 5.0)
    users = await Responder(nc, "users-0", pool="users").start()
    turn = await client.generate(request_builder(), pool="users")
    assert turn.worker_id == "users-0" and policy.requests == []
    cancels, sub = await _cancels(nc)
    users.mode = "retryable"
    with pytest.raises(InferenceError, match="of model pool 'users' after 3 tries"):
        await client.generate(request_builder(turn=1), pool="users")
    assert [r.request_id for r in users.requests[1:]] == ["b.0.0:a1:t1:r1", "b.0.0:a1:t1:r2", "b.0.0:a1:t1:r3"]
    await until(lambda: len(cancels) == 3, 5.0, "the three failed tries cancelled")
    assert policy.requests == []
    await sub.unsubscribe()
    await users.stop()
    await policy.stop()


async def test_a_reply_lost_in_a_nats_restart_is_read_back_from_the_stream(nc: bus.NATS,
                                                                            client: InferenceClient) -> None:
    """After a NATS restart the tries still waiting are answered from their stored turn, not tried again (a second
    try would generate the turn twice)."""
    worker = await Responder(nc, "w-lost", mode="lost_reply").start()
    await until(lambda: "w-lost" in client.workers, 5.0)
    since = time.time()
    pending = asyncio.create_task(client.generate(request_builder(turn=7)))
    await until(lambda: len(worker.requests) == 1, 5.0)
    assert await client.recovery.recover(since, grace_s=0.0) == 1
    turn = await asyncio.wait_for(pending, 5)
    assert turn.request_id == "b.0.0:a1:t7:r1" and turn.worker_id == "w-lost"
    assert client.retries == [] and len(worker.requests) == 1  # nothing generated twice
    await worker.stop()


async def test_a_turn_stored_after_the_restart_is_read_back_too(nc: bus.NATS, client: InferenceClient) -> None:
    """A generation that ends after the restart: its reply is refused (the restarted server does not know the
    request any more), its turn is stored; the recovery, already reading, answers the try with it."""
    worker = await Responder(nc, "w-late", mode="silent").start()
    await until(lambda: "w-late" in client.workers, 5.0)
    since = time.time()
    pending = asyncio.create_task(client.generate(request_builder(turn=8)))
    await until(lambda: len(worker.requests) == 1, 5.0)
    recovery = asyncio.create_task(client.recovery.recover(since, grace_s=0.0))
    await asyncio.sleep(0.5)  # the recovery reads the stream: nothing for this try yet
    worker.mode = "lost_reply"
    await worker.serve(worker.requests[0])
    assert await asyncio.wait_for(recovery, 5) == 1
    turn = await asyncio.wait_for(pending, 5)
    assert turn.request_id == "b.0.0:a1:t8:r1" and client.retries == []
    await worker.stop()


async def _recovered(nc: bus.NATS, client: InferenceClient, worker_id: str, mode: str,
                     turn_index: int) -> tuple[Responder, TurnGenerated, list[dict[str, Any]], float]:
    """A try to a ``mode`` worker that takes copies, then a recovery (nothing on RL_EVENTS for it): the worker, the
    try's turn, the recovery's logs and when the try began (monotonic)."""
    worker = await Responder(nc, worker_id, mode=mode, takes_resent=True).start()
    await until(lambda: worker_id in client.workers and client.workers[worker_id].takes_resent, 5.0)
    since = time.time()
    began = time.monotonic()
    pending = asyncio.create_task(client.generate(request_builder(turn=turn_index)))
    await until(lambda: len(worker.requests) == 1, 5.0)
    with capture_logs() as logs:
        assert await client.recovery.recover(since, grace_s=0.0) == 0  # nothing on RL_EVENTS for it
    return worker, await asyncio.wait_for(pending, 5), logs, began


async def test_a_request_lost_in_a_nats_restart_is_sent_again_not_left_to_time_out(nc: bus.NATS,
                                                                                   client: InferenceClient) -> None:
    """A request that died with the server: no turn is stored for it, so the recovery sends the same request (id and
    reply subject) again to its worker, which joins copies of what it took; the try is answered by the copy, with no
    new try and long before its 5 s timeout."""
    worker, turn, logs, began = await _recovered(nc, client, "w-drop", "lost_request", turn_index=9)
    assert turn.request_id == "b.0.0:a1:t9:r1" and client.retries == []
    assert [r.request_id for r in worker.requests] == ["b.0.0:a1:t9:r1"] * 2  # the same request, once more
    assert time.monotonic() - began < 5.0
    assert [e["resent"] for e in logs if e["event"] == "inference.resent_requests"] == [1]
    await worker.stop()


async def test_a_try_still_waiting_after_its_copy_is_sent_again(nc: bus.NATS, client: InferenceClient) -> None:
    """The copy was joined to a generation that then failed, its error reply lost too (the worker's node refused
    it): the recovery sends the try again while it waits, and the worker, which forgot the id it answered with an
    error, generates it. The try is answered long before its 5 s timeout, with no new try."""
    worker, turn, logs, began = await _recovered(nc, client, "w-err", "lost_error", turn_index=11)
    assert turn.request_id == "b.0.0:a1:t11:r1" and client.retries == []
    assert [r.request_id for r in worker.requests] == ["b.0.0:a1:t11:r1"] * 3  # the request, its copy, once more
    assert time.monotonic() - began < 5.0
    assert [e["resent"] for e in logs if e["event"] == "inference.resent_requests"] == [1, 1]
    await worker.stop()


async def test_a_worker_of_an_earlier_release_gets_no_copy(nc: bus.NATS, client: InferenceClient) -> None:
    """A worker whose heartbeats do not say ``takes_resent`` would generate a copy again: the try waits for its turn
    on RL_EVENTS (or its timeout) as before, and nothing is sent twice."""
    worker = await Responder(nc, "w-old", mode="lost_reply").start()
    await until(lambda: "w-old" in client.workers, 5.0)
    assert client.workers["w-old"].takes_resent is False
    since = time.time()
    pending = asyncio.create_task(client.generate(request_builder(turn=10)))
    await until(lambda: len(worker.requests) == 1, 5.0)
    assert await client.requests.resend(list(client.requests.by_request)) == 0
    assert await client.recovery.recover(since, grace_s=0.0) == 1
    assert (await asyncio.wait_for(pending, 5)).request_id == "b.0.0:a1:t10:r1"
    assert len(worker.requests) == 1
    await worker.stop()
