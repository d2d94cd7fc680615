"""The pure pieces of the episode-level drain (issue 15): which env workers an inference worker still waits for, which
inference workers an env worker still waits for, the report mirror's expiry, and the env worker's gate as a state
machine (reports fed by hand, nothing on a bus)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import cast

import orjson
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KeyValue
from pydantic import BaseModel

from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.shared.kit.policy_bus import PolicyBus, ReportMirror
from rollout_ledger.shared.policy_versions import (
    EnvPolicyReport,
    EnvPolicyState,
    PolicyAnnouncement,
    SwapMode,
    WorkerPolicyReport,
    WorkerPolicyState,
    drained_for,
    envs_not_drained,
    read_value,
    settled_on,
    workers_behind,
)
from rollout_ledger.shared.subjects import BUCKET_TTL_S, POLICY_ENV_BUCKET, POLICY_WORKERS_BUCKET
from tests.helpers import until

S = WorkerPolicyState
E = EnvPolicyState


def _env(state: EnvPolicyState, drained: int | None = None, version: int = 1) -> EnvPolicyReport:
    return EnvPolicyReport(worker_id="e", version=version, state=state, drained_for=drained)


def _inf(worker_id: str, serving: int | None, version: int, state: WorkerPolicyState) -> WorkerPolicyReport:
    return WorkerPolicyReport(worker_id=worker_id, serving=serving, version=version, state=state)


def test_an_env_worker_has_drained_for_a_version_only_while_it_holds_episodes_back() -> None:
    assert drained_for(_env(E.DRAINED, drained=3), 3)
    assert drained_for(_env(E.DRAINED, drained=4), 3), "drained for a newer version covers an older one"
    assert not drained_for(_env(E.DRAINED, drained=2), 3)
    assert not drained_for(_env(E.DRAINING), 3)
    assert not drained_for(_env(E.RUNNING, drained=3), 3), "it resumed: its episodes run again"
    reports = {"a": _env(E.DRAINED, drained=3), "b": _env(E.DRAINING), "c": _env(E.RUNNING, drained=2)}
    assert envs_not_drained(reports, 3) == ["b", "c"]
    assert envs_not_drained({}, 3) == [], "no env worker: nothing to wait for"


def test_an_inference_worker_is_settled_on_a_version_it_serves_or_refused() -> None:
    assert settled_on(_inf("i", 3, 3, S.SERVING), 3)
    assert settled_on(_inf("i", 4, 4, S.SERVING), 3)
    assert settled_on(_inf("i", 2, 3, S.FAILED), 3), "refused: it keeps 2, waiting for it is waiting forever"
    assert not settled_on(_inf("i", 2, 3, S.LOADING), 3)
    assert not settled_on(_inf("i", 2, 3, S.ANNOUNCED), 3)
    assert not settled_on(_inf("i", None, 3, S.LOADING), 3)
    assert not settled_on(_inf("i", 2, 2, S.FAILED), 3), "failed for an older one: 3 may still load"
    reports = {"a": _inf("a", 3, 3, S.SERVING), "b": _inf("b", 2, 3, S.LOADING), "c": _inf("c", 2, 2, S.SERVING)}
    assert workers_behind(reports, 3) == ["b", "c"]
    assert workers_behind(reports, 3, alive=lambda w: w != "b") == ["c"], "a worker not live is not waited for"


def test_reports_are_tolerant_readers() -> None:
    raw = orjson.dumps({"worker_id": "e", "version": 2, "state": "drained", "drained_for": 2, "newer": {"x": 1}})
    report = read_value(EnvPolicyReport, raw)
    assert report is not None and report.state is E.DRAINED and report.paused_for is None and report.running == 0
    assert BUCKET_TTL_S[POLICY_ENV_BUCKET] == BUCKET_TTL_S[POLICY_WORKERS_BUCKET]


def _bus() -> PolicyBus:
    return PolicyBus(cast(JetStreamContext, None))  # nothing here touches the bus


def _entry(key: str, report: BaseModel | None, age_s: float = 0.0) -> KeyValue.Entry:
    value = orjson.dumps(report.model_dump(mode="json")) if report is not None else b""
    created = datetime.now(UTC) - timedelta(seconds=age_s)
    return KeyValue.Entry(bucket="b", key=key, value=value, revision=1, delta=0, created=cast(int, created),
                          operation=None if report is not None else KV_DEL)


def test_the_mirror_drops_deleted_and_expired_reports() -> None:
    mirror: ReportMirror[EnvPolicyReport] = ReportMirror(_bus(), POLICY_ENV_BUCKET, EnvPolicyReport, 60.0)
    changes: list[int] = []
    mirror.on_change(lambda: changes.append(1))
    mirror._apply(_entry("a", _env(E.RUNNING)))
    mirror._apply(_entry("b", _env(E.RUNNING), age_s=61))  # stored more than a TTL ago: expired on the server
    mirror._apply(_entry("c", _env(E.RUNNING)))
    assert set(mirror.live()) == {"a", "c"}
    mirror._apply(_entry("c", None))
    assert set(mirror.live()) == {"a"} and len(changes) == 4


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _gate(timeout_s: float = 60.0, alive: set[str] | None = None) -> EpisodeGate:
    live = alive if alive is not None else {"inf-1", "inf-2"}
    return EpisodeGate(_bus(), "env-1", drain_timeout_s=timeout_s, report_s=60.0, alive=lambda w: w in live,
                       metrics=build_metrics())


def _serving(gate: EpisodeGate, worker_id: str, serving: int, version: int | None = None,
             state: WorkerPolicyState = S.SERVING) -> None:
    gate.workers._apply(_entry(worker_id, _inf(worker_id, serving, serving if version is None else version, state)))


def _announce(version: int, mode: SwapMode = SwapMode.DRAIN) -> PolicyAnnouncement:
    return PolicyAnnouncement(version=version, checkpoint="/ckpt", mode=mode)


async def test_the_gate_closes_for_a_drain_reports_drained_and_opens_once_every_live_worker_serves() -> None:
    gate = _gate()
    _serving(gate, "inf-1", 0)
    _serving(gate, "inf-2", 0)
    stop = asyncio.Event()
    try:
        assert await gate.admit(stop) and await gate.admit(stop)
        await gate.on_announcement(_announce(1))
        assert not gate.is_open and gate.paused_for == 1 and gate.state is E.DRAINING
        held = asyncio.create_task(gate.admit(stop))
        await _settle()
        assert not held.done() and gate.held == 1
        gate.finished()
        await _settle()
        assert gate.state is E.DRAINING and gate.drained_for is None
        gate.finished()
        await until(lambda: gate.drained_for == 1, 5, "the gate to report the drain")
        assert gate.state is E.DRAINED and gate.current_report().drained_for == 1
        _serving(gate, "inf-1", 1)  # wakes the gate's supervisor, which clears the wake before it waits again
        await until(lambda: not gate._wake.is_set(), 2, "the gate to re-check after inf-1's report")
        assert not gate.is_open, "inf-2 does not serve 1 yet"
        _serving(gate, "inf-2", 1, state=S.SERVING)
        assert await asyncio.wait_for(held, 2), "the held item starts"
        assert gate.is_open and gate.state is E.RUNNING and gate.paused_for is None and gate.running == 1
        assert gate.metrics is not None
        assert gate.metrics.registry.get_sample_value("rollout_policy_pause_seconds_count") == 1
        assert gate.metrics.registry.get_sample_value("rollout_policy_pause_timeouts_total") == 0
        await gate.on_announcement(_announce(1))  # replayed: nothing
        assert gate.is_open and gate.pauses == 1
    finally:
        await gate.stop()


async def test_abort_keep_and_versions_every_worker_serves_pause_nothing() -> None:
    gate = _gate()
    _serving(gate, "inf-1", 0)
    try:
        await gate.on_announcement(_announce(1, SwapMode.ABORT))
        await gate.on_announcement(_announce(2, SwapMode.KEEP))
        assert gate.is_open and gate.known == 2
        _serving(gate, "inf-1", 3)
        await gate.on_announcement(_announce(3))  # a drain already served everywhere (a late watch)
        assert gate.is_open and gate.pauses == 0
    finally:
        await gate.stop()


async def test_no_live_inference_worker_and_a_refusal_do_not_hold_episodes() -> None:
    gate = _gate(alive=set())
    _serving(gate, "inf-1", 0)  # its report outlives it (TTL), its heartbeats do not
    try:
        await gate.on_announcement(_announce(1))
        assert gate.is_open
    finally:
        await gate.stop()
    refusing = _gate(alive={"inf-1"})
    _serving(refusing, "inf-1", 0)
    try:
        await refusing.on_announcement(_announce(1))
        assert not refusing.is_open
        _serving(refusing, "inf-1", 0, version=1, state=S.FAILED)  # it refused the checkpoint and keeps 0
        await until(lambda: refusing.is_open, 5, "the gate to open on the refusal")
    finally:
        await refusing.stop()


async def test_a_newer_drain_extends_the_pause_and_the_timeout_bounds_it() -> None:
    gate = _gate(timeout_s=0.6, alive={"inf-1"})
    _serving(gate, "inf-1", 0)
    try:
        await gate.on_announcement(_announce(1))
        await until(lambda: gate.drained_for == 1, 5, "the drain for 1")
        _serving(gate, "inf-1", 1)
        await gate.on_announcement(_announce(2))  # before the gate saw 1 served: now held for 2
        await until(lambda: gate.drained_for == 2, 5, "the drain for 2")
        assert not gate.is_open and gate.paused_for == 2
        await until(lambda: gate.is_open, 5, "inf-1 never serves 2: the timeout to open the gate")
        assert gate.metrics is not None
        assert gate.metrics.registry.get_sample_value("rollout_policy_pause_timeouts_total") == 1
        assert gate.pauses == 1
    finally:
        await gate.stop()


async def test_a_stopping_worker_does_not_start_a_held_episode() -> None:
    gate = _gate(alive={"inf-1"})
    _serving(gate, "inf-1", 0)
    stop = asyncio.Event()
    try:
        await gate.on_announcement(_announce(1))
        held = asyncio.create_task(gate.admit(stop))
        await _settle()
        stop.set()
        assert await asyncio.wait_for(held, 1) is False and gate.running == 0 and gate.held == 0
    finally:
        await gate.stop()

