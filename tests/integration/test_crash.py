"""Crash semantics, each shown by killing a real process with a signal (SIGKILL: nothing drains).

- env worker killed mid-episode: redelivered, finished as a new attempt, one trajectory, older rows superseded;
- inference worker killed mid-request: the turn is retried on another worker; with none left past the budget,
  the episode fails with class ``inference``;
- recorder killed: after a restart no event is lost and no row is duplicated.
"""

from __future__ import annotations

import asyncio

import httpx

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import EVENTS_STREAM, event_subject
from tests.helpers import AUTH, Sql, metric, wait_for
from tests.integration.test_pipeline import check_token_exact


def post(url: str, **body: object) -> str:
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, json=body, timeout=30)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["batch_id"])


def batch(url: str, batch_id: str) -> dict[str, object]:
    return httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()  # type: ignore[no-any-return]


def wait_done(url: str, batch_id: str, timeout_s: float) -> dict[str, object]:
    return wait_for(lambda: (b := batch(url, batch_id))["done"] and b, timeout_s, f"batch {batch_id} done")


def test_env_worker_killed_mid_episode(stack: Stack, database_url: str) -> None:
    # 0.2 s per turn, 6 turns: an episode takes >1 s, so a kill lands mid-episode.
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.2")
    victim = stack.start("env-worker", name="env-worker-a", ROLLOUT_ACK_WAIT_S="3")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="fixed-turns", tasks=[{"turns": 6}] * 4, group_size=1, max_turns=6,
                    sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        # Read the worker itself (the recorder may lag): 4 turns done, episodes still in flight -> kill now.
        wait_for(lambda: metric(victim.url, "rollout_turn_latency_seconds_count") >= 4
                 and metric(victim.url, "rollout_episodes_in_flight") >= 1, 30, "episodes mid-way on the victim")
        victim.kill()
        assert batch(url, batch_id)["done"] is False
        stack.start("env-worker", name="env-worker-b", ROLLOUT_ACK_WAIT_S="3")
        info = wait_done(url, batch_id, 60)
        assert info["counts"] == {**info["counts"], "completed": 4}  # type: ignore[dict-item]
        assert sql.scalar("select count(*) from trajectories where batch_id = :b", b=batch_id) == 4
        retried = sql.rows("select id, attempt from episodes where batch_id = :b and attempt > 1", b=batch_id)
        assert retried, "the killed worker's episodes ran again as a new attempt"
        cut_mid_way = 0
        for ep in retried:
            # earlier attempts' rows are kept for inspection; the turns the new attempt carried over (resume: its
            # steps name them) are part of the trajectory, every other one is superseded (an episode the victim had
            # fetched but not yet asked a turn for has no earlier rows at all)
            old = sql.rows("select t.superseded, exists (select 1 from steps k where k.turn_event_id = t.event_id "
                           "and k.attempt = :a) as carried from turns t where t.episode_id = :e and t.attempt < :a",
                           e=ep["id"], a=ep["attempt"])
            assert all(r["superseded"] != r["carried"] for r in old)
            # the earlier attempt's steps are superseded: the new attempt's own steps (copies) keep the turns
            assert all(r["superseded"] for r in sql.rows(
                "select superseded from steps where episode_id = :e and attempt < :a", e=ep["id"], a=ep["attempt"]))
            cut_mid_way += bool(old)
            assert sql.scalar("select attempt from trajectories where episode_id = :e", e=ep["id"]) == ep["attempt"]
        # 4 turns were done and none of the episodes (6 turns each) had finished: some were cut mid-way
        assert cut_mid_way >= 1
        assert check_token_exact(sql, batch_id) == 4
    finally:
        sql.close()


def test_inference_worker_killed_mid_request_is_retried_elsewhere(stack: Stack, database_url: str) -> None:
    victim = stack.start("inference-worker", name="inference-a", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="1.0")
    stack.start("inference-worker", name="inference-b", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="1.0")
    env_worker = stack.start("env-worker")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="fixed-turns", tasks=[{"turns": 3}] * 8, group_size=1, max_turns=3,
                    sampling={"max_tokens": 8})
    wait_for(lambda: metric(victim.url, "rollout_inference_inflight") > 0, 30, "requests in flight on the victim")
    victim.kill()
    info = wait_done(url, batch_id, 90)
    assert info["counts"]["completed"] == 8  # type: ignore[index]
    assert metric(env_worker.url, "rollout_inference_retries_total") >= 1
    sql = Sql(database_url)
    try:
        assert check_token_exact(sql, batch_id) == 8
        # nothing the dead worker started is in a trajectory
        assert sql.scalar("select count(*) from turns where worker_id = 'inference-a' and not superseded and "
                          "event_id not in (select turn_event_id from steps)") == 0
    finally:
        sql.close()


def test_inference_budget_exhausted_fails_with_class_inference(stack: Stack, database_url: str) -> None:
    only: ServiceProcess = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="2.0")
    stack.start("env-worker", ROLLOUT_INFERENCE_MAX_TRIES="2", ROLLOUT_INFERENCE_BACKOFF_S="0.2")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="arithmetic", tasks=[{"seed": i} for i in range(3)], group_size=1, max_turns=1)
    wait_for(lambda: metric(only.url, "rollout_inference_inflight") >= 3, 30, "all requests in flight")
    only.kill()
    info = wait_done(url, batch_id, 60)
    assert info["counts"]["failed"] == 3  # type: ignore[index]
    sql = Sql(database_url)
    try:
        rows = sql.rows("select failure_class, failure_reason from episodes where batch_id = :b", b=batch_id)
        assert {r["failure_class"] for r in rows} == {"inference"}
        assert all(r["failure_reason"] for r in rows)
    finally:
        sql.close()


async def _turn_events_in_stream(nats_url: str) -> int:
    nc = await bus.connect(nats_url, name="tests")
    try:
        info = await nc.jetstream().stream_info(EVENTS_STREAM, subjects_filter=event_subject("turn.generated"))
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


def test_recorder_killed_loses_nothing_and_duplicates_nothing(stack: Stack, database_url: str,
                                                              nats_url: str) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    stack.start("env-worker")
    recorder = stack.start("recorder", name="recorder-1")
    url = stack.start("scheduler").url
    batch_id = post(url, env="fixed-turns", tasks=[{"turns": 4}] * 60, group_size=2, max_turns=4,
                    sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        wait_for(lambda: sql.scalar("select count(*) from turns") >= 40, 60, "recorder writing")
        recorder.kill()
        stack.start("recorder", name="recorder-2")
        wait_done(url, batch_id, 120)
        wait_for(lambda: sql.scalar("select count(*) from trajectories where batch_id = :b", b=batch_id) == 120,
                 60, "every trajectory")
        published = asyncio.run(_turn_events_in_stream(nats_url))
        assert sql.scalar("select count(*) from turns") == published == 120 * 4
        assert sql.scalar("select count(*) from steps") == 120 * 4
        assert check_token_exact(sql, batch_id) == 120
    finally:
        sql.close()
