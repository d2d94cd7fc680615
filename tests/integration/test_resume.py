"""Resume after kill -9: an env worker is killed while its episodes are mid-way; the next attempt starts at the
last recorded turn, carries the recorded turns over (no inference request for them) and only the turn in flight is
generated again. Real processes: scheduler, recorder, inference worker (fake engine), env workers, NATS, Postgres.

- a multi-turn built-in env (``fixed-turns``, replay) and a user env resumed by ``snapshot``;
- an agent function (``agent_replay``: its repeated calls answered from the record);
- a user env that declares itself deterministic but is not: the replay diverges and the attempt restarts at turn 0,
  the reason recorded;
- late events of the killed attempt change nothing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import nats

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.shared.events import EpisodeFinished, StepCompleted, encode
from rollout_ledger.shared.subjects import MSG_ID_HEADER, event_subject
from tests.helpers import AUTH, Sql, metric, wait_for
from tests.integration.test_pipeline import check_token_exact

REPO = str(Path(__file__).resolve().parents[2])
PYTHONPATH = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
USER_ENVS = ("countdown=tests.envs_user:Countdown,pid-talker=tests.envs_user:PidTalker,"
             "snapshot-counter=tests.envs_user:SnapshotCounter")


def post(url: str, **body: object) -> str:
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, json=body, timeout=30)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["batch_id"])


def wait_done(url: str, batch_id: str, timeout_s: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        b = httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()
        return b if b["done"] else None
    return wait_for(done, timeout_s, f"batch {batch_id} done")


def env_worker(stack: Stack, name: str, **extra: str) -> ServiceProcess:
    return stack.start("env-worker", name=name, ROLLOUT_ACK_WAIT_S="3", ROLLOUT_ENV_CLASSES=USER_ENVS,
                       PYTHONPATH=PYTHONPATH, **extra)


def recorded_steps(sql: Sql, batch_id: str, k: int) -> int:
    return int(sql.scalar("select count(*) from (select s.episode_id from steps s join episodes e on "
                          "e.id = s.episode_id where e.batch_id = :b group by s.episode_id having count(*) >= :k) x",
                          b=batch_id, k=k))


def check_resumed(sql: Sql, batch_id: str, mode: str, turns: int) -> list[dict[str, Any]]:
    """Every episode ran a second attempt that resumed in ``mode``; its carried-over turns are the recorded ones
    (same turn rows, generated once), and only the turns in flight at the kill were generated again."""
    resumes = sql.rows("select * from attempt_resumes where batch_id = :b order by episode_id", b=batch_id)
    assert resumes, "no attempt resumed"
    for r in resumes:
        assert r["mode"] == mode, r
        assert r["from_attempt"] == r["attempt"] - 1 and r["turns_recorded"] >= 1, r
        ep = r["episode_id"]
        reused = sql.rows("select turn_index, turn_event_id, reused_from from steps where episode_id = :e and "
                          "attempt = :a and reused_from is not null order by turn_index", e=ep, a=r["attempt"])
        assert [s["turn_index"] for s in reused] == list(range(r["turns_recorded"]))
        if mode != "agent_replay":
            assert r["turns_reused"] == r["turns_recorded"], r
        for s in reused:  # the kept turn is the one the killed attempt generated, named, not generated again
            assert f":a{r['from_attempt']}:t{s['turn_index']}:" in s["turn_event_id"]
            assert s["reused_from"].endswith(f":a{r['from_attempt']}:s{s['turn_index']}")
        # turn t < turns_recorded was generated exactly once over both attempts
        generated = sql.rows("select turn_index, count(*) as n from turns where episode_id = :e group by turn_index "
                             "order by turn_index", e=ep)
        assert len(generated) == turns
        for g in generated[: r["turns_recorded"]]:
            assert g["n"] == 1, (ep, g)
        # what the killed attempt generated after its last recorded step is all that was generated again
        again = sum(g["n"] - 1 for g in generated)
        assert again == r["turns_unstepped"], (ep, again, r)
        old = sql.rows("select turn_index, superseded from turns where episode_id = :e and attempt = :a",
                       e=ep, a=r["from_attempt"])
        assert all(o["superseded"] == (o["turn_index"] >= r["turns_recorded"]) for o in old), old
    return resumes


def test_env_worker_killed_mid_episode_resumes_at_the_last_recorded_turn(stack: Stack, database_url: str) -> None:
    inference = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.25")
    victim = env_worker(stack, "env-worker-a")
    stack.start("recorder")
    url = stack.start("scheduler").url
    turns, episodes = 16, 3  # killed after 3 recorded steps: ~3 s of turns left, margin for the recorder's lag
    batch_id = post(url, env="fixed-turns", tasks=[{"turns": turns}] * episodes, group_size=1, max_turns=turns,
                    sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        wait_for(lambda: recorded_steps(sql, batch_id, 3) == episodes, 60, "3 steps recorded for every episode")
        victim.kill()
        env_worker(stack, "env-worker-b")
        info = wait_done(url, batch_id, 90)
        assert info["counts"] == {**info["counts"], "completed": episodes}
        assert check_token_exact(sql, batch_id) == episodes
        resumes = check_resumed(sql, batch_id, "replay", turns)
        assert len(resumes) == episodes
        # the inference worker served every turn once, plus the turns in flight at the kill
        served = metric(inference.url, "rollout_inference_requests_total", {"outcome": "ok"})
        assert served == episodes * turns + sum(r["turns_unstepped"] for r in resumes)

        # late events of the killed attempt change nothing
        ep = resumes[0]["episode_id"]
        before = sql.rows("select token_ids, attempt, reward from trajectories where episode_id = :e", e=ep)[0]
        late_step = StepCompleted(event_id=f"{ep}:a1:s{turns - 1}", episode_id=ep, batch_id=batch_id, attempt=1,
                                  seq=2 * turns, produced_by="env-worker/env-worker-a", turn_index=turns - 1,
                                  turn_event_id=f"{ep}:a1:t0:r0", action="late", observation="",
                                  observation_token_ids=[1, 2, 3], reward=5.0, terminated=True, truncated=False)
        late_end = EpisodeFinished(event_id=f"{ep}:a1:end", episode_id=ep, batch_id=batch_id, attempt=1,
                                   seq=2 * turns + 1, produced_by="env-worker/env-worker-a", status="completed",
                                   reward=5.0, num_turns=turns, num_tokens=1)

        async def publish_late() -> None:
            nc = await nats.connect(stack.nats_url)
            js = nc.jetstream()
            for ev in (late_step, late_end):
                await js.publish(event_subject(ev.type), encode(ev), headers={MSG_ID_HEADER: ev.event_id})
            await nc.close()

        asyncio.run(publish_late())
        wait_for(lambda: sql.scalar("select count(*) from steps where event_id = :i", i=late_step.event_id) == 1,
                 30, "the late step stored")
        wait_for(lambda: sql.scalar("select superseded from steps where event_id = :i", i=late_step.event_id),
                 30, "the late step superseded")
        after = sql.rows("select token_ids, attempt, reward from trajectories where episode_id = :e", e=ep)[0]
        assert after == before
        assert sql.scalar("select status from episodes where id = :e", e=ep) == "completed"
    finally:
        sql.close()


def test_snapshot_env_restores_its_state_instead_of_replaying(stack: Stack, database_url: str) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.25")
    victim = env_worker(stack, "env-worker-a")
    stack.start("recorder")
    url = stack.start("scheduler").url
    turns = 12
    batch_id = post(url, env="snapshot-counter", tasks=[{"turns": turns}] * 2, group_size=1, max_turns=turns,
                    sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        wait_for(lambda: recorded_steps(sql, batch_id, 2) == 2, 60, "2 steps recorded for every episode")
        victim.kill()
        env_worker(stack, "env-worker-b")
        wait_done(url, batch_id, 90)
        assert check_token_exact(sql, batch_id) == 2
        resumes = check_resumed(sql, batch_id, "snapshot", turns)
        for r in resumes:
            # the live steps after the resume were taken by an env that restored once and replayed nothing
            live = sql.rows("select info from steps where episode_id = :e and attempt = :a and reused_from is null",
                            e=r["episode_id"], a=r["attempt"])
            assert live and all(s["info"]["restored"] == 1 for s in live)
            assert sql.scalar("select status from episodes where id = :e", e=r["episode_id"]) == "completed"
    finally:
        sql.close()


def test_a_replay_that_diverges_restarts_with_the_reason_recorded(stack: Stack, database_url: str) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.25")
    victim = env_worker(stack, "env-worker-a")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="pid-talker", tasks=[{"turns": 12}], group_size=1, max_turns=12,
                    sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        wait_for(lambda: recorded_steps(sql, batch_id, 2) == 1, 60, "2 steps recorded")
        victim.kill()
        env_worker(stack, "env-worker-b")
        wait_done(url, batch_id, 90)
        assert check_token_exact(sql, batch_id) == 1
        r = sql.rows("select * from attempt_resumes where batch_id = :b", b=batch_id)[0]
        assert r["mode"] == "restart" and r["turns_recorded"] >= 2
        assert r["reason"].startswith("replay diverged: turn 0: the observation differs"), r["reason"]
        # a restart keeps nothing of the earlier attempt: every turn of the trajectory is its own
        kept = sql.rows("select turn_event_id, reused_from from steps where episode_id = :e and attempt = :a",
                        e=r["episode_id"], a=r["attempt"])
        assert all(k["reused_from"] is None and f":a{r['attempt']}:" in k["turn_event_id"] for k in kept)
    finally:
        sql.close()


def test_an_agent_function_is_resumed_by_answering_its_repeated_calls(stack: Stack, database_url: str) -> None:
    inference = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.25")
    agents = {"ROLLOUT_AGENTS": "counting=tests.agents:counting", "ROLLOUT_ENVS": "fixed-turns"}
    victim = env_worker(stack, "env-worker-a", **agents)
    stack.start("recorder")
    url = stack.start("scheduler").url
    calls = 12
    batch_id = post(url, env="counting", tasks=[{"calls": calls}] * 2, group_size=1, max_turns=calls + 2,
                    sampling={"max_tokens": 8, "temperature": 0})
    sql = Sql(database_url)
    try:
        wait_for(lambda: recorded_steps(sql, batch_id, 2) == 2, 60, "2 steps recorded for every episode")
        victim.kill()
        env_worker(stack, "env-worker-b", **agents)
        info = wait_done(url, batch_id, 90)
        assert info["counts"] == {**info["counts"], "completed": 2}
        assert check_token_exact(sql, batch_id) == 2
        resumes = check_resumed(sql, batch_id, "agent_replay", calls)
        served = metric(inference.url, "rollout_inference_requests_total", {"outcome": "ok"})
        assert served == 2 * calls + sum(r["turns_unstepped"] for r in resumes)
    finally:
        sql.close()


def test_tau2_mock_is_resumed_by_replay_with_the_recorded_user(stack: Stack, database_url: str) -> None:
    """τ²'s mock domain on the fake engine (policy and simulated user): after the kill, the next attempt replays the
    recorded turns with the user's recorded replies; the user is asked again only after live turns."""
    inference = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.25")
    tau2 = {"ROLLOUT_TAU2_DOMAINS": "mock", "ROLLOUT_MAX_MODEL_LEN": "32768"}
    victim = env_worker(stack, "env-worker-a", **tau2)
    stack.start("recorder")
    url = stack.start("scheduler").url
    turns = 12
    batch_id = post(url, env="tau2:mock", tasks=[{"task_id": "create_task_1"}, {"task_id": "update_task_1"}],
                    group_size=1, max_turns=turns, sampling={"max_tokens": 16})
    sql = Sql(database_url)
    try:
        wait_for(lambda: recorded_steps(sql, batch_id, 2) == 2, 90, "2 steps recorded for every episode")
        unrecorded = metric(inference.url, "rollout_inference_unrecorded_total")  # the user's generations so far
        victim.kill()
        env_worker(stack, "env-worker-b", **tau2)
        wait_done(url, batch_id, 120)
        assert check_token_exact(sql, batch_id) == 2
        resumes = sql.rows("select * from attempt_resumes where batch_id = :b", b=batch_id)
        assert resumes and all(r["mode"] == "replay" and r["turns_reused"] >= 2 for r in resumes), resumes
        for r in resumes:
            kept = sql.rows("select turn_index, reused_from, info from steps where episode_id = :e and attempt = :a "
                            "order by turn_index", e=r["episode_id"], a=r["attempt"])
            assert all(k["reused_from"] for k in kept[: r["turns_reused"]])
            assert kept[0]["info"].get("env_llm_reset"), "the user's opening line is journaled with turn 0"
            generated = sql.rows("select turn_index, count(*) as n from turns where episode_id = :e "
                                 "group by turn_index order by turn_index", e=r["episode_id"])
            assert all(g["n"] == 1 for g in generated[: r["turns_reused"]]), generated
        # the user's replies of the replayed steps came from the record: every user generation after the kill
        # answers a live turn of the resumed attempts (or of an attempt that had not been cut)
        live_steps = sql.scalar("select count(*) from steps s join episodes e on e.id = s.episode_id where "
                                "e.batch_id = :b and s.attempt = e.attempt and s.reused_from is null "
                                "and s.attempt > 1", b=batch_id)
        asked = metric(inference.url, "rollout_inference_unrecorded_total") - unrecorded
        assert asked <= live_steps, (asked, live_steps)
    finally:
        sql.close()


def test_a_single_turn_rg_episode_killed_mid_turn_generates_that_turn_again(stack: Stack, database_url: str) -> None:
    """``rg:`` envs are one turn: killed while the turn is in flight, nothing was recorded to carry over; the next
    attempt says so and generates only that turn again."""
    inference = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="4.0")
    victim = env_worker(stack, "env-worker-a")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="rg:basic_arithmetic", tasks=[{"seed": 1}, {"seed": 2}], group_size=1, max_turns=1,
                    sampling={"max_tokens": 16})
    sql = Sql(database_url)
    try:
        wait_for(lambda: metric(victim.url, "rollout_work_items_held") >= 2
                 and metric(inference.url, "rollout_inference_inflight") >= 2, 60, "both turns in flight")
        victim.kill()
        env_worker(stack, "env-worker-b")
        wait_done(url, batch_id, 90)
        assert check_token_exact(sql, batch_id) == 2
        resumes = sql.rows("select * from attempt_resumes where batch_id = :b", b=batch_id)
        assert len(resumes) == 2
        for r in resumes:
            assert (r["mode"], r["turns_recorded"], r["reason"]) == ("restart", 0, "no turn recorded"), r
            assert r["turns_unstepped"] == 1, "the turn in flight at the kill was generated (and stored)"
            assert sql.scalar("select count(*) from turns where episode_id = :e", e=r["episode_id"]) == 2
    finally:
        sql.close()
