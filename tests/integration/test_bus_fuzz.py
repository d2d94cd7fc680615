"""Hostile input on every subject the services consume, with the real services running (fake engine): every
message that reaches a stream is dead-lettered with its subject, reason and payload, core-NATS and KV garbage is
refused, the stored data does not change (row counts and checksums of every table), and a normal batch still
completes afterwards.

What is published (seeded): random bytes, wrong JSON, valid events of the wrong type or on another type's subject,
events for unknown episodes or naming another batch, a forged ``episode.cancelled`` for a live episode of a batch
nobody cancelled (and a forged cancel-bucket entry), NaN / infinite rewards, a 2 MiB payload, payloads nested
100,000 deep, forged max-deliveries advisories (one aimed at the event log, as in issue 16), and a well-formed work
item for an episode the scheduler never stored (it runs, and every event it makes is dead-lettered).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from typing import Any, TypeAlias

import httpx
import numpy as np
import orjson
from sqlalchemy import text

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    FailureClass,
    FinishReason,
    InferenceRequested,
    SamplingParams,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    ADVISORY_STREAM,
    BUCKETS,
    CANCEL_BUCKET,
    DEAD_LETTER_MAX_PAYLOAD,
    DEAD_SEQ_HEADER,
    EVENTS_STREAM,
    INFER_ANY,
    INFER_CANCEL,
    INFER_HEARTBEAT,
    POLICY_BUCKET,
    POLICY_KEY,
    WORK_DEAD_LETTER_SUBJECT,
    WORK_MAX_DELIVERIES_ADVISORY,
    WORK_STREAM,
    WORK_SUBJECT,
    event_subject,
    infer_worker_subject,
)
from tests.helpers import Sql, until
from tests.integration.test_pipeline import start_all, submit_and_wait

TABLES = ("batches", "episodes", "turns", "steps", "trajectories", "attempt_failures", "trajectory_feed",
          "policy_versions", "policy_worker_states", "reward_scores", "export_cursors")
"""Every table a hostile message could write to (all but dead_letters)."""

LIVE_BATCH = "fuzz-live"
LIVE_EPISODE = f"{LIVE_BATCH}.0.0"
GHOST = "ghost.0.0"
"""An episode id the scheduler never stored."""
BIG = 2 * 1024 * 1024


@dataclass(frozen=True)
class Sent:
    """One hostile message a stream stored."""

    stream: str
    seq: int
    subject: str
    payload: bytes
    what: str


REFRESHED = {"policy_worker_states": ("reported_at", "updated_at")}
"""Columns a service rewrites on a timer (an inference worker re-reports its state every 15 s): not a change."""


def checksums(sql: Sql) -> dict[str, tuple[Any, ...]]:
    """Row count and an md5 over every row's text of each table (less the columns a timer refreshes)."""
    def row(t: str) -> str:
        return "(to_jsonb(x)" + "".join(f" - '{c}'" for c in REFRESHED.get(t, ())) + ")::text"
    return {t: tuple(sql.rows(f"SELECT count(*) AS n, md5(coalesce(string_agg({row(t)}, '|' ORDER BY {row(t)}), "
                              f"'')) AS h FROM {t} x")[0].values()) for t in TABLES}


def seed_live_episode(sql: Sql) -> None:
    """A batch nobody cancelled with one episode running attempt 1 (as if an env worker ran it right now)."""
    with sql.engine.begin() as conn:
        conn.execute(text("INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                          "request_hash) VALUES (:b, 'fixed-turns', 1, 4, '{}'::jsonb, 1, 1, 'x')"), {"b": LIVE_BATCH})
        conn.execute(text("INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status, "
                          "attempt, worker_id, published_at, started_at) VALUES (:e, :b, :g, 0, 0, 'fixed-turns', "
                          "'{\"turns\": 4}'::jsonb, 'running', 1, 'env-worker-0', now(), now())"),
                     {"e": LIVE_EPISODE, "b": LIVE_BATCH, "g": f"{LIVE_BATCH}.0"})


Recorded: TypeAlias = (EpisodeStarted | TurnGenerated | StepCompleted | EpisodeFinished | EpisodeFailed
                       | EpisodeCancelled)


def valid_events(episode_id: str, batch_id: str, *, reward: float = 1.0) -> list[Recorded]:
    """One well-formed event of each recorded type for ``episode_id`` (attempt 1)."""
    base: dict[str, Any] = {"episode_id": episode_id, "batch_id": batch_id, "attempt": 1, "produced_by": "fuzz"}
    turn_id = f"{episode_id}:a1:t0:r1"
    return [
        EpisodeStarted(event_id=f"{episode_id}:a1:started", seq=0, env="fixed-turns", worker_id="w",
                       prompt_token_ids=np.asarray([1, 2, 3], "<i4"), prompt_text="p", **base),
        TurnGenerated(event_id=turn_id, request_id=turn_id, seq=1, turn_index=0, prompt_len=3,
                      token_ids=np.asarray([5, 6], "<i4"), logprobs=np.asarray([-0.1, -0.2], "<f4"),
                      finish_reason=FinishReason.STOP, weight_version=0, engine="fake", worker_id="i",
                      queue_ms=0.0, generate_ms=0.0, **base),
        StepCompleted(event_id=f"{episode_id}:a1:s0", seq=2, turn_index=0, turn_event_id=turn_id, action="a",
                      observation="", observation_token_ids=np.asarray([], "<i4"), reward=reward, terminated=True,
                      truncated=False, **base),
        EpisodeFinished(event_id=f"{episode_id}:a1:end", seq=3, status=TrajectoryStatus.COMPLETED, reward=reward,
                        num_turns=1, num_tokens=5, stop_reason="terminated", **base),
        EpisodeFailed(event_id=f"{episode_id}:a1:failed", seq=3, failure_class=FailureClass.ENV, reason="x",
                      num_turns=0, **base),
        EpisodeCancelled(event_id=f"{episode_id}:a1:cancelled", seq=3, **base),
    ]


def work_item(episode_id: str, batch_id: str) -> EpisodeRequested:
    return EpisodeRequested(event_id=f"{episode_id}:requested", episode_id=episode_id, batch_id=batch_id, attempt=1,
                            seq=0, produced_by="fuzz", env="fixed-turns", task={"turns": 1}, group_id=f"{batch_id}.0",
                            group_index=0, group_size=1, sampling=SamplingParams(max_tokens=8), max_turns=2)


def garbage(rng: random.Random) -> list[tuple[str, bytes]]:
    """Payloads that are not events at all (what, bytes)."""
    return [
        ("random bytes", rng.randbytes(64)),
        ("empty", b""),
        ("broken JSON", b"{not json"),
        ("JSON array", b"[1, 2, 3]"),
        ("JSON without type", orjson.dumps({"episode_id": GHOST, "x": 1})),
        ("JSON with a wrong field type", orjson.dumps({"type": "turn.generated", "event_id": 7, "attempt": "one"})),
        ("JSON of an unknown type", orjson.dumps({"type": "episode.exploded", "event_id": "e"})),
        ("JSON nested 100,000 deep", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("msgpack nested 100,000 deep", b"\x91" * 100_000 + b"\xc0"),
        ("2 MiB of random bytes", rng.randbytes(BIG)),
    ]


def hostile_events(rng: random.Random, done_episode: str, done_batch: str) -> list[tuple[str, str, bytes]]:
    """(subject, what, payload) on the event stream."""
    out: list[tuple[str, str, bytes]] = []
    types = ["episode.started", "turn.generated", "step.completed", "episode.finished", "episode.failed",
             "episode.cancelled", "episode.requested", "inference.requested", "no.such.type"]
    for t in types:
        out += [(event_subject(t), what, p) for what, p in garbage(rng)]
    # events for an episode nobody stored: every recorded type
    for ev in valid_events(GHOST, "ghost"):
        out.append((event_subject(str(ev.type)), f"{ev.type} of an unknown episode", encode(ev)))
    # a stored episode, but the event names another batch
    for ev in valid_events(LIVE_EPISODE, "other-batch")[:3]:
        out.append((event_subject(str(ev.type)), f"{ev.type} naming another batch", encode(ev)))
    # out of place: a well-formed event on another type's subject
    turn = valid_events(LIVE_EPISODE, LIVE_BATCH)[1]
    out.append((event_subject("step.completed"), "turn.generated on the step subject", encode(turn)))
    out.append((event_subject("episode.finished"), "turn.generated on the finished subject", encode(turn)))
    # events that belong elsewhere: a work item and an inference request on the event stream
    out.append((event_subject("episode.requested"), "work item on the event stream",
                encode(work_item(LIVE_EPISODE, LIVE_BATCH))))
    req = InferenceRequested(event_id="r", request_id="r", episode_id=LIVE_EPISODE, batch_id=LIVE_BATCH, attempt=1,
                             seq=1, produced_by="fuzz", turn_index=0, prompt_token_ids=np.asarray([1], "<i4"),
                             sampling=SamplingParams(), max_tokens=4, reply_seq=1)
    out.append((event_subject("inference.requested"), "inference request on the event stream", encode(req)))
    # forged cancellations: a live episode and a finished one, of batches nobody cancelled
    for eid, bid in ((LIVE_EPISODE, LIVE_BATCH), (done_episode, done_batch)):
        cancel = EpisodeCancelled(event_id=f"{eid}:a1:end", episode_id=eid, batch_id=bid, attempt=1, seq=9,
                                  produced_by="fuzz")
        out.append((event_subject("episode.cancelled"), f"forged cancellation of {eid}", encode(cancel)))
    # non-finite rewards for the live episode
    for bad in (math.nan, math.inf, -math.inf):
        evs = valid_events(LIVE_EPISODE, LIVE_BATCH, reward=bad)
        out.append((event_subject("step.completed"), f"step reward {bad}", encode(evs[2])))
        out.append((event_subject("episode.finished"), f"finished reward {bad}", encode(evs[3])))
    return out


def hostile_advisories(rng: random.Random) -> list[tuple[str, bytes]]:
    forged = [
        ("forged advisory deleting from the event log",
         {"type": "io.nats.jetstream.advisory.v1.max_deliver", "stream": EVENTS_STREAM, "consumer": "recorder",
          "stream_seq": 1, "deliveries": 5}),
        ("forged advisory for a work item never delivered",
         {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 10**9, "deliveries": 5}),
        ("forged advisory for an acked work item",
         {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 1, "deliveries": 5}),
        ("forged advisory naming another consumer",
         {"stream": WORK_STREAM, "consumer": "someone", "stream_seq": 1, "deliveries": 5}),
        ("advisory with a negative sequence", {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": -3}),
        ("advisory with a 300-bit sequence", {"stream": WORK_STREAM, "consumer": "env-workers", "stream_seq": 2**300}),
    ]
    return [*garbage(rng)[:8], *((what, json.dumps(body).encode()) for what, body in forged)]


async def publish_all(js: Any, rng: random.Random, done_episode: str, done_batch: str) -> list[Sent]:
    sent: list[Sent] = []

    async def put(subject: str, what: str, payload: bytes) -> None:
        ack = await js.publish(subject, payload, timeout=10)
        sent.append(Sent(ack.stream, int(ack.seq), subject, payload, what))

    for subject, what, payload in hostile_events(rng, done_episode, done_batch):
        await put(subject, what, payload)
    # NUL, which Postgres text and jsonb refuse: in a header, and in the ids of a well-formed event
    ack = await js.publish(event_subject("step.completed"), b"x", headers={"X-Evil": "a\x00b"}, timeout=10)
    sent.append(Sent(ack.stream, int(ack.seq), event_subject("step.completed"), b"x", "NUL in a header"))
    nul = valid_events(LIVE_EPISODE, LIVE_BATCH)[0].model_copy(update={"episode_id": "a\x00b", "event_id": "\x00"})
    await put(event_subject("episode.started"), "NUL in the ids", encode(nul))
    for what, payload in garbage(rng):
        await put(WORK_SUBJECT, what, payload)
    for ev in valid_events(LIVE_EPISODE, LIVE_BATCH):  # valid events are not work items
        await put(WORK_SUBJECT, f"{ev.type} on the work queue", encode(ev))
    for what, payload in hostile_advisories(rng):
        await put(WORK_MAX_DELIVERIES_ADVISORY, what, payload)
    for what, payload in garbage(rng)[:4]:
        await put(WORK_DEAD_LETTER_SUBJECT, what, payload)
        await put("rl.deadletters.whatever", what, payload)
    return sent


async def publish_core_and_kv(nc: bus.NATS, rng: random.Random) -> None:
    """Garbage that no stream keeps: the services must refuse it (and stay up)."""
    js = nc.jetstream()
    for _, payload in garbage(rng)[:9]:
        for subject in (INFER_HEARTBEAT, INFER_CANCEL, infer_worker_subject("nobody"), INFER_ANY):
            await nc.publish(subject, payload, reply="_INBOX.fuzz" if subject == INFER_ANY else "")
    for bucket in BUCKETS:
        kv = await js.key_value(bucket)
        if bucket == CANCEL_BUCKET:
            await kv.put(LIVE_BATCH, b"forged")  # a forged cancellation of the live batch
            continue
        for i, (_, payload) in enumerate(garbage(rng)[:7]):
            await kv.put(POLICY_KEY if bucket == POLICY_BUCKET and i == 0 else f"fuzz-{i}", payload)
    await nc.flush()


async def test_hostile_bus_messages_are_dead_lettered_and_change_nothing(stack: Stack, nc: bus.NATS,
                                                                         database_url: str) -> None:
    rng = random.Random(16)
    sql = Sql(database_url)
    js = nc.jetstream()
    url = await asyncio.to_thread(start_all, stack)
    first = await asyncio.to_thread(submit_and_wait, url, env="fixed-turns", tasks=[{"turns": 2}, {"turns": 3}],
                                    group_size=2, max_turns=4)
    assert first["counts"]["completed"] == 4  # type: ignore[index]
    done_batch = str(first["batch_id"])
    done_episode = sql.scalar("SELECT min(id) FROM episodes WHERE batch_id = :b", b=done_batch)
    seed_live_episode(sql)
    events_before = (await js.stream_info(EVENTS_STREAM)).state
    before = checksums(sql)

    sent = await publish_all(js, rng, done_episode, done_batch)
    await publish_core_and_kv(nc, rng)
    ghost = await js.publish(WORK_SUBJECT, encode(work_item(GHOST, "ghost")), timeout=10)  # runs, changes nothing

    async def stored() -> list[Sent]:
        rows = sql.rows("SELECT source, subject, stream_seq, headers, reason, payload FROM dead_letters")
        have = {(r["source"], r["stream_seq"]) for r in rows}
        rejected_work = {int(r["headers"][DEAD_SEQ_HEADER]) for r in rows if r["source"] == "env-worker"
                         and r["headers"] and r["headers"].get(DEAD_SEQ_HEADER)}
        missing = []
        for s in sent:
            if s.stream == EVENTS_STREAM:
                ok = ("recorder", s.seq) in have
            elif s.stream == WORK_STREAM:
                ok = s.seq in rejected_work
            elif s.stream == ADVISORY_STREAM:
                ok = ("recorder-advisories", s.seq) in have
            else:
                ok = ("env-worker", s.seq) in have or ("dead-letter-stream", s.seq) in have
            if not ok:
                missing.append(s)
        return missing

    missing: list[Sent] = []

    async def all_stored() -> bool:
        missing[:] = await stored()
        return not missing

    try:
        await until(all_stored, 120, "every message stored or dead-lettered", interval_s=0.5)
    except AssertionError as timed_out:
        raise AssertionError(f"not dead-lettered: {[(m.stream, m.seq, m.subject, m.what) for m in missing][:20]}") \
            from timed_out
    # the ghost episode's work item ran: every event it made was dead-lettered as an unknown episode
    await until(lambda: sql.scalar("SELECT count(*) FROM dead_letters WHERE reason LIKE :r AND subject IN "
                                   "('rl.events.episode.finished', 'rl.events.episode.failed')",
                                   r=f"unknown episode {GHOST}%") >= 1, 60, "the ghost episode's terminal event")
    assert int((await js.stream_info(WORK_STREAM)).state.messages) == 0, f"work item #{ghost.seq} left behind"

    letters = {(r["source"], r["stream_seq"]): r for r in sql.rows("SELECT * FROM dead_letters")}
    by_work_seq = {int(r["headers"][DEAD_SEQ_HEADER]): r for r in letters.values() if r["source"] == "env-worker"
                   and r["headers"] and r["headers"].get(DEAD_SEQ_HEADER)}
    for s in sent:
        if s.stream == EVENTS_STREAM:
            row = letters[("recorder", s.seq)]
            assert bytes(row["payload"]) == s.payload and row["subject"] == s.subject, s.what
        elif s.stream == WORK_STREAM:
            row = by_work_seq[s.seq]
            assert bytes(row["payload"]) == s.payload[:DEAD_LETTER_MAX_PAYLOAD] and row["subject"] == WORK_SUBJECT
            assert row["reason"].startswith("undecodable work item"), s.what
            if len(s.payload) > DEAD_LETTER_MAX_PAYLOAD:
                assert f"payload cut to {DEAD_LETTER_MAX_PAYLOAD}" in row["reason"]
        elif s.stream == ADVISORY_STREAM:
            row = letters[("recorder-advisories", s.seq)]
            assert bytes(row["payload"]) == s.payload
            assert row["reason"].startswith(("unreadable advisory", "untrusted advisory")), (s.what, row["reason"])
        assert row["reason"], s.what
    reasons = [r["reason"] for r in letters.values()]
    assert any("which the scheduler did not cancel" in r and LIVE_EPISODE in r for r in reasons)
    assert any(r.startswith("non-finite reward nan") for r in reasons)
    assert any(r.startswith("out of place: a turn.generated event on subject rl.events.step.completed")
               for r in reasons)
    assert any("names stream 'RL_EVENTS'" in r for r in reasons)

    # nothing stored changed; the event log lost nothing (the forged advisory aimed at its first message)
    assert checksums(sql) == before
    assert sql.scalar("SELECT status FROM episodes WHERE id = :e", e=LIVE_EPISODE) == "running"
    assert sql.scalar("SELECT cancelled_at FROM batches WHERE id = :b", b=LIVE_BATCH) is None
    events_after = (await js.stream_info(EVENTS_STREAM)).state
    assert events_after.first_seq == events_before.first_seq == 1
    assert int(events_after.messages) >= int(events_before.messages) + sum(s.stream == EVENTS_STREAM for s in sent)
    assert (await js.get_msg(EVENTS_STREAM, 1)).data

    # and the services still work
    after = await asyncio.to_thread(submit_and_wait, url, env="fixed-turns", tasks=[{"turns": 2}], group_size=2,
                                    max_turns=3)
    assert after["counts"]["completed"] == 2  # type: ignore[index]
    async with httpx.AsyncClient() as client:
        health = (await client.get(f"{url}/healthz", timeout=10)).status_code
    assert health == 200
    sql.close()

