"""The recorder in-process on real NATS + Postgres: events -> rows and trajectories, idempotence, attempts, tries,
dead letters, out-of-order terminal events, Postgres outages and the max-deliveries advisory path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import BaseModel

from rollout_ledger.cli.stack.servers import PrivatePostgres, free_port
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.services.recorder.main import run
from rollout_ledger.services.recorder.settings import RecorderSettings
from rollout_ledger.shared.events import (
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    FailureClass,
    FinishReason,
    SamplingParams,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    decode,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.runtime import Shutdown
from rollout_ledger.shared.subjects import EVENTS_STREAM, RECORDER_CONSUMER, WORK_STREAM, event_subject
from tests.helpers import Sql, metric_async, publish_event, until

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2]


# --- helpers shared with test_recorder_process.py -----------------------------------------------------------------

def seed_episodes(sql: Sql, batch_id: str, num_tasks: int = 1, group_size: int = 1, env: str = "echo") -> list[str]:
    """Insert the batch and episode rows the way the scheduler does before publishing work."""
    with sql.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(text("insert into batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                          "request_hash) values (:b, :env, :g, 4, '{}'::jsonb, :n, :ne, 'x')"),
                     {"b": batch_id, "env": env, "g": group_size, "n": num_tasks, "ne": num_tasks * group_size})
        ids = []
        for t in range(num_tasks):
            for g in range(group_size):
                eid = f"{batch_id}.{t}.{g}"
                ids.append(eid)
                conn.execute(text("insert into episodes (id, batch_id, group_id, group_index, task_index, env, task) "
                                  "values (:e, :b, :grp, :g, :t, :env, '{}'::jsonb)"),
                             {"e": eid, "b": batch_id, "grp": f"{batch_id}.{t}", "g": g, "t": t, "env": env})
    return ids


def episode_events(episode_id: str, turns: Sequence[tuple[list[int], list[int]]], *, attempt: int = 1,
                   prompt: list[int] | None = None, version: int = 3, tries: dict[int, int] | None = None,
                   reward: float = 1.0, terminal: bool = True) -> list[BaseModel]:
    """started, (turn, step) per turn, finished: a token-consistent episode. ``tries[t]`` = kept try of turn t
    (earlier tries are published too, with different ids)."""
    batch_id = episode_id.split(".")[0]
    prompt = list(PROMPT if prompt is None else prompt)
    base = {"episode_id": episode_id, "batch_id": batch_id, "attempt": attempt}
    out: list[BaseModel] = [EpisodeStarted(event_id=f"{episode_id}:a{attempt}:started", seq=0, produced_by="env/w1",
                                           env="echo", worker_id="w1", prompt_token_ids=np.asarray(prompt, "<i4"),
                                           prompt_text="<prompt>", **base)]
    pos = len(prompt)
    for t, (sampled, obs) in enumerate(turns):
        kept_try = (tries or {}).get(t, 1)
        for r in range(1, kept_try + 1):
            ids = sampled if r == kept_try else [7] * (len(sampled) + 1)
            out.append(TurnGenerated(
                event_id=f"{episode_id}:a{attempt}:t{t}:r{r}", request_id=f"{episode_id}:a{attempt}:t{t}:r{r}",
                seq=2 * t + 1, produced_by="inference/i1", turn_index=t, prompt_len=pos,
                token_ids=np.asarray(ids, "<i4"), logprobs=np.asarray([-0.25 - 0.01 * i for i in range(len(ids))],
                                                                      "<f4"),
                finish_reason=FinishReason.STOP, weight_version=version, engine="fake", worker_id="i1",
                queue_ms=1.0, generate_ms=2.0, **base))
        out.append(StepCompleted(
            event_id=f"{episode_id}:a{attempt}:s{t}", seq=2 * t + 2, produced_by="env/w1", turn_index=t,
            turn_event_id=f"{episode_id}:a{attempt}:t{t}:r{kept_try}", action="act", observation="obs",
            observation_token_ids=np.asarray(obs, "<i4"), reward=0.0, terminated=t == len(turns) - 1,
            truncated=False, **base))
        pos += len(sampled) + len(obs)
    if terminal:
        out.append(EpisodeFinished(event_id=f"{episode_id}:a{attempt}:end", seq=2 * len(turns) + 1,
                                   produced_by="env/w1", status=TrajectoryStatus.COMPLETED, reward=reward,
                                   num_turns=len(turns), num_tokens=pos, stop_reason="terminated", **base))
    return out


def env_failed(episode_id: str, batch_id: str, seq: int, reason: str, num_turns: int = 0) -> EpisodeFailed:
    """Attempt 1 of ``episode_id`` failed by its environment (``seq``: after its ``num_turns`` turns)."""
    return EpisodeFailed(event_id=f"{episode_id}:a1:end", episode_id=episode_id, batch_id=batch_id, attempt=1,
                         seq=seq, produced_by="env/w1", failure_class=FailureClass.ENV, reason=reason,
                         num_turns=num_turns)


async def publish(nc: bus.NATS, events: Sequence[BaseModel]) -> None:
    js = nc.jetstream()
    for ev in events:
        await publish_event(js, ev)


def settings_for(nats_url: str, database_url: str, **kw: Any) -> RecorderSettings:
    base: dict[str, Any] = {"nats_url": nats_url, "database_url": database_url, "http_port": free_port(),
                            "http_host": "127.0.0.1", "fetch_timeout_s": 0.2, "assembly_retry_delay_s": 0.2,
                            "retry_initial_s": 0.05, "retry_max_s": 0.5, "pending_poll_s": 0.5}
    base.update(kw)
    return RecorderSettings(**base)


@contextlib.asynccontextmanager
async def recorder(settings: RecorderSettings) -> AsyncIterator[RecorderSettings]:
    """The recorder's ``run`` as a task of this loop; SIGTERM-like stop on exit (must return cleanly)."""
    shutdown = Shutdown()
    task = asyncio.create_task(run(settings, shutdown))
    url = f"http://127.0.0.1:{settings.http_port}/readyz"

    async def ready() -> bool:
        if task.done():
            task.result()
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient() as client:
                return (await client.get(url, timeout=1)).status_code == 200
        return False

    await until(ready, 30, "recorder ready")
    try:
        yield settings
    finally:
        shutdown.event.set()
        await asyncio.wait_for(task, 30)


def snapshot(sql: Sql) -> dict[str, list[dict[str, Any]]]:
    return {
        "episodes": sql.rows("select * from episodes order by id"),
        "turns": sql.rows("select * from turns order by event_id"),
        "steps": sql.rows("select * from steps order by event_id"),
        "trajectories": sql.rows("select * from trajectories order by episode_id"),
        "dead_letters": sql.rows("select source, subject, stream_seq, reason from dead_letters order by id"),
    }


async def drained(nc: bus.NATS) -> bool:
    info = await nc.jetstream().consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
    return info.num_pending == 0 and info.num_ack_pending == 0



# --- tests ---------------------------------------------------------------------------------------------------------

async def test_events_become_rows_and_a_token_exact_trajectory(nc: bus.NATS, nats_url: str, database_url: str,
                                                                sql: Sql) -> None:
    [single, multi] = seed_episodes(sql, "b1", num_tasks=2)
    await publish(nc, episode_events(single, [([10, 11, 12], [2])], reward=0.5))
    await publish(nc, episode_events(multi, [([20, 21], [2, 30, 31, 1]), ([22], [2, 32]), ([23, 24], [])],
                                     version=4))
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("select count(*) from trajectories") == 2, 20, "two trajectories")
        await until(lambda: drained(nc), 10, "consumer drained")

    ep = sql.rows("select * from episodes where id = :e", e=multi)[0]
    assert ep["status"] == "completed" and ep["attempt"] == 1 and ep["reward"] == 1.0 and ep["num_turns"] == 3
    assert ep["weight_versions"] == [4] and ep["prompt_token_ids"] == PROMPT and ep["stop_reason"] == "terminated"
    assert ep["worker_id"] == "w1" and ep["started_at"] is not None and ep["finished_at"] is not None
    tr = sql.rows("select * from trajectories where episode_id = :e", e=multi)[0]
    p = len(PROMPT)
    assert tr["token_ids"] == [*PROMPT, 20, 21, 2, 30, 31, 1, 22, 2, 32, 23, 24]
    assert tr["loss_mask"] == [0] * p + [1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1]
    assert tr["weight_versions"] == [-1] * p + [4, 4, -1, -1, -1, -1, 4, -1, -1, 4, 4]
    assert tr["action_ranges"] == [[p, p + 2], [p + 6, p + 7], [p + 9, p + 11]]
    assert tr["logprobs"][p:p + 2] == pytest.approx([-0.25, -0.26]) and tr["logprobs"][p + 2] == 0.0
    assert (tr["status"], tr["attempt"], tr["num_turns"], tr["num_tokens"], tr["num_sampled_tokens"],
            tr["prompt_len"], tr["group_id"], tr["env"]) == ("completed", 1, 3, p + 11, 5, p, "b1.1", "echo")
    assert sql.scalar("select count(*) from turns where superseded") == 0
    assert sql.scalar("select count(*) from turns") == 4 and sql.scalar("select count(*) from steps") == 4
    single_tr = sql.rows("select reward, token_ids from trajectories where episode_id = :e", e=single)[0]
    assert single_tr["reward"] == 0.5 and single_tr["token_ids"] == [*PROMPT, 10, 11, 12, 2]


async def test_duplicates_and_full_replay_change_nothing(nc: bus.NATS, nats_url: str, database_url: str,
                                                         sql: Sql) -> None:
    eps = seed_episodes(sql, "dup", num_tasks=3)
    events = [ev for e in eps for ev in episode_events(e, [([5, 6], [2, 40]), ([7], [])])]
    await publish(nc, events)
    js = nc.jetstream()
    for ev in events:  # the same events again under other Nats-Msg-Ids: the stream keeps both copies
        event = decode(encode(ev))
        await js.publish(event_subject(event.type), encode(event), headers={"Nats-Msg-Id": f"{event.event_id}:again"})
    settings = settings_for(nats_url, database_url, batch_size=7)
    async with recorder(settings):
        await until(lambda: drained(nc), 20, "consumer drained")
    first = snapshot(sql)
    assert len(first["trajectories"]) == 3 and len(first["turns"]) == 6 and len(first["steps"]) == 6

    await js.delete_consumer(EVENTS_STREAM, RECORDER_CONSUMER)  # the next recorder replays the whole stream
    async with recorder(settings_for(nats_url, database_url, batch_size=500)):
        await until(lambda: drained(nc), 20, "replay drained")
    assert snapshot(sql) == first


async def test_new_attempt_supersedes_older_rows(nc: bus.NATS, nats_url: str, database_url: str, sql: Sql) -> None:
    [ep] = seed_episodes(sql, "att")
    a1 = episode_events(ep, [([50, 51], [2, 60]), ([52], [])], attempt=1, terminal=False)
    a2 = episode_events(ep, [([70], [2, 80]), ([71, 72], [])], attempt=2, prompt=[*PROMPT, 3])
    async with recorder(settings_for(nats_url, database_url)):
        await publish(nc, a1[:3])  # a1: started, turn 0, step 0 ... then the worker dies
        await until(lambda: sql.scalar("select count(*) from steps") == 1, 10, "a1 step")
        await publish(nc, a2)
        await publish(nc, a1[3:])  # a late turn/step of the dead attempt arrives after a2 started
        await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 20, "trajectory")
        await until(lambda: drained(nc), 10, "drained")
    tr = sql.rows("select * from trajectories")[0]
    assert tr["attempt"] == 2 and tr["token_ids"] == [*PROMPT, 3, 70, 2, 80, 71, 72]
    rows = sql.rows("select event_id, attempt, superseded from turns union all "
                    "select event_id, attempt, superseded from steps")
    assert all(r["superseded"] == (r["attempt"] == 1) for r in rows), rows
    ep_row = sql.rows("select status, attempt, prompt_token_ids from episodes")[0]
    assert (ep_row["status"], ep_row["attempt"], ep_row["prompt_token_ids"]) == ("completed", 2, [*PROMPT, 3])


async def test_retried_turn_keeps_the_try_the_step_names(nc: bus.NATS, nats_url: str, database_url: str,
                                                         sql: Sql) -> None:
    [ep] = seed_episodes(sql, "try")
    await publish(nc, episode_events(ep, [([30, 31], [2, 44]), ([32], [])], tries={0: 2}))
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 20, "trajectory")
    tr = sql.rows("select token_ids from trajectories")[0]
    assert tr["token_ids"] == [*PROMPT, 30, 31, 2, 44, 32]
    turns = {r["event_id"]: r["superseded"] for r in sql.rows("select event_id, superseded from turns")}
    assert turns == {f"{ep}:a1:t0:r1": True, f"{ep}:a1:t0:r2": False, f"{ep}:a1:t1:r1": False}


async def test_malformed_and_wrong_schema_go_to_dead_letters(nc: bus.NATS, nats_url: str, database_url: str,
                                                             sql: Sql) -> None:
    [ep] = seed_episodes(sql, "bad")
    js = nc.jetstream()
    await js.publish(event_subject("turn.generated"), b"{not json", headers={"Nats-Msg-Id": "junk-1"})
    await js.publish(event_subject("step.completed"), json.dumps({"type": "step.completed", "x": 1}).encode(),
                     headers={"Nats-Msg-Id": "junk-2"})
    await publish(nc, episode_events(ep, [([1, 2], [])]))
    settings = settings_for(nats_url, database_url)
    async with recorder(settings):
        await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 20, "good events recorded")
        await until(lambda: drained(nc), 10, "drained (dead letters terminated)")
        assert await _metric(settings, "rollout_dead_letters_total", {"reason_class": "schema"}) == 2
    letters = sql.rows("select * from dead_letters order by stream_seq")
    assert [d["source"] for d in letters] == ["recorder", "recorder"]
    assert letters[0]["reason"].startswith("schema:") and bytes(letters[0]["payload"]) == b"{not json"
    assert letters[0]["headers"] == {"Nats-Msg-Id": "junk-1"} and letters[0]["stream_seq"] == 1
    assert "schema:" in letters[1]["reason"] and letters[1]["subject"] == "rl.events.step.completed"


async def test_terminal_before_its_turns_is_assembled_once_they_arrive(nc: bus.NATS, nats_url: str,
                                                                       database_url: str, sql: Sql) -> None:
    [ep] = seed_episodes(sql, "ooo")
    events = episode_events(ep, [([9, 8], [2, 7]), ([6], [])])
    settings = settings_for(nats_url, database_url)
    async with recorder(settings):
        await publish(nc, [events[-1]])  # the terminal event first
        async def naked() -> bool:
            return await _metric(settings, "rollout_recorder_terminal_naks_total") >= 1

        await until(naked, 10, "a nak")
        await publish(nc, events[:-1])
        await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 20, "trajectory")
        await until(lambda: drained(nc), 10, "drained")
        assert await _metric(settings, "rollout_trajectories_written_total") == 1
        assert await _metric(settings, "rollout_events_processed_total") == len(events)
    tr = sql.rows("select token_ids, num_turns from trajectories")[0]
    assert tr["token_ids"] == [*PROMPT, 9, 8, 2, 7, 6] and tr["num_turns"] == 2


async def _metric(settings: RecorderSettings, name: str, labels: dict[str, str] | None = None) -> float:
    """A metric of the in-process recorder (read without blocking the loop it serves from)."""
    return await metric_async(f"http://127.0.0.1:{settings.http_port}", name, labels)


async def test_failed_episode_keeps_partial_trajectory_with_null_reward(nc: bus.NATS, nats_url: str,
                                                                        database_url: str, sql: Sql) -> None:
    [ep, never_started] = seed_episodes(sql, "fail", num_tasks=2)
    events = episode_events(ep, [([4, 5], [2, 6])], terminal=False)
    events.append(env_failed(ep, "fail", 3, "env raised", num_turns=1))
    events.append(env_failed(never_started, "fail", 1, "reset raised"))
    await publish(nc, events)
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("select count(*) from episodes where status = 'failed'") == 2, 20, "failed")
    [tr] = sql.rows("select * from trajectories")
    assert (tr["episode_id"], tr["status"], tr["failure_class"], tr["reward"]) == (ep, "failed", "env", None)
    assert tr["token_ids"] == [*PROMPT, 4, 5, 2, 6]
    row = sql.rows("select failure_class, failure_reason from episodes where id = :e", e=never_started)[0]
    assert row == {"failure_class": "env", "failure_reason": "reset raised"}


async def test_postgres_down_loses_nothing(nc: bus.NATS, nats_url: str) -> None:
    root = Path(f"/tmp/rl-recorder-pg-{uuid.uuid4().hex[:8]}")  # not under pytest's 0700 tmp: postgres runs as nobody
    await asyncio.to_thread(root.mkdir, mode=0o755)
    pg = PrivatePostgres(root)
    await asyncio.to_thread(pg.start)
    try:
        await asyncio.to_thread(upgrade, pg.url)
        sql = Sql(pg.url)
        eps = seed_episodes(sql, "pgdown", num_tasks=4)
        settings = settings_for(nats_url, pg.url)
        readyz = f"http://127.0.0.1:{settings.http_port}/readyz"
        async with recorder(settings):
            await publish(nc, episode_events(eps[0], [([1], [])]))
            await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 20, "first trajectory")
            sql.engine.dispose()
            await asyncio.to_thread(pg.stop)
            for e in eps[1:]:
                await publish(nc, episode_events(e, [([2, 3], [2, 9]), ([4], [])]))

            async def not_ready() -> bool:
                async with httpx.AsyncClient() as client:
                    return (await client.get(readyz, timeout=2)).status_code == 503

            await until(not_ready, 20, "/readyz 503 while Postgres is down")
            retried = await _metric(settings, "rollout_recorder_store_retries_total") + 3

            async def retried_while_down() -> bool:
                return await _metric(settings, "rollout_recorder_store_retries_total") >= retried

            await until(retried_while_down, 20, "three more store retries while Postgres is down")
            # ... and the batch they retried stays unacked
            info = await nc.jetstream().consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
            assert info.num_ack_pending > 0
            await asyncio.to_thread(pg.start)
            await until(lambda: sql.scalar("select count(*) from trajectories") == 4, 30, "all trajectories")
            await until(lambda: drained(nc), 10, "drained")
            async with httpx.AsyncClient() as client:
                assert (await client.get(readyz, timeout=2)).status_code == 200
        assert sql.scalar("select count(*) from turns") == 1 + 3 * 2
        assert sql.scalar("select count(*) from episodes where status = 'completed'") == 4
        sql.close()
    finally:
        await asyncio.to_thread(pg.stop, "immediate")
        import shutil

        shutil.rmtree(root, ignore_errors=True)


async def test_max_deliveries_advisory_fails_the_episode(nc: bus.NATS, nats_url: str, database_url: str,
                                                         sql: Sql) -> None:
    [ep] = seed_episodes(sql, "adv")
    js = nc.jetstream()
    await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=2, max_ack_pending=10))
    item = EpisodeRequested(event_id=f"{ep}:requested", episode_id=ep, batch_id="adv", attempt=1, seq=0,
                            produced_by="scheduler/s1", env="echo", task={"q": 1}, group_id="adv.0", group_index=0,
                            group_size=1, sampling=SamplingParams(), max_turns=2)
    await publish_event(js, item)
    work = await js.pull_subscribe_bind("env-workers", WORK_STREAM)
    # Two env workers "die": each delivery is handed back without an ack.
    await publish(nc, episode_events(ep, [([3], [])], terminal=False)[:1])  # attempt 1 started
    for _ in range(2):
        [msg] = await work.fetch(1, timeout=5)
        await msg.nak()
    assert await bus.fetch(work, 1, 0.5) == []  # a third pull makes the server give up on the item
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("select status from episodes") == "failed", 20, "episode failed")
        await until(lambda: drained(nc), 10, "drained")
    row = sql.rows("select status, failure_class, failure_reason, attempt from episodes")[0]
    assert row["failure_class"] == "infra" and "died 2 times" in row["failure_reason"] and row["attempt"] == 2
    [letter] = sql.rows("select * from dead_letters")
    assert letter["source"] == "work-queue" and "max deliveries" in letter["reason"]
    assert bytes(letter["payload"]) == encode(item)
    info = await js.stream_info(WORK_STREAM)
    assert info.state.messages == 0  # the work item was deleted
    await work.unsubscribe()
