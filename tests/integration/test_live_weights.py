"""Live policy updates through the whole pipeline (issue 15, part 2) on the fake engine, as real processes: a trainer
announces versions while a batch runs; the inference worker swaps its engine's weights without a restart (drain,
then abort), every turn records the version that generated it, drain gives no episode spanning the two versions
(the env worker starts no new episode until the new version serves, the inference worker swaps once the running
ones finished), abort gives mixed episodes recorded per turn, a checkpoint of another architecture is refused
while the old version keeps serving, a worker started later serves the current version, and a worker killed during
a load comes back serving it. The real engine's swap (vLLM reloading weights) has its e2e test in tests/e2e."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.selection import Selection
from rollout_ledger.services.exporter.export import export
from tests.helpers import AUTH, Sql, metric, wait_for
from tests.integration.test_pipeline import check_token_exact
from tests.unit.test_weight_swap import checkpoint


def _worker(url: str, worker_id: str) -> dict[str, Any] | None:
    for w in httpx.get(f"{url}/v1/policy", headers=AUTH, timeout=10).json()["workers"]:
        if w["worker_id"] == worker_id:
            return dict(w)
    return None


def _announce(url: str, version: int, ckpt: Path, mode: str) -> None:
    r = httpx.post(f"{url}/v1/policy/versions", headers=AUTH,
                   json={"version": version, "checkpoint": str(ckpt), "mode": mode}, timeout=10)
    assert r.status_code == 201, r.text


def _until_state(url: str, worker_id: str, version: int, state: str, timeout_s: float = 30) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        w = _worker(url, worker_id)
        return w if w is not None and w["version"] == version and w["state"] == state else None

    return wait_for(ready, timeout_s, f"{worker_id} to report {state} for version {version}")


def test_versions_swap_live_while_a_batch_runs(stack: Stack, database_url: str, model_dir: str,
                                              tmp_path: Path) -> None:
    # 0.1-0.3 s a turn (0.2 on average): the jitter lets the episodes of a wave drift apart, so generations are
    # in flight at any moment of a wave. Without it, episodes started together stayed in step, and an abort could
    # land in the gap between two of their turns and cut nothing (CI saw it once, on a busy machine).
    inf = stack.start("inference-worker", name="inf-a", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.1",
                      ROLLOUT_FAKE_DELAY_JITTER_S="0.2", ROLLOUT_FAKE_LOAD_S="0.5", ROLLOUT_POLICY_REPORT_S="1")
    env = stack.start("env-worker", ROLLOUT_CONCURRENCY="16", ROLLOUT_POLICY_REPORT_S="1")
    stack.start("recorder")
    url = stack.start("scheduler").url
    assert _until_state(url, "inf-a", 0, "serving", timeout_s=10)["serving"] == 0  # reports are eventual
    r = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        # Three waves of 16 episodes of 24 turns (~4.8 s a wave; the drain of version 1 lines them up). The abort
        # is announced once the recorder shows an episode of the third wave at turn 1-3 and no further: it still
        # has ~4 s of turns to generate, margin for the recorder's lag behind the workers under load.
        "env": "fixed-turns", "tasks": [{"turns": 24}] * 24, "group_size": 2, "max_turns": 24,
        "sampling": {"max_tokens": 8}})
    assert r.status_code == 201, r.text
    batch_id = r.json()["batch_id"]
    sql = Sql(database_url)
    try:
        wait_for(lambda: sql.scalar("select count(*) from turns") >= 24, 60, "turns on version 0")
        _announce(url, 1, checkpoint(model_dir, tmp_path / "v1"), "drain")
        _until_state(url, "inf-a", 1, "serving")
        swapped_1 = time.time()
        wait_for(lambda: sql.scalar("select count(*) from turns where weight_version = 1") >= 24, 60,
                 "turns on version 1")
        wait_for(lambda: sql.scalar("select count(*) from trajectories where action_versions <@ array[1]"), 60,
                 "an episode wholly on version 1")
        # "no turn past 3": an episode that has finished but whose end the recorder has not stored yet still reads
        # 'running'; without this the abort could land between two waves, and no episode would span it
        wait_for(lambda: sql.scalar("select count(*) from episodes e where e.status = 'running' and exists (select "
                                    "from turns t where t.episode_id = e.id and t.weight_version = 1 "
                                    "and t.turn_index between 1 and 3) and not exists (select from turns t "
                                    "where t.episode_id = e.id and t.turn_index > 3)"), 60,
                 "episodes in the middle of their turns on version 1 (the abort cuts them)")
        wait_for(lambda: metric(inf.url, "rollout_inference_inflight") >= 4, 10, "generations in flight")
        _announce(url, 2, checkpoint(model_dir, tmp_path / "v2"), "abort")
        _until_state(url, "inf-a", 2, "serving")
        _announce(url, 3, checkpoint(model_dir, tmp_path / "v3", vocab_size=7), "drain")
        refused = _until_state(url, "inf-a", 3, "failed")
        assert refused["serving"] == 2 and "vocab_size" in refused["error"]

        def done() -> bool:
            return bool(httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"])

        wait_for(done, 120, "the batch")
        statuses = {r["status"] for r in sql.rows("select distinct status from episodes")}
        assert statuses == {"completed"}, statuses
        assert check_token_exact(sql, batch_id) == 48
        versions = {r["v"] for r in sql.rows("select distinct weight_version as v from turns where not superseded")}
        assert versions == {0, 1, 2}, "every turn carries the version that generated it; 3 was refused"
        late = sql.scalar("select count(*) from turns where produced_at > to_timestamp(:t) and weight_version < 1",
                          t=swapped_1 + 0.5)
        assert late == 0, "once version 1 serves, no turn is generated on version 0"
        backwards = sql.scalar("""
            select count(*) from turns a join turns b
              on a.episode_id = b.episode_id and a.attempt = b.attempt and b.turn_index = a.turn_index + 1
            where not a.superseded and not b.superseded and b.weight_version < a.weight_version""")
        assert backwards == 0, "an episode's versions never go backwards"
        mixed = sql.scalar("select count(*) from trajectories where cardinality(array(select distinct unnest("
                           "action_versions))) > 1")
        assert mixed > 0, "episodes that ran across the abort swap span versions, recorded per turn"
        across_drain = sql.scalar("select count(*) from trajectories where action_versions @> array[0] "
                                  "and action_versions @> array[1]")
        assert across_drain == 0, "drain: no episode spans versions 0 and 1"
        on_0, on_1 = (sql.scalar("select count(*) from trajectories "
                                 "where action_versions <@ array[cast(:v as integer)]", v=v) for v in (0, 1))
        assert on_0 > 0 and on_1 > 0, "episodes ran wholly on version 0 before the drain and on 1 after it"
        spans = sql.rows("select episode_id, min_version, max_version, version_span, mixed_versions "
                         "from v_trajectory_versions order by version_span desc")
        assert len(spans) == 48 and sum(r["mixed_versions"] for r in spans) == mixed
        assert {(r["min_version"], r["max_version"]) for r in spans if r["mixed_versions"]} == {(1, 2)}, (
            "only the abort swap (1 -> 2) cut episodes in flight")
        widest = spans[0]
        assert widest["mixed_versions"] and widest["version_span"] == widest["max_version"] - widest["min_version"] > 0
        shown = httpx.get(f"{url}/v1/episodes/{widest['episode_id']}/trajectory", headers=AUTH, timeout=10).json()
        assert (shown["min_weight_version"], shown["max_weight_version"], shown["mixed_versions"]) == (
            widest["min_version"], widest["max_version"], True)
        assert metric(inf.url, "rollout_inference_regenerated_total") > 0, "the abort swap cut turns in flight"
        assert metric(inf.url, "rollout_episode_drain_seconds_count") == 1, "the drain swap waited for episodes"
        assert metric(inf.url, "rollout_episode_drain_timeouts_total") == 0
        assert metric(env.url, "rollout_policy_pause_seconds_count") >= 1, "the env worker held episodes back"
        assert metric(env.url, "rollout_policy_pause_timeouts_total") == 0
        assert metric(inf.url, "rollout_weight_version") == 2
        states = {(r["version"], r["state"]) for r in sql.rows(
            "select version, state from policy_worker_states where worker_id = 'inf-a'")}
        assert states == {(0, "retired"), (1, "retired"), (2, "serving"), (3, "failed")}
        assert inf.alive

        # a worker that starts now serves the newest version it can load from its first turn: 2, since the
        # current one (3) is refused
        late_worker = stack.start("inference-worker", name="inf-b", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_LOAD_S="0.2",
                                  ROLLOUT_POLICY_REPORT_S="1")
        assert _until_state(url, "inf-b", 3, "failed", timeout_s=10)["serving"] == 2
        assert metric(late_worker.url, "rollout_weight_version") == 2

        # a worker killed in the middle of a load comes back serving the announced version
        slow = stack.start("inference-worker", name="inf-c", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_LOAD_S="4",
                           ROLLOUT_POLICY_REPORT_S="1")
        _announce(url, 4, checkpoint(model_dir, tmp_path / "v4"), "drain")
        _until_state(url, "inf-c", 4, "loading")
        slow.kill()
        again = stack.start("inference-worker", name="inf-c", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_LOAD_S="0.2",
                            ROLLOUT_POLICY_REPORT_S="1")
        assert _until_state(url, "inf-c", 4, "serving", timeout_s=10)["serving"] == 4
        assert metric(again.url, "rollout_weight_version") == 4

        # a worker that stops (SIGTERM, drained) takes its report with it: admission and the env workers' drain do
        # not count a version nobody serves any more until the bucket's TTL would expire it
        assert _worker(url, "inf-b") is not None
        assert late_worker.stop() == 0
        assert _worker(url, "inf-b") is None, "the stopped worker's report is gone at once"
    finally:
        sql.close()


def test_keep_carries_the_turns_in_flight_across_the_swap(stack: Stack, database_url: str, model_dir: str,
                                                         tmp_path: Path) -> None:
    # 1-1.5 s a turn: a keep swap cuts generations mid-way; what they sampled stays, the rest comes from version 1
    inf = stack.start("inference-worker", name="inf-k", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="1.0",
                      ROLLOUT_FAKE_DELAY_JITTER_S="0.5", ROLLOUT_FAKE_LOAD_S="0.2", ROLLOUT_POLICY_REPORT_S="1")
    stack.start("env-worker", ROLLOUT_POLICY_REPORT_S="1")
    stack.start("recorder")
    url = stack.start("scheduler").url
    assert _until_state(url, "inf-k", 0, "serving", timeout_s=10)["serving"] == 0
    episodes, turns = 8, 4
    r = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "fixed-turns", "tasks": [{"turns": turns}] * episodes, "group_size": 1, "max_turns": turns,
        "sampling": {"max_tokens": 32}})
    assert r.status_code == 201, r.text
    batch_id = r.json()["batch_id"]
    sql = Sql(database_url)
    try:
        wait_for(lambda: sql.scalar("select count(*) from turns") >= episodes, 60, "a turn of each episode")
        # a generation 0.3 s into its 1-1.5 s: the swap cuts it with ids sampled by version 0
        wait_for(lambda: metric(inf.url, "rollout_inference_oldest_generation_seconds") >= 0.3, 10,
                 "a generation under way")
        _announce(url, 1, checkpoint(model_dir, tmp_path / "v1"), "keep")
        _until_state(url, "inf-k", 1, "serving")

        def done() -> bool:
            return bool(httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"])

        wait_for(done, 120, "the batch")
        statuses = {r["status"] for r in sql.rows("select distinct status from episodes where batch_id = :b",
                                                  b=batch_id)}
        assert statuses == {"completed"}, "no episode aborted or failed by the update"
        assert check_token_exact(sql, batch_id) == episodes  # version runs split the action ranges, checked there
        straddled = sql.rows("select token_ids, weight_version, version_runs from turns where version_runs is not null")
        assert straddled, "turns in flight at the swap carry both versions"
        for t in straddled:
            (start0, v0), (start1, v1) = t["version_runs"]
            assert (start0, v0, v1) == (0, 0, 1) and 0 < start1 < len(t["token_ids"]), t["version_runs"]
            assert t["weight_version"] == 0, "weight_version is the turn's oldest version"
        # nothing generated twice: one turn row per turn, nothing regenerated, no sampled id lost
        assert sql.scalar("select count(*) from turns") == episodes * turns
        assert metric(inf.url, "rollout_inference_regenerated_total") == 0
        assert metric(inf.url, "rollout_swap_tokens_total", {"fate": "lost"}) == 0
        kept = metric(inf.url, "rollout_swap_tokens_total", {"fate": "kept"})
        assert kept == sum(t["version_runs"][1][0] for t in straddled)
        mixed = sql.scalar("select count(*) from trajectories where batch_id = :b and action_versions @> array[0] "
                           "and action_versions @> array[1]", b=batch_id)
        assert mixed > 0, "trajectories whose turns span both versions"
        # every export's version fields follow the runs: the full record per token, the sample shapes per sample
        stored = {r["episode_id"]: r["weight_versions"] for r in sql.rows(
            "select episode_id, weight_versions from trajectories where batch_id = :b", b=batch_id)}
        sel = Selection(batch_ids=(batch_id,))
        full = [orjson.loads(line) for line in export(database_url, sel, tmp_path / "full.jsonl", "jsonl")
                .path.read_text().splitlines()]
        assert {r["episode_id"]: r["weight_versions"] for r in full} == stored
        for fmt, versions in (("slime", lambda r: {int(v) for v in r["weight_versions"]}),
                              ("openrlhf", lambda r: set(r["extra_logs"]["weight_versions"]))):
            out = export(database_url, sel, tmp_path / f"{fmt}.jsonl", fmt, "jsonl").path
            for r in (orjson.loads(line) for line in out.read_text().splitlines()):
                assert versions(r) == {v for v in stored[r["episode_id"]] if v >= 0}, (fmt, r["episode_id"])
    finally:
        sql.close()
