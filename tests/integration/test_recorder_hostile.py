"""The recorder in-process against hostile bus input (real NATS + Postgres): events for unknown episodes or another
batch, events on another type's subject, non-finite rewards and cancellations the scheduler never made are
dead-lettered with no row written; a forged max-deliveries advisory deletes nothing; rejected work items on the
dead-letter stream become rows; and Postgres itself refuses orphan rows and non-finite rewards (migration 0011)."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
import sqlalchemy.exc
from sqlalchemy import text

from rollout_ledger.shared.events import EpisodeCancelled, EpisodeFinished, StepCompleted, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    DEAD_LETTER_STREAM,
    DEAD_REASON_HEADER,
    DEAD_SEQ_HEADER,
    DEAD_SUBJECT_HEADER,
    EVENTS_STREAM,
    WORK_DEAD_LETTER_SUBJECT,
    WORK_MAX_DELIVERIES_ADVISORY,
    WORK_STREAM,
    WORK_SUBJECT,
    event_subject,
)
from tests.helpers import Sql, until
from tests.integration.test_recorder import (
    drained,
    episode_events,
    publish,
    recorder,
    seed_episodes,
    settings_for,
    snapshot,
)


def letters(sql: Sql) -> list[dict[str, Any]]:
    return sql.rows("SELECT source, subject, stream_seq, reason, payload, headers FROM dead_letters ORDER BY id")


async def test_events_for_unknown_episodes_or_another_batch_leave_no_rows(nc: bus.NATS, nats_url: str,
                                                                          database_url: str, sql: Sql) -> None:
    [ep] = seed_episodes(sql, "real")
    ghost = episode_events("ghost.0.0", [([1, 2], [3]), ([4], [])])  # started, turns, steps, finished
    other = [ev.model_copy(update={"batch_id": "someone-elses"}) for ev in episode_events(ep, [([5], [])])]
    await publish(nc, [*ghost, *other])
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: drained(nc), 20, "drained")
    for table in ("turns", "steps", "trajectories", "attempt_failures"):
        assert sql.scalar(f"SELECT count(*) FROM {table}") == 0, table
    assert sql.scalar("SELECT status FROM episodes") == "requested"
    rows = letters(sql)
    assert len(rows) == len(ghost) + len(other)
    assert all(str(r["reason"]).startswith("unknown episode ghost.0.0") for r in rows[:len(ghost)])
    assert all("belongs to batch real, the event names batch someone-elses" in str(r["reason"])
               for r in rows[len(ghost):])


async def test_forged_cancellation_is_refused_and_a_real_one_applies(nc: bus.NATS, nats_url: str,
                                                                     database_url: str, sql: Sql) -> None:
    [live, cancelled] = [*seed_episodes(sql, "live"), *seed_episodes(sql, "gone")]
    started = [episode_events(e, [([1], [])], terminal=False)[0] for e in (live, cancelled)]
    await publish(nc, started)
    with sql.engine.begin() as conn:  # what the scheduler's cancel does first
        conn.execute(text("UPDATE batches SET cancelled_at = now() WHERE id = 'gone'"))
    cancels = [EpisodeCancelled(event_id=f"{e}:a1:end", episode_id=e, batch_id=e.split(".")[0], attempt=1, seq=3,
                                produced_by="env/w1") for e in (live, cancelled)]
    await publish(nc, cancels)
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: drained(nc), 20, "drained")
    status = {r["id"]: r["status"] for r in sql.rows("SELECT id, status FROM episodes")}
    assert status == {live: "running", cancelled: "cancelled"}
    [letter] = letters(sql)
    assert letter["subject"] == event_subject("episode.cancelled")
    assert f"episode.cancelled for episode {live} of batch live, which the scheduler did not cancel" == letter["reason"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
async def test_non_finite_rewards_are_dead_lettered(nc: bus.NATS, nats_url: str, database_url: str, sql: Sql,
                                                    bad: float) -> None:
    [ep] = seed_episodes(sql, "nan")
    events = episode_events(ep, [([1, 2], [])], reward=bad)
    assert isinstance(events[2], StepCompleted) and isinstance(events[3], EpisodeFinished)
    events[2] = events[2].model_copy(update={"reward": bad})
    await publish(nc, events)
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: drained(nc), 20, "drained")
    assert sql.scalar("SELECT count(*) FROM steps") == 0 and sql.scalar("SELECT count(*) FROM trajectories") == 0
    assert sql.scalar("SELECT reward FROM episodes") is None
    reasons = [str(r["reason"]) for r in letters(sql)]
    assert [r.split(" in ")[0] for r in reasons] == [f"non-finite reward {bad!r}"] * 2


async def test_events_on_another_types_subject_are_out_of_place(nc: bus.NATS, nats_url: str, database_url: str,
                                                                sql: Sql) -> None:
    [ep] = seed_episodes(sql, "oop")
    started, turn, _, _ = episode_events(ep, [([1, 2], [])])
    js = nc.jetstream()
    await js.publish(event_subject("step.completed"), encode(turn))
    await js.publish(event_subject("episode.finished"), encode(started))
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: drained(nc), 20, "drained")
    assert sql.scalar("SELECT count(*) FROM turns") == 0 and sql.scalar("SELECT status FROM episodes") == "requested"
    assert [str(r["reason"]).split(" (")[0] for r in letters(sql)] == [
        "out of place: a turn.generated event on subject rl.events.step.completed",
        "out of place: a episode.started event on subject rl.events.episode.finished"]


async def test_forged_advisories_delete_nothing(nc: bus.NATS, nats_url: str, database_url: str, sql: Sql) -> None:
    """Issue 16: an advisory naming RL_EVENTS made the recorder delete an event. Now nothing is read or deleted
    unless the work consumer really delivered the item and never acked it."""
    [ep] = seed_episodes(sql, "adv")
    await publish(nc, episode_events(ep, [([1, 2], [])]))
    js = nc.jetstream()
    await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=2, max_ack_pending=10))
    await js.publish(WORK_SUBJECT, b"an item nobody took yet")  # work seq 1: never delivered
    forged = [
        {"stream": EVENTS_STREAM, "consumer": "recorder", "stream_seq": 1, "deliveries": 5},
        {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 1, "deliveries": 5},
        {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 7, "deliveries": 5},
        {"stream": WORK_STREAM, "consumer": "other", "stream_seq": 1, "deliveries": 5},
        [1, 2],
        {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 2**64 - 1, "deliveries": 5},
        {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 1, "deliveries": 2**62},
    ]
    for body in forged:
        await js.publish(WORK_MAX_DELIVERIES_ADVISORY, orjson.dumps(body))
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: drained(nc), 20, "drained")
        await until(lambda: sql.scalar("SELECT count(*) FROM dead_letters") == len(forged), 20, "advisories refused")
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 4  # all of the episode's events are still there
    assert (await js.get_msg(EVENTS_STREAM, 1)).data
    assert (await js.stream_info(WORK_STREAM)).state.messages == 1
    assert sql.scalar("SELECT status FROM episodes") == "completed"
    reasons = [str(r["reason"]) for r in letters(sql)]
    assert all(r["source"] == "recorder-advisories" for r in letters(sql))
    assert reasons[0].startswith("untrusted advisory: names stream 'RL_EVENTS' consumer 'recorder'")
    assert reasons[1] == "untrusted advisory: work item #1 was never delivered (the work consumer delivered up to #0)"
    assert "never delivered" in reasons[2] and "consumer 'other'" in reasons[3]
    assert reasons[4].startswith("unreadable advisory")
    assert all(r.endswith("out of range") for r in reasons[5:])


async def test_rejected_work_items_become_dead_letters(nc: bus.NATS, nats_url: str, database_url: str,
                                                       sql: Sql) -> None:
    js = nc.jetstream()
    await js.publish(WORK_DEAD_LETTER_SUBJECT, b"\xff garbage",
                     headers={DEAD_SUBJECT_HEADER: WORK_SUBJECT, DEAD_SEQ_HEADER: "42",
                              DEAD_REASON_HEADER: "undecodable work item: nope"})
    await js.publish("rl.deadletters.other", b"no headers at all")
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("SELECT count(*) FROM dead_letters") == 2, 20, "stored")
    first, second = letters(sql)
    assert (first["source"], first["subject"], first["stream_seq"], first["reason"], bytes(first["payload"])) == (
        "env-worker", WORK_SUBJECT, 1, "undecodable work item: nope", b"\xff garbage")
    assert first["headers"][DEAD_SEQ_HEADER] == "42"
    assert (second["source"], second["subject"], second["stream_seq"]) == (
        "dead-letter-stream", "rl.deadletters.other", 2)
    info = await js.consumer_info(DEAD_LETTER_STREAM, "recorder-dead-letters")
    assert info.num_pending == 0


def test_postgres_refuses_orphan_rows_and_non_finite_rewards(sql: Sql) -> None:
    """Past the recorder's own checks: foreign keys and CHECK constraints of migration 0011."""
    [ep] = seed_episodes(sql, "pg")
    for stmt in (
        "INSERT INTO attempt_failures (event_id, episode_id, batch_id, attempt, failure_class, reason, retried, "
        "produced_at) VALUES ('x', 'ghost.0.0', 'ghost', 1, 'env', 'x', false, now())",
        "INSERT INTO turns (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, logprobs, "
        "finish_reason, weight_version, engine, worker_id, queue_ms, generate_ms, produced_at) VALUES "
        "('t', 'ghost.0.0', 1, 0, 1, '{1}', '{0}', 'stop', 0, 'fake', 'w', 0, 0, now())",
        "UPDATE episodes SET reward = 'NaN' WHERE id = :e",
        "UPDATE episodes SET reward = '-Infinity' WHERE id = :e",
    ):
        with pytest.raises(sqlalchemy.exc.IntegrityError, match=r"fk_|_finite"), sql.engine.begin() as conn:
            conn.execute(text(stmt), {"e": ep})
    with sql.engine.begin() as conn:
        conn.execute(text("UPDATE episodes SET reward = 0.5 WHERE id = :e"), {"e": ep})  # a finite reward is fine
    assert snapshot(sql)["turns"] == [] and sql.scalar("SELECT reward FROM episodes") == 0.5


async def test_nul_in_headers_or_reasons_is_stored_escaped(nc: bus.NATS, nats_url: str, database_url: str,
                                                           sql: Sql) -> None:
    """Postgres text and jsonb refuse NUL: a hostile header must not make a dead letter unstorable (it would be
    redelivered for ever, and a batch holding it would never commit)."""
    js = nc.jetstream()
    await js.publish(event_subject("turn.generated"), b"\x00garbage", headers={"X-Evil": "a\x00b"})
    await js.publish(WORK_DEAD_LETTER_SUBJECT, b"x", headers={DEAD_SUBJECT_HEADER: "rl.work\x00", DEAD_SEQ_HEADER: "1",
                                                               DEAD_REASON_HEADER: "why\x00not"})
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("SELECT count(*) FROM dead_letters") == 2, 20, "both stored")
        await until(lambda: drained(nc), 10, "drained")
    # the event consumer and the dead-letter consumer run side by side: either may store its letter first
    [event] = [row for row in letters(sql) if row["subject"] == event_subject("turn.generated")]
    [rejected] = [row for row in letters(sql) if row["subject"] != event_subject("turn.generated")]
    assert event["headers"] == {"X-Evil": "a\\x00b"} and bytes(event["payload"]) == b"\x00garbage"
    assert (rejected["subject"], rejected["reason"]) == ("rl.work\\x00", "why\\x00not")
