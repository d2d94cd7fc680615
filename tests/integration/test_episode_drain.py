"""Episode-level drain of a policy version (issue 15: "drain gives no mixed episodes"), on real NATS and Postgres
with the fake engine: a version announced in mode ``drain`` makes the env worker start no new episode (work items
stay in the queue, no delivery spent) until the inference worker serves it, the env worker reports "drained" in
``rl_policy_env`` once its episodes ended and the inference worker swaps only then; ``abort`` pauses nothing and
its mixed episodes are recorded per turn; both waits are bounded (an inference worker stops waiting for long
episodes, an env worker stops waiting for a stuck inference worker) and nobody waits for a worker that is not live.
The first three run the services as processes; the last ones run the env worker's gate and the inference worker's
follower in the test, against real buckets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from nats.js.errors import KeyNotFoundError

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.services.inference_worker.weights import EpisodeDrain, PolicyFollower, Weights
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.policy_versions import (
    EnvPolicyReport,
    EnvPolicyState,
    PolicyAnnouncement,
    SwapMode,
    WorkerPolicyReport,
    WorkerPolicyState,
    read_value,
)
from rollout_ledger.shared.subjects import POLICY_BUCKET, POLICY_ENV_BUCKET, POLICY_KEY, POLICY_WORKERS_BUCKET
from tests.helpers import AUTH, Sql, metric, until
from tests.integration.test_pipeline import check_token_exact
from tests.unit.test_weight_swap import checkpoint


async def _env_report(js: bus.JetStreamContext, worker_id: str) -> EnvPolicyReport | None:
    kv = await js.key_value(POLICY_ENV_BUCKET)
    try:
        return read_value(EnvPolicyReport, (await kv.get(worker_id)).value)
    except KeyNotFoundError:
        return None


async def _worker_report(js: bus.JetStreamContext, worker_id: str) -> WorkerPolicyReport | None:
    kv = await js.key_value(POLICY_WORKERS_BUCKET)
    try:
        return read_value(WorkerPolicyReport, (await kv.get(worker_id)).value)
    except KeyNotFoundError:
        return None


async def _announce(url: str, version: int, ckpt: Path, mode: str) -> None:
    async with httpx.AsyncClient(timeout=10, headers=AUTH) as client:
        r = await client.post(f"{url}/v1/policy/versions",
                              json={"version": version, "checkpoint": str(ckpt), "mode": mode})
    assert r.status_code == 201, r.text


async def _batch(url: str, tasks: int, turns: int) -> str:
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as client:
        r = await client.post(f"{url}/v1/batches", json={
            "env": "fixed-turns", "tasks": [{"turns": turns}] * tasks, "group_size": 2, "max_turns": turns,
            "sampling": {"max_tokens": 8}})
    assert r.status_code == 201, r.text
    return str(r.json()["batch_id"])


async def _until_done(url: str, batch_id: str) -> None:
    async def done() -> bool:
        async with httpx.AsyncClient(timeout=10, headers=AUTH) as client:
            return bool((await client.get(f"{url}/v1/batches/{batch_id}")).json()["done"])

    await until(done, 120, "the batch")


async def _first_report(js: bus.JetStreamContext, worker_id: str) -> EnvPolicyReport:
    async def report() -> EnvPolicyReport | None:
        return await _env_report(js, worker_id)

    found: EnvPolicyReport = await until(report, 10, f"{worker_id}'s first report")
    return found


def _stack(stack: Stack, inference: dict[str, str], env: dict[str, str]) -> tuple[ServiceProcess, ServiceProcess, str]:
    inf = stack.start("inference-worker", name="inf-a", ROLLOUT_ENGINE="fake", ROLLOUT_POLICY_REPORT_S="1",
                      **inference)
    env_worker = stack.start("env-worker", name="env-a", ROLLOUT_POLICY_REPORT_S="1", **env)
    stack.start("recorder")
    return inf, env_worker, stack.start("scheduler").url


def _versions_per_turn_recorded(sql: Sql, batch_id: str) -> None:
    """Each trajectory's action versions are its kept turns' versions in turn order, never going backwards."""
    for row in sql.rows("select t.episode_id, t.action_versions, array(select k.weight_version from turns k "
                        "where k.episode_id = t.episode_id and k.attempt = t.attempt and not k.superseded "
                        "order by k.turn_index) as turns from trajectories t where t.batch_id = :b", b=batch_id):
        assert list(row["action_versions"]) == list(row["turns"]), row["episode_id"]
        assert list(row["turns"]) == sorted(row["turns"]), row["episode_id"]


async def test_drain_holds_new_episodes_back_until_the_version_serves(stack: Stack, nc: bus.NATS, database_url: str,
                                                                     model_dir: str, tmp_path: Path) -> None:
    js = nc.jetstream()
    inf, env, url = _stack(stack, {"ROLLOUT_FAKE_DELAY_S": "0.2", "ROLLOUT_FAKE_LOAD_S": "3"},
                           {"ROLLOUT_CONCURRENCY": "4"})
    first = await _first_report(js, "env-a")
    assert (first.state, first.paused_for) == (EnvPolicyState.RUNNING, None)
    batch_id = await _batch(url, tasks=8, turns=5)  # 16 episodes, 4 at a time
    sql = Sql(database_url)
    try:
        await until(lambda: sql.scalar("select count(*) from turns") >= 8, 60, "turns on version 0")
        await _announce(url, 1, checkpoint(model_dir, tmp_path / "v1"), "drain")

        # each observation keeps the time before its two reads and the time after them: "paused" was true by the
        # time after (the report is put once the gate closed), "not serving" was still true at the time before
        # (the env worker opens its gate only on a report saying 1 serves, put after the read that said 0)
        seen: list[tuple[float, float, EnvPolicyReport, WorkerPolicyReport]] = []

        async def observe() -> bool:
            before = time.time()
            e, w = await _env_report(js, "env-a"), await _worker_report(js, "inf-a")
            assert e is not None and w is not None
            seen.append((before, time.time(), e, w))
            return e.paused_for is None and e.version == 1 and w.serving == 1  # resumed, and 1 serves

        await until(observe, 60, "the env worker to resume once version 1 serves")
        paused = [(after, e, w) for _, after, e, w in seen if e.paused_for == 1]
        assert paused, "the env worker held new episodes back for version 1"
        drained = [(t, e, w) for t, e, w in paused if e.state is EnvPolicyState.DRAINED]
        assert drained and all(e.drained_for == 1 and e.running == 0 for _, e, _ in drained)
        assert any(w.serving == 0 for _, _, w in drained), "it reported drained before the inference worker swapped"
        assert all(e.state is not EnvPolicyState.RUNNING for _, e, _ in paused)
        t_paused = paused[0][0]
        t_not_serving = max(before for before, _, _, w in seen if w.serving == 0)
        assert t_not_serving - t_paused > 2, "the pause covered the load (3 s)"
        started = sql.scalar("select count(*) from episodes where started_at > to_timestamp(:a) "
                             "and started_at < to_timestamp(:b)", a=t_paused, b=t_not_serving)
        assert started == 0, "no episode started while the version was being drained in"

        await _until_done(url, batch_id)
        assert {r["status"] for r in sql.rows("select distinct status from episodes")} == {"completed"}
        assert check_token_exact(sql, batch_id) == 16
        assert sql.scalar("select max(attempt) from episodes") == 1, "holding work back spent no delivery"
        spans = sql.rows("select min_version, max_version, mixed_versions from v_trajectory_versions")
        assert len(spans) == 16 and not any(r["mixed_versions"] for r in spans), "drain: no mixed episode"
        assert {r["min_version"] for r in spans} == {0, 1}, "episodes ran on 0 before the drain and on 1 after it"
        late = sql.scalar("select count(*) from episodes e join trajectories t on t.episode_id = e.id "
                          "where e.started_at > to_timestamp(:a) and not (t.action_versions <@ array[1])", a=t_paused)
        assert late == 0, "every episode started after the pause ran wholly on version 1"
        _versions_per_turn_recorded(sql, batch_id)
        assert metric(env.url, "rollout_policy_pause_seconds_count") == 1
        assert metric(env.url, "rollout_policy_pause_seconds_sum") > 3, "held back during the drain and the load"
        assert metric(env.url, "rollout_policy_episode_drain_seconds_count") == 1
        assert metric(env.url, "rollout_policy_pause_timeouts_total") == 0
        assert metric(env.url, "rollout_policy_paused") == 0
        assert metric(inf.url, "rollout_episode_drain_seconds_count") == 1
        assert metric(inf.url, "rollout_episode_drain_timeouts_total") == 0
        assert metric(inf.url, "rollout_inference_regenerated_total") == 0, "drain cut no turn"
    finally:
        sql.close()


async def test_abort_pauses_no_episode_and_records_mixed_ones_per_turn(stack: Stack, nc: bus.NATS,
                                                                       database_url: str, model_dir: str,
                                                                       tmp_path: Path) -> None:
    js = nc.jetstream()
    # 0.1-0.3 s a turn: the jitter lets the 8 episodes, started together, drift apart, so generations are in flight
    # whenever the abort lands (in step, an abort between two of their turns cut nothing)
    inf, env, url = _stack(stack, {"ROLLOUT_FAKE_DELAY_S": "0.1", "ROLLOUT_FAKE_DELAY_JITTER_S": "0.2",
                                   "ROLLOUT_FAKE_LOAD_S": "0.5"}, {"ROLLOUT_CONCURRENCY": "8"})
    await _first_report(js, "env-a")
    batch_id = await _batch(url, tasks=4, turns=8)  # 8 episodes, all at once
    sql = Sql(database_url)
    try:
        await until(lambda: sql.scalar("select count(*) from turns") >= 16, 60, "turns on version 0")
        await until(lambda: metric(inf.url, "rollout_inference_inflight") >= 2, 10, "generations in flight")
        await _announce(url, 1, checkpoint(model_dir, tmp_path / "v1"), "abort")
        reports: list[EnvPolicyReport] = []

        async def knows_1() -> bool:
            report = await _env_report(js, "env-a")
            assert report is not None
            reports.append(report)
            served = await _worker_report(js, "inf-a")
            return report.version == 1 and served is not None and served.serving == 1

        await until(knows_1, 30, "version 1 known and served")
        assert all(r.state is EnvPolicyState.RUNNING and r.paused_for is None for r in reports)
        await _until_done(url, batch_id)
        assert check_token_exact(sql, batch_id) == 8
        spans = sql.rows("select min_version, max_version, mixed_versions from v_trajectory_versions")
        mixed = [r for r in spans if r["mixed_versions"]]
        assert mixed and all((r["min_version"], r["max_version"]) == (0, 1) for r in mixed), spans
        _versions_per_turn_recorded(sql, batch_id)
        assert metric(inf.url, "rollout_inference_regenerated_total") > 0, "abort cut the turns in flight"
        assert metric(env.url, "rollout_policy_pause_seconds_count") == 0, "abort holds no episode back"
        assert metric(inf.url, "rollout_episode_drain_seconds_count") == 0, "abort waits for no episode"
    finally:
        sql.close()


async def test_an_inference_worker_stops_waiting_for_long_episodes(stack: Stack, nc: bus.NATS, database_url: str,
                                                                   model_dir: str, tmp_path: Path) -> None:
    inf, env, url = _stack(stack, {"ROLLOUT_FAKE_DELAY_S": "0.2", "ROLLOUT_FAKE_LOAD_S": "0.2",
                                   "ROLLOUT_EPISODE_DRAIN_TIMEOUT_S": "1"}, {"ROLLOUT_CONCURRENCY": "4"})
    batch_id = await _batch(url, tasks=2, turns=40)  # 4 episodes of 8 s or more, all at once
    sql = Sql(database_url)
    try:
        await until(lambda: sql.scalar("select count(*) from turns") >= 8, 60, "turns on version 0")
        announced = time.monotonic()
        await _announce(url, 1, checkpoint(model_dir, tmp_path / "v1"), "drain")
        js = nc.jetstream()

        async def serving() -> bool:
            report = await _worker_report(js, "inf-a")
            return report is not None and report.serving == 1

        await until(serving, 30, "version 1 served")
        assert time.monotonic() - announced < 5, "it swapped after its 1 s timeout, not after the episodes"
        assert metric(inf.url, "rollout_episode_drain_timeouts_total") == 1
        await _until_done(url, batch_id)
        spans = sql.rows("select min_version, max_version, mixed_versions from v_trajectory_versions")
        assert len(spans) == 4 and all((r["min_version"], r["max_version"]) == (0, 1) for r in spans), (
            "past the timeout a turn-level drain: the running episodes span the two versions")
        _versions_per_turn_recorded(sql, batch_id)
        assert metric(env.url, "rollout_policy_pause_seconds_count") == 1
        assert metric(env.url, "rollout_policy_pause_timeouts_total") == 0, "it resumed once 1 served"
        assert "weights.episode_drain_timeout" in inf.log_path.read_text()
    finally:
        sql.close()


# --- in the test: the env worker's gate and the inference worker's follower on real buckets ----------------------


async def _put_announcement(js: bus.JetStreamContext, version: int, ckpt: Path, mode: SwapMode) -> None:
    kv = await js.key_value(POLICY_BUCKET)
    announcement = PolicyAnnouncement(version=version, checkpoint=str(ckpt), mode=mode)
    await kv.put(POLICY_KEY, orjson.dumps(announcement.model_dump(mode="json")))


async def _put_worker(js: bus.JetStreamContext, worker_id: str, serving: int, version: int,
                      state: WorkerPolicyState) -> None:
    kv = await js.key_value(POLICY_WORKERS_BUCKET)
    report = WorkerPolicyReport(worker_id=worker_id, serving=serving, version=version, state=state)
    await kv.put(worker_id, orjson.dumps(report.model_dump(mode="json")))


def _gate(js: bus.JetStreamContext, alive: Callable[[str], bool], timeout_s: float = 60.0) -> EpisodeGate:
    return EpisodeGate(PolicyBus(js), "env-t", drain_timeout_s=timeout_s, report_s=1.0, alive=alive,
                       metrics=build_metrics())


async def test_an_env_worker_resumes_after_its_timeout_when_a_worker_is_stuck(nc: bus.NATS, tmp_path: Path) -> None:
    js = nc.jetstream()
    await _put_worker(js, "stuck", serving=0, version=0, state=WorkerPolicyState.SERVING)
    gate = _gate(js, alive=lambda w: w == "stuck", timeout_s=2.0)
    await gate.start()
    stopping = asyncio.Event()
    try:
        assert await gate.admit(stopping)  # one episode running
        await _put_announcement(js, 1, tmp_path, SwapMode.DRAIN)
        await until(lambda: not gate.is_open, 10, "the gate to close")
        report = await _env_report(js, "env-t")
        assert report is not None and report.state is EnvPolicyState.DRAINING and report.running == 1
        waiting = asyncio.create_task(gate.admit(stopping))  # a work item taken before: it waits, held
        await until(lambda: gate.held == 1, 5, "the item held at the gate")
        assert not waiting.done()
        gate.finished()

        async def drained() -> bool:
            r = await _env_report(js, "env-t")
            return r is not None and r.state is EnvPolicyState.DRAINED and r.drained_for == 1

        await until(drained, 5, "drained for version 1")
        began = time.monotonic()
        assert await asyncio.wait_for(waiting, 10), "the held item starts once the gate reopens"
        assert time.monotonic() - began < 3 and gate.is_open, "opened by its 2 s timeout: 'stuck' never serves 1"
        assert gate.metrics is not None
        assert gate.metrics.registry.get_sample_value("rollout_policy_pause_timeouts_total") == 1
        assert gate.running == 1 and gate.held == 0
    finally:
        await gate.stop()
    assert await _env_report(js, "env-t") is None, "a stopped env worker removes its report"


async def test_nobody_waits_for_workers_that_are_not_live(nc: bus.NATS, model_dir: str, tmp_path: Path) -> None:
    js = nc.jetstream()
    # an inference worker's report whose heartbeats stopped (not live): an env worker does not hold back for it
    await _put_worker(js, "gone", serving=0, version=0, state=WorkerPolicyState.SERVING)
    gate = _gate(js, alive=lambda _w: False)
    await gate.start()
    try:
        await _put_announcement(js, 1, checkpoint(model_dir, tmp_path / "v1"), SwapMode.DRAIN)
        await until(lambda: gate.known == 1, 10, "the announcement")
        assert gate.is_open and gate.pauses == 0
    finally:
        await gate.stop()  # and its report is gone: inference workers do not wait for it

    # an inference worker with no env worker alive swaps at once
    policy = PolicyBus(js)
    episodes = policy.reports(POLICY_ENV_BUCKET, EnvPolicyReport)
    await episodes.start()
    engine = FakeEngine(model_dir)
    await engine.start()
    weights = Weights(engine, 0)
    follower = PolicyFollower(policy, weights, "inf-t", 1.0, episode_drain=EpisodeDrain(episodes, timeout_s=30))
    try:
        await follower.start()  # serves 1 from the start: a starting worker waits for nobody
        assert weights.serving == 1
        began = time.monotonic()
        await _put_announcement(js, 2, checkpoint(model_dir, tmp_path / "v2"), SwapMode.DRAIN)
        await until(lambda: weights.serving == 2, 10, "version 2")
        assert time.monotonic() - began < 3
        assert follower.last_episode_drain_s is not None and follower.last_episode_drain_s < 1
    finally:
        await follower.stop()
        await episodes.stop()
        await engine.stop()


async def test_an_inference_worker_swaps_once_every_live_env_worker_drained(nc: bus.NATS, model_dir: str,
                                                                            tmp_path: Path) -> None:
    js = nc.jetstream()
    gates = [EpisodeGate(PolicyBus(js), f"env-{i}", drain_timeout_s=60, report_s=1.0, alive=lambda w: w == "inf-t")
             for i in range(2)]
    policy = PolicyBus(js)
    episodes = policy.reports(POLICY_ENV_BUCKET, EnvPolicyReport)
    engine = FakeEngine(model_dir)
    await engine.start()
    weights = Weights(engine, 0)
    follower = PolicyFollower(policy, weights, "inf-t", 1.0, episode_drain=EpisodeDrain(episodes, timeout_s=60))
    stopping = asyncio.Event()
    try:
        await episodes.start()
        await follower.start()
        for gate in gates:
            await gate.start()
        await until(lambda: len(episodes.live()) == 2 and "inf-t" in gates[1].workers.live(), 10, "both reports")
        assert await gates[0].admit(stopping) and await gates[1].admit(stopping)
        await _put_announcement(js, 1, checkpoint(model_dir, tmp_path / "v1"), SwapMode.DRAIN)
        await until(lambda: not gates[0].is_open and not gates[1].is_open, 10, "both gates closed")
        closed = time.monotonic()
        seen: list[int] = []
        episodes.on_change(lambda: seen.append(1))  # each report the follower's mirror takes in
        gates[0].finished()

        def env0_drained() -> bool:
            r = episodes.live().get(gates[0].worker_id)
            return r is not None and r.state is EnvPolicyState.DRAINED and r.drained_for == 1

        await until(env0_drained, 10, "the follower's mirror to show env-0 drained")
        # two more reports (each gate reports every second): the follower re-checked with env-0 drained since
        after = len(seen) + 2
        await until(lambda: len(seen) >= after, 10, "two more env reports in the follower's mirror")
        assert weights.serving == 0 and follower.state is WorkerPolicyState.ANNOUNCED, "env-1 still runs one"
        held_s = time.monotonic() - closed
        gates[1].finished()
        await until(lambda: weights.serving == 1, 10, "the swap once both drained")
        await until(lambda: gates[0].is_open and gates[1].is_open, 10, "both gates open once 1 serves")
        assert all(g.last_pause_s is not None and g.last_pause_s >= held_s for g in gates), "paused until 1 served"
        assert all(g.metrics is None for g in gates)
        states: list[Any] = [await _env_report(js, g.worker_id) for g in gates]
        assert all(s is not None and s.state is EnvPolicyState.RUNNING and s.drained_for == 1 for s in states)
    finally:
        for gate in gates:
            await gate.stop()
        await follower.stop()
        await episodes.stop()
        await engine.stop()
