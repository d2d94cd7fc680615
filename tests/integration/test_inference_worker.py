"""The inference worker against real NATS: request/reply, the stored event, routing, heartbeats, load, drain."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from nats.aio.msg import Msg

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.services.inference_worker.main import run
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import (
    FinishReason,
    InferenceRequested,
    SamplingParams,
    TurnGenerated,
    decode_as,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from rollout_ledger.shared.kit.runtime import Health, Shutdown
from rollout_ledger.shared.subjects import (
    ERROR_HEADER,
    EVENTS_STREAM,
    INFER_ANY,
    INFER_HEARTBEAT,
    RETRYABLE_HEADER,
    event_subject,
    infer_worker_subject,
)
from tests.helpers import until

HEARTBEAT_FIELDS = {"worker_id", "subject", "inflight", "capacity", "weight_version", "engine", "draining", "swapping",
                    "time", "every_s", "reconnects", "takes_resent"}


class Heartbeats:
    """Collects the heartbeats published on the bus."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def on_msg(self, msg: Msg) -> None:
        self.seen.append(orjson.loads(msg.data))

    def of(self, worker_id: str) -> list[dict[str, Any]]:
        return [hb for hb in self.seen if hb["worker_id"] == worker_id]

    async def wait(self, worker_id: str, pred: Callable[[dict[str, Any]], bool] = lambda hb: True,
                   within_s: float = 10.0) -> dict[str, Any]:
        await until(lambda: any(pred(hb) for hb in self.of(worker_id)), within_s, f"heartbeat of {worker_id}")
        return next(hb for hb in reversed(self.of(worker_id)) if pred(hb))


@pytest.fixture
async def heartbeats(nc: bus.NATS) -> AsyncIterator[Heartbeats]:
    hbs = Heartbeats()
    sub = await nc.subscribe(INFER_HEARTBEAT, cb=hbs.on_msg)
    await nc.flush()
    yield hbs
    await sub.unsubscribe()


def make_settings(nats_url: str, model_dir: str, **overrides: Any) -> InferenceSettings:
    values: dict[str, Any] = {
        "nats_url": nats_url,
        "model": model_dir,
        "worker_id": f"inf-{uuid.uuid4().hex[:6]}",
        "http_host": "127.0.0.1",
        "http_port": 0,
        "heartbeat_s": 0.1,
        "drain_timeout_s": 10.0,
    }
    values.update(overrides)
    return InferenceSettings(**values)


@contextlib.asynccontextmanager
async def worker(settings: InferenceSettings, heartbeats: Heartbeats,
                 engine: FakeEngine | None = None) -> AsyncIterator[asyncio.Task[None]]:
    """The worker running in this process as a task; serving once its first heartbeat is seen."""
    shutdown = Shutdown()
    task = asyncio.create_task(run(settings, shutdown, engine=engine))
    try:
        await heartbeats.wait(settings.worker_id)
        yield task
    finally:
        shutdown.event.set()
        await asyncio.wait_for(task, timeout=30)


def request_for(model_dir: str, question: str = "What is 12 + 7?", *, episode: str = "b1.0.0", turn: int = 0,
                try_: int = 1, max_tokens: int = 64, sampling: SamplingParams | None = None) -> InferenceRequested:
    tok = load_chat_tokenizer(model_dir)
    prompt = tok.encode(tok.render([{"role": "user", "content": question}], add_generation_prompt=True))
    request_id = f"{episode}:a1:t{turn}:r{try_}"
    return InferenceRequested(
        event_id=request_id, episode_id=episode, batch_id=episode.split(".")[0], attempt=1, seq=2 * turn + 1,
        produced_by="tests/env-worker", request_id=request_id, turn_index=turn, prompt_token_ids=prompt,
        sampling=sampling or SamplingParams(), max_tokens=max_tokens, reply_seq=2 * turn + 1,
    )


async def ask(nc: bus.NATS, subject: str, request: InferenceRequested | bytes, wait_s: float = 10.0) -> Msg:
    data = request if isinstance(request, bytes) else encode(request)
    return await nc.request(subject, data, timeout=wait_s)


def turn_of(reply: Msg) -> TurnGenerated:
    assert not (reply.headers or {}).get(ERROR_HEADER), (reply.headers, reply.data)
    return decode_as(reply.data, TurnGenerated)


async def test_request_reply_is_stored_with_msg_id(nc: bus.NATS, nats_url: str, model_dir: str,
                                                   heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, weight_version=7)
    expected_engine = FakeEngine(model_dir)
    await expected_engine.start()
    request = request_for(model_dir)
    expected = await expected_engine.generate("x", request.prompt_token_ids, request.sampling, request.max_tokens,
                                              session_key=request.episode_id)  # the worker's session key
    async with worker(settings, heartbeats):
        reply = await ask(nc, infer_worker_subject(settings.worker_id), request)
    turn = turn_of(reply)
    assert turn.event_id == turn.request_id == request.request_id
    assert (turn.episode_id, turn.batch_id, turn.attempt, turn.seq) == ("b1.0.0", "b1", 1, request.reply_seq)
    assert turn.turn_index == 0 and turn.prompt_len == len(request.prompt_token_ids)
    assert np.array_equal(turn.token_ids, expected.token_ids)
    assert np.array_equal(turn.logprobs, expected.logprobs)
    assert turn.finish_reason == FinishReason.STOP
    assert (turn.weight_version, turn.engine, turn.worker_id) == (7, "fake", settings.worker_id)
    assert turn.produced_by == f"inference-worker/{settings.worker_id}"
    assert turn.queue_ms >= 0 and turn.generate_ms >= 0
    assert turn.cached_tokens == 0

    stored = await nc.jetstream().get_last_msg(EVENTS_STREAM, event_subject("turn.generated"))
    assert stored.headers is not None and stored.headers["Nats-Msg-Id"] == request.request_id
    assert stored.data == reply.data


async def test_queue_group_spreads_over_workers(nc: bus.NATS, nats_url: str, model_dir: str,
                                                heartbeats: Heartbeats) -> None:
    a, b = make_settings(nats_url, model_dir), make_settings(nats_url, model_dir)
    async with worker(a, heartbeats), worker(b, heartbeats):
        replies = await asyncio.gather(
            *(ask(nc, INFER_ANY, request_for(model_dir, f"What is {i} + 1?", episode=f"b1.{i}.0")) for i in range(40))
        )
        turns = [turn_of(r) for r in replies]
        assert {t.worker_id for t in turns} == {a.worker_id, b.worker_id}
        # The worker's own subject reaches only that worker.
        sticky = [turn_of(await ask(nc, infer_worker_subject(b.worker_id), request_for(model_dir, episode="b2.0.0",
                                                                                        turn=t))) for t in range(5)]
        assert {t.worker_id for t in sticky} == {b.worker_id}
    assert all(t.request_id == f"b1.{i}.0:a1:t0:r1" for i, t in enumerate(turns))


async def test_heartbeats(nc: bus.NATS, nats_url: str, model_dir: str, heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, weight_version=3, max_inflight=17)
    async with worker(settings, heartbeats):
        await until(lambda: len(heartbeats.of(settings.worker_id)) >= 3, what="three heartbeats")
    beats = heartbeats.of(settings.worker_id)
    first = beats[0]
    assert set(first) == HEARTBEAT_FIELDS
    assert first["subject"] == infer_worker_subject(settings.worker_id)
    assert (first["capacity"], first["weight_version"], first["engine"]) == (17, 3, "fake")
    assert first["inflight"] == 0 and first["draining"] is False and first["swapping"] is False
    assert abs(first["time"] - time.time()) < 30
    assert first["every_s"] == settings.heartbeat_s  # so an env worker can tell a timeout too close to it
    assert first["takes_resent"] is True  # a request sent again after a NATS restart is joined, not generated again
    assert beats[-1]["draining"] is True  # announced on shutdown


async def test_many_concurrent_requests(nc: bus.NATS, nats_url: str, model_dir: str, heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, fake_delay_s=0.5)
    async with worker(settings, heartbeats):
        t0 = time.perf_counter()
        replies = await asyncio.gather(
            *(ask(nc, INFER_ANY, request_for(model_dir, episode=f"b1.{i}.0"), wait_s=30) for i in range(200))
        )
        elapsed = time.perf_counter() - t0
    assert len({turn_of(r).request_id for r in replies}) == 200
    assert elapsed < 10, elapsed  # serial would take 100 s
    info = await nc.jetstream().stream_info(EVENTS_STREAM)
    assert info.state.messages == 200


async def test_malformed_request_gets_error_reply(nc: bus.NATS, nats_url: str, model_dir: str,
                                                  heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir)
    subject = infer_worker_subject(settings.worker_id)
    async with worker(settings, heartbeats):
        for bad in (b"not json", b'{"type": "inference.requested"}', encode(request_for(model_dir))[:-5]):
            reply = await ask(nc, subject, bad)
            assert reply.headers is not None
            assert reply.headers[ERROR_HEADER] == "SchemaError"
            assert reply.headers[RETRYABLE_HEADER] == "false"
            assert reply.data
        turn_of(await ask(nc, subject, request_for(model_dir)))  # still serving


async def test_over_capacity_is_refused_at_once(nc: bus.NATS, nats_url: str, model_dir: str,
                                                heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, max_inflight=2, fake_delay_s=1.0)
    subject = infer_worker_subject(settings.worker_id)
    async with worker(settings, heartbeats):
        busy = [asyncio.create_task(ask(nc, subject, request_for(model_dir, episode=f"b1.{i}.0"))) for i in range(2)]
        await heartbeats.wait(settings.worker_id, lambda hb: hb["inflight"] == 2)
        t0 = time.perf_counter()
        refused = await ask(nc, subject, request_for(model_dir, episode="b1.9.0"))
        assert time.perf_counter() - t0 < 0.5
        assert refused.headers is not None
        assert refused.headers[ERROR_HEADER] == "Overloaded"
        assert refused.headers[RETRYABLE_HEADER] == "true"
        for reply in await asyncio.gather(*busy):
            turn_of(reply)


class FailingEngine(FakeEngine):
    """A fake whose every request fails with a non-retryable engine error."""

    async def generate(self, request_id: str, prompt_token_ids: np.ndarray, sampling: SamplingParams,
                       max_tokens: int, *, session_key: str | None = None) -> Any:
        raise InferenceError("prompt too long for this model", retryable=False)


async def test_engine_error_is_answered(nc: bus.NATS, nats_url: str, model_dir: str, heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir)
    async with worker(settings, heartbeats, engine=FailingEngine(model_dir)):
        reply = await ask(nc, infer_worker_subject(settings.worker_id), request_for(model_dir))
    assert reply.headers is not None
    assert (reply.headers[ERROR_HEADER], reply.headers[RETRYABLE_HEADER]) == ("InferenceError", "false")
    assert b"prompt too long" in reply.data


async def test_duplicate_request_is_answered_and_stored_once(nc: bus.NATS, nats_url: str, model_dir: str,
                                                             heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir)
    request = request_for(model_dir)
    async with worker(settings, heartbeats):
        first = turn_of(await ask(nc, INFER_ANY, request))
        again = turn_of(await ask(nc, INFER_ANY, request))
    assert np.array_equal(first.token_ids, again.token_ids)
    info = await nc.jetstream().stream_info(EVENTS_STREAM)
    assert info.state.messages == 1  # deduplicated by Nats-Msg-Id


async def test_unstored_turn_is_not_answered_as_success(nc: bus.NATS, nats_url: str, model_dir: str,
                                                        heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir)
    async with worker(settings, heartbeats):
        await nc.jetstream().delete_stream(EVENTS_STREAM)
        reply = await ask(nc, INFER_ANY, request_for(model_dir))
    assert reply.headers is not None
    assert (reply.headers[ERROR_HEADER], reply.headers[RETRYABLE_HEADER]) == ("BusError", "true")


async def test_drain_finishes_in_flight_requests(nc: bus.NATS, nats_url: str, model_dir: str,
                                                 heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, fake_delay_s=1.0)
    shutdown = Shutdown()
    task = asyncio.create_task(run(settings, shutdown))
    await heartbeats.wait(settings.worker_id)
    pending = [asyncio.create_task(ask(nc, INFER_ANY, request_for(model_dir, episode=f"b1.{i}.0")))
               for i in range(20)]
    await heartbeats.wait(settings.worker_id, lambda hb: hb["inflight"] == 20)
    shutdown.event.set()
    await heartbeats.wait(settings.worker_id, lambda hb: hb["draining"])
    replies = await asyncio.gather(*pending)
    assert len({turn_of(r).request_id for r in replies}) == 20
    await asyncio.wait_for(task, timeout=10)
    # No longer subscribed: nobody answers.
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises NoRespondersError or TimeoutError
        await ask(nc, infer_worker_subject(settings.worker_id), request_for(model_dir), wait_s=0.5)


async def test_drain_timeout_aborts_and_answers_retryable(nc: bus.NATS, nats_url: str, model_dir: str,
                                                          heartbeats: Heartbeats) -> None:
    settings = make_settings(nats_url, model_dir, fake_delay_s=30.0, drain_timeout_s=0.3)
    shutdown = Shutdown()
    task = asyncio.create_task(run(settings, shutdown))
    await heartbeats.wait(settings.worker_id)
    pending = [asyncio.create_task(ask(nc, INFER_ANY, request_for(model_dir, episode=f"b1.{i}.0")))
               for i in range(5)]
    await heartbeats.wait(settings.worker_id, lambda hb: hb["inflight"] == 5)
    t0 = time.perf_counter()
    shutdown.event.set()
    for reply in await asyncio.gather(*pending):
        assert reply.headers is not None
        assert (reply.headers[ERROR_HEADER], reply.headers[RETRYABLE_HEADER]) == ("InferenceError", "true")
    await asyncio.wait_for(task, timeout=10)
    assert time.perf_counter() - t0 < 5


async def test_a_try_longer_than_its_timeout_finishes_while_its_worker_says_it_holds_it(
        nc: bus.NATS, nats_url: str, model_dir: str, heartbeats: Heartbeats) -> None:
    """A turn that takes 3x the client's ``request_timeout_s`` on a live worker (a long turn on a slow CPU) is
    not cut and generated again from nothing: the worker says every quarter of the timeout that it still generates
    it, each such message moves the try's deadline, and the turn comes on the first try."""
    from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig

    settings = make_settings(nats_url, model_dir, fake_delay_s=6.0)
    retries: list[int] = []
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=2.0, max_tries=2, backoff_initial_s=0.01),
                             on_retry=lambda: retries.append(1))
    await client.start()
    try:
        async with worker(settings, heartbeats):
            await until(lambda: settings.worker_id in client.workers, what="client sees the worker")
            t0 = time.perf_counter()
            turn = await client.generate(lambda t: request_for(model_dir, try_=t))
            assert time.perf_counter() - t0 >= 6.0  # it did outlive the timeout, three times over
            assert turn.request_id.endswith(":r1") and not retries, "one try, never cut"
            assert turn.worker_id == settings.worker_id
    finally:
        await client.stop()


async def test_a_try_that_timed_out_is_aborted_on_the_worker_still_generating_it(
        nc: bus.NATS, nats_url: str, model_dir: str, heartbeats: Heartbeats) -> None:
    """A client that asks for no progress (as an env worker of an older release) gives up on a try after
    ``request_timeout_s`` and tries again (here on the same worker, through ``INFER_ANY``): the worker, still
    generating the first try, aborts it when the client cancels it, instead of generating for nobody until the
    engine ends (a 30 s fake generation here)."""
    from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
    from rollout_ledger.shared.errors import InferenceError

    settings = make_settings(nats_url, model_dir, fake_delay_s=30.0)
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=0.5, max_tries=2, backoff_initial_s=0.01,
                                                       ask_progress=False))
    await client.start()
    try:
        async with worker(settings, heartbeats):
            await until(lambda: settings.worker_id in client.workers, what="client sees the worker")
            with pytest.raises(InferenceError, match="after 2 tries"):
                await client.generate(lambda t: request_for(model_dir, try_=t))
            beats = heartbeats.of(settings.worker_id)
            assert any(hb["inflight"] >= 1 for hb in beats), "the worker took the tries"
            # both tries aborted on the worker: a heartbeat after the client gave up says nothing runs there, far
            # sooner than the fake engine's 30 s
            await until(lambda: any(hb["inflight"] == 0 for hb in heartbeats.of(settings.worker_id)[len(beats):]),
                        10.0, "a heartbeat with nothing in flight after the client gave up")
    finally:
        await client.stop()


async def test_env_worker_client_routes_around_a_full_worker(nc: bus.NATS, nats_url: str, model_dir: str,
                                                               heartbeats: Heartbeats) -> None:
    from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig

    a, b = make_settings(nats_url, model_dir), make_settings(nats_url, model_dir, max_inflight=1, fake_delay_s=0.5)
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=5, max_tries=3, backoff_initial_s=0.01))
    await client.start()
    try:
        async with worker(a, heartbeats), worker(b, heartbeats):
            await until(lambda: {a.worker_id, b.worker_id} <= set(client.workers), what="client sees both workers")
            # b is full (one slow request, capacity 1): the client routes the turn it prefers on b to a.
            busy = request_for(model_dir, episode="b9.0.0")
            slow = asyncio.create_task(ask(nc, infer_worker_subject(b.worker_id), busy))
            await heartbeats.wait(b.worker_id, lambda hb: hb["inflight"] == 1)
            turn = await client.generate(lambda t: request_for(model_dir, try_=t), prefer=b.worker_id)
            assert turn.worker_id == a.worker_id
            turn_of(await slow)
    finally:
        await client.stop()


async def test_real_process_serves_and_drains_on_sigterm(stack: Stack, nc: bus.NATS, model_dir: str,
                                                         heartbeats: Heartbeats) -> None:
    proc = stack.start("inference-worker", name="inf-proc", rollout_fake_delay_s="1.0", rollout_heartbeat_s="0.1",
                       rollout_weight_version="2")
    hb = await heartbeats.wait("inf-proc")
    assert hb["subject"] == infer_worker_subject("inf-proc") and hb["weight_version"] == 2

    turn = turn_of(await ask(nc, infer_worker_subject("inf-proc"), request_for(model_dir)))
    assert turn.worker_id == "inf-proc" and turn.weight_version == 2
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{proc.url}/metrics")).text
    assert 'rollout_inference_requests_total{outcome="ok"} 1.0' in metrics
    assert "rollout_generate_seconds_bucket" in metrics

    pending = [asyncio.create_task(ask(nc, INFER_ANY, request_for(model_dir, episode=f"b1.{i}.0")))
               for i in range(10)]
    await heartbeats.wait("inf-proc", lambda hb: hb["inflight"] == 10)
    proc.signal(signal.SIGTERM)
    await heartbeats.wait("inf-proc", lambda hb: hb["draining"])
    replies = await asyncio.gather(*pending)
    assert len({turn_of(r).request_id for r in replies}) == 10
    assert proc.proc is not None
    code = await asyncio.to_thread(proc.proc.wait, 15)
    assert code == 0, proc.tail_log()


class DyingEngine(FakeEngine):
    """A fake whose engine process 'dies' at its first request (as vLLM's engine core can)."""

    dead = False

    @property
    def healthy(self) -> bool:
        return not self.dead

    async def generate(self, request_id: str, prompt_token_ids: np.ndarray, sampling: SamplingParams,
                       max_tokens: int, *, session_key: str | None = None) -> Any:
        self.dead = True
        raise InferenceError("the engine is dead", retryable=True)


async def test_worker_with_a_dead_engine_stops_and_says_so(nc: bus.NATS, nats_url: str, model_dir: str,
                                                           heartbeats: Heartbeats) -> None:
    """A dead engine is not a worker that answers errors forever: it turns not ready, drains and exits with an
    error (its supervisor restarts it; requesters fail over to other workers)."""
    settings = make_settings(nats_url, model_dir)
    health = Health()
    task = asyncio.create_task(run(settings, Shutdown(), engine=DyingEngine(model_dir), health=health))
    await heartbeats.wait(settings.worker_id)
    assert health.status()[0]
    reply = await ask(nc, infer_worker_subject(settings.worker_id), request_for(model_dir))
    assert reply.headers is not None and reply.headers[RETRYABLE_HEADER] == "true"
    with pytest.raises(InferenceError, match="engine died"):
        await asyncio.wait_for(task, timeout=15)
    ok, checks = health.status()
    assert not ok and checks["engine"] is False
