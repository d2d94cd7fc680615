"""Inference-worker liveness on a fake clock (no sleeps): a worker is live until its last heartbeat is older than
the heartbeat timeout (exactly that old: still live; just past it: reaped), a heartbeat renews it, a stalled loop
or a NATS restart excuses every worker, and the client fails over the tries waiting on a reaped worker. Also the
choice of a worker among the live ones."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.inference_request import TryFailed
from rollout_ledger.services.env_worker.inference_workers import WorkerState, WorkerTable, choose
from tests.helpers import FakeClock

TIMEOUT_S = 2.0
"""The heartbeat timeout of these tests (a binary fraction, like every time below: the boundaries are exact)."""
JUST_PAST = 1.0 / 1024
"""A step past the timeout, exact in binary."""


def heartbeat(worker_id: str, **fields: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, "subject": f"rl.infer.w.{worker_id}", **fields}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> WorkerTable:
    return WorkerTable(TIMEOUT_S, clock, wall=FakeClock(1_700_000_000.0))


def test_a_worker_is_live_until_its_heartbeat_is_older_than_the_timeout(clock: FakeClock, table: WorkerTable) -> None:
    table.heard(heartbeat("w1"))
    assert table.is_live("w1") and "w1" in table
    clock.advance(TIMEOUT_S)  # exactly the timeout: still live, not reaped
    assert table.is_live("w1")
    assert table.reap() == []
    clock.advance(JUST_PAST)  # just past it: silent, reaped
    assert not table.is_live("w1")
    assert [s.worker_id for s in table.reap()] == ["w1"]
    assert "w1" not in table and not table.is_live("w1")
    assert table.reap() == []  # reaped once


def test_a_heartbeat_renews_the_timeout(clock: FakeClock, table: WorkerTable) -> None:
    table.heard(heartbeat("w1"))
    table.heard(heartbeat("w2"))
    clock.advance(1.5)
    table.heard(heartbeat("w1", capacity=4, inflight=1))
    clock.advance(TIMEOUT_S - 1.5 + JUST_PAST)  # w2 just past its timeout; w1 heard 1.5 s later
    assert [s.worker_id for s in table.reap()] == ["w2"]
    clock.advance(1.5 - JUST_PAST)  # w1 exactly at its timeout
    assert table.reap() == [] and table.workers["w1"].capacity == 4
    clock.advance(JUST_PAST)
    assert [s.worker_id for s in table.reap()] == ["w1"]


def test_a_reaped_worker_heard_again_joins_again(clock: FakeClock, table: WorkerTable) -> None:
    table.heard(heartbeat("w1"))
    clock.advance(TIMEOUT_S + JUST_PAST)
    assert len(table.reap()) == 1
    with capture_logs() as logs:
        table.heard(heartbeat("w1"))
    assert [e["event"] for e in logs] == ["inference.worker_joined"]
    assert table.is_live("w1")


def test_excuse_stall_gives_every_worker_a_full_timeout_from_now(clock: FakeClock, table: WorkerTable) -> None:
    table.heard(heartbeat("w1"))
    clock.advance(1.0)
    table.heard(heartbeat("w2"))
    clock.advance(4.0)  # this client's loop was blocked: both well past their timeout, their beats unread
    with capture_logs() as logs:
        table.excuse_stall(4.0)
    assert [(e["event"], e["stalled_s"], e["workers"]) for e in logs] == [("inference.loop_stalled", 4.0, 2)]
    clock.advance(TIMEOUT_S)  # exactly a full timeout after the excuse: still live
    assert table.reap() == []
    clock.advance(JUST_PAST)
    assert sorted(s.worker_id for s in table.reap()) == ["w1", "w2"]


def test_an_excuse_never_moves_a_heartbeat_back(clock: FakeClock, table: WorkerTable) -> None:
    table.heard(heartbeat("w1"))
    table.excuse(now=clock() - 1.0)
    assert table.workers["w1"].last_seen == clock()


def test_a_worker_reporting_a_reconnect_returns_when_it_was_last_heard() -> None:
    wall = FakeClock(1_700_000_000.0)
    table = WorkerTable(TIMEOUT_S, FakeClock(), wall)
    assert table.heard(heartbeat("w1", reconnects=2)) is None  # first heartbeat: no reconnect to recover from
    wall.advance(1.0)
    assert table.heard(heartbeat("w1", reconnects=2)) is None
    wall.advance(1.0)
    assert table.heard(heartbeat("w1", reconnects=3)) == 1_700_000_001.0


def test_a_timeout_under_twice_the_interval_is_warned_once(table: WorkerTable) -> None:
    with capture_logs() as logs:
        table.heard(heartbeat("w1", every_s=1.0))  # 2.0 < 2 * 1.0 is false: fine
        table.heard(heartbeat("w2", every_s=1.5))
        table.heard(heartbeat("w2", every_s=1.5))
    assert [(e["event"], e.get("worker")) for e in logs if e["event"] == "inference.heartbeat_timeout_short"] == [
        ("inference.heartbeat_timeout_short", "w2")]


def _nc(connected: bool = True, reconnects: int = 0) -> Any:
    return SimpleNamespace(is_connected=connected, stats={"reconnects": reconnects})


async def test_the_client_fails_over_the_tries_of_a_reaped_worker(clock: FakeClock) -> None:
    client = InferenceClient(_nc(), InferenceClientConfig(heartbeat_timeout_s=TIMEOUT_S), clock=clock)
    client.table.heard(heartbeat("w1"))
    client.table.heard(heartbeat("w2"))
    loop = asyncio.get_running_loop()
    on_w1, on_w2, on_any = loop.create_future(), loop.create_future(), loop.create_future()
    client.workers["w1"].waiting.add(on_w1)
    client.workers["w2"].waiting.add(on_w2)
    client.requests.waiting_any.add(on_any)
    clock.advance(1.0)
    client.table.heard(heartbeat("w2"))
    clock.advance(TIMEOUT_S - 1.0)
    assert client.reap() == [] and not on_w1.done()  # exactly at the timeout
    clock.advance(JUST_PAST)
    with capture_logs() as logs:
        assert client.reap() == ["w1"]
    assert [(e["event"], e["waiting"], e["waiting_any"]) for e in logs] == [("inference.worker_lost", 1, 1)]
    with pytest.raises(TryFailed, match="w1 stopped sending heartbeats"):
        on_w1.result()
    with pytest.raises(TryFailed):
        on_any.result()  # sent to INFER_ANY: the dead worker may have taken it
    assert not on_w2.done() and set(client.workers) == {"w2"}


async def test_nobody_is_reaped_while_the_client_is_cut_off_nor_at_the_tick_it_is_back(clock: FakeClock) -> None:
    nc = _nc(connected=False)
    client = InferenceClient(nc, InferenceClientConfig(heartbeat_timeout_s=TIMEOUT_S), clock=clock)
    client.table.heard(heartbeat("w1"))
    clock.advance(10.0)
    assert client.reap() == []  # cut off: no heartbeat could arrive
    nc.is_connected = True
    clock.advance(1.0)
    assert client.reap() == []  # back: w1 gets a full timeout from now (and the lost replies are looked up)
    try:
        clock.advance(TIMEOUT_S)
        assert client.reap() == []
        clock.advance(JUST_PAST)
        assert client.reap() == ["w1"]
    finally:
        await client.recovery.stop()


async def test_a_reconnect_between_two_ticks_counts_as_cut_off(clock: FakeClock) -> None:
    nc = _nc()
    client = InferenceClient(nc, InferenceClientConfig(heartbeat_timeout_s=TIMEOUT_S), clock=clock)
    client.table.heard(heartbeat("w1"))
    clock.advance(TIMEOUT_S + JUST_PAST)
    nc.stats["reconnects"] = 1  # to another node of a cluster, too fast to be seen cut off
    try:
        assert client.reap() == []
        clock.advance(TIMEOUT_S + JUST_PAST)
        assert client.reap() == ["w1"]
    finally:
        await client.recovery.stop()


async def test_each_reconnect_starts_a_recovery_of_its_own(clock: FakeClock) -> None:
    """A recovery still reading (one of its tries waits for its timeout) does not keep the next reconnect's lost
    requests from being sent again: each reconnect starts its own."""
    nc = _nc()
    client = InferenceClient(nc, InferenceClientConfig(heartbeat_timeout_s=TIMEOUT_S), clock=clock)
    client.table.heard(heartbeat("w1"))
    try:
        nc.stats["reconnects"] = 1
        assert client.reap() == []
        assert client.recovery.under_way == 1
        clock.advance(1.0)
        nc.stats["reconnects"] = 2  # a second node lost while the first recovery waits out its grace
        assert client.reap() == []
        assert client.recovery.under_way == 2
    finally:
        await client.recovery.stop()


def _state(worker_id: str, *, capacity: int = 0, inflight: int = 0, draining: bool = False) -> WorkerState:
    return WorkerState(worker_id, f"rl.infer.w.{worker_id}", capacity, inflight, draining, 0.0)


def _chosen(workers: dict[str, WorkerState], prefer: str | None = None,
            exclude: frozenset[str] | set[str] = frozenset()) -> str | None:
    state = choose(workers, prefer, exclude)
    return state.worker_id if state is not None else None


def test_choose_sticky_then_least_loaded_per_capacity() -> None:
    workers = {"a": _state("a", capacity=8, inflight=4), "b": _state("b", capacity=2, inflight=1),
               "c": _state("c", capacity=4, inflight=1)}
    assert _chosen(workers, prefer="a") == "a"
    assert _chosen(workers) == "c"  # 1/4 < 4/8 = 1/2
    workers["a"].local_inflight = 8  # full: the sticky one has no room
    assert _chosen(workers, prefer="a") == "c"
    assert _chosen(workers, exclude={"c"}) == "b"
    workers["b"].draining = True
    assert _chosen(workers, prefer="b", exclude={"c"}) == "a"
    assert _chosen(workers, exclude={"a", "c"}) is None
    assert _chosen({}) is None
