"""The SQL surface: every query of docs/sql.md runs (as the read-only role) on a real database with data in every
table it reads; the read-only role cannot write, and the exporter works through it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.export import export
from rollout_ledger.services.exporter.follow import Follower
from rollout_ledger.services.exporter.rewards import rescore, resolve
from tests.integration.export_data import Traj, run, seed_batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "sql.md"


def doc_queries() -> list[str]:
    return [q.strip() for q in re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)]


def populate(url: str) -> None:
    """A little of everything: trajectories (one segmented), turns, steps, failures, a rescore, a cursor, policy
    versions, an audit, a bounded batch, resumed attempts, a turn across a keep swap."""
    seed_batch(url, "s1", [[Traj(reward=1.0), Traj(reward=0.0, status="truncated")],
                           [Traj(reward=0.5, segments=((4, ((3, 2),)), (6, ((2, 0),))), versions=(3, 4)),
                            Traj(reward=None, status="failed", with_trajectory=False)]], env="guess-number")
    run(url, "UPDATE episodes SET failure_class = 'env', failure_reason = 'env raised: boom\nTraceback ...' "
             "WHERE id = 's1.1.1'")
    run(url, "INSERT INTO attempt_failures (event_id, episode_id, batch_id, attempt, failure_class, reason, retried, "
             "produced_at) VALUES ('f1', 's1.1.1', 's1', 1, 'inference', 'no worker answered', true, now()), "
             "('f2', 's1.1.1', 's1', 2, 'env', 'env raised: boom', false, now())")
    for i, eid in enumerate(["s1.0.0", "s1.1.1"]):
        run(url, "INSERT INTO turns (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, logprobs, "
                 "finish_reason, weight_version, engine, worker_id, queue_ms, generate_ms, cached_tokens, "
                 "produced_at) VALUES (%s, %s, 1, 0, 4, '{1,2,3}', '{-0.1,-0.2,-0.3}', 'stop', 3, 'fake', 'w1', "
                 "0.5, 12.5, 2, now())", (f"t{i}", eid))
        run(url, "INSERT INTO steps (event_id, episode_id, attempt, turn_index, turn_event_id, action, observation, "
                 "observation_token_ids, reward, terminated, truncated, info, step_ms, produced_at) VALUES "
                 "(%s, %s, 1, 0, %s, 'answer 4', 'correct', '{5,6}', 1.0, true, false, '{}', 1.5, now())",
                 (f"s{i}", eid, f"t{i}"))
    # resume: s1.0.0's attempt 2 carried turn 0 over from attempt 1 (replay); s1.1.1's attempt 2 restarted; a turn a
    # keep swap carried across versions 3 and 4
    run(url, "UPDATE episodes SET attempt = 2 WHERE id IN ('s1.0.0', 's1.1.1')")
    run(url, "INSERT INTO steps (event_id, episode_id, attempt, turn_index, turn_event_id, action, observation, "
             "observation_token_ids, reward, terminated, truncated, info, step_ms, produced_at, reused_from) VALUES "
             "('s0:a2', 's1.0.0', 2, 0, 't0', 'answer 4', 'correct', '{5,6}', 1.0, true, false, '{}', 0, now(), 's0')")
    run(url, "INSERT INTO attempt_resumes (episode_id, attempt, batch_id, mode, from_attempt, turns_recorded, "
             "turns_reused, turns_unstepped, reason, produced_at) VALUES "
             "('s1.0.0', 2, 's1', 'replay', 1, 1, 1, 1, '', now()), "
             "('s1.1.1', 2, 's1', 'restart', 1, 1, 0, 0, 'replay diverged: turn 0: the observation differs', now())")
    run(url, "INSERT INTO turns (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, logprobs, "
             "finish_reason, weight_version, engine, worker_id, queue_ms, generate_ms, produced_at, version_runs) "
             "VALUES ('tk', 's1.1.0', 1, 0, 4, '{1,2,3,4}', '{-0.1,-0.2,-0.3,-0.4}', 'stop', 3, 'fake', 'w1', 0.5, "
             "12.5, now(), '[[0, 3], [2, 4]]')")
    run(url, "INSERT INTO dead_letters (source, subject, stream_seq, reason, payload) "
             "VALUES ('recorder', 'rl.events.x', 7, 'schema: bad', '\\x00')")
    rescore(url, resolve("success"), Selection())
    run(url, "INSERT INTO policy_versions (version, checkpoint, mode, request_hash) "
             "VALUES (4, '/ckpt/4', 'drain', 'h')")
    run(url, "INSERT INTO policy_worker_states (version, worker_id, state, reported_at) "
             "VALUES (4, 'w1', 'serving', now())")
    run(url, "UPDATE batches SET max_staleness = 0, episodes_per_version = 2, admission_base_version = 3 "
             "WHERE id = 's1'")  # a bounded batch: one trajectory spans versions 3-4, beyond k = 0
    run(url, "UPDATE episodes SET admitted_version = 3 WHERE batch_id = 's1'")
    run(url, "INSERT INTO logprob_audits (episode_id, attempt, batch_id, source, checkpoint, engine, min_version, "
             "max_version, num_tokens, mean_abs_delta, p99_abs_delta, max_abs_delta, token_logprobs) "
             "SELECT episode_id, attempt, batch_id, 'audit', '/ckpt/4', 'vllm', 3, 3, num_sampled_tokens, 1e-5, 3e-5, "
             "4e-5, ARRAY(SELECT t.logprobs[i] + 1e-5 * i FROM generate_subscripts(t.loss_mask, 1) AS i "
             "WHERE t.loss_mask[i] = 1 ORDER BY i) FROM trajectories t WHERE episode_id = 's1.0.0'")


@pytest.fixture
def reader_url(database_url: str) -> Iterator[str]:
    """The same database as ``rollout_reader`` (allowed to log in for the test, NOLOGIN again after)."""
    canlogin = run(database_url, "SELECT rolcanlogin FROM pg_roles WHERE rolname = 'rollout_reader'")
    assert canlogin == [(False,)]  # the migration's default
    url = make_url(database_url).set(username="rollout_reader", password="reader-secret")
    # trust auth (private servers): "not permitted to log in"; password auth (containers): no password yet
    with pytest.raises(psycopg.OperationalError, match=r"not permitted to log in|password authentication failed"):
        psycopg.connect(libpq_url(url.render_as_string(hide_password=False))).close()
    run(database_url, "ALTER ROLE rollout_reader LOGIN PASSWORD 'reader-secret'")
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        run(database_url, "ALTER ROLE rollout_reader NOLOGIN")


def test_docs_sql_queries_execute_as_the_reader(database_url: str, reader_url: str, tmp_path: Path) -> None:
    populate(database_url)
    Follower(database_url, "docs", Selection(), tmp_path, "jsonl").close()
    queries = doc_queries()
    assert len(queries) >= 12
    empty = []
    with psycopg.connect(libpq_url(reader_url), autocommit=True) as conn:
        for q in queries:
            rows = conn.execute(q).fetchall()
            if not rows:
                empty.append(q)
    assert empty == []  # every documented query returns something on a populated store


WRITES = [
    "INSERT INTO trajectories SELECT * FROM trajectories",
    "UPDATE trajectories SET reward = 0",
    "DELETE FROM trajectories",
    "TRUNCATE trajectories",
    "UPDATE episodes SET status = 'failed'",
    "DELETE FROM episodes",
    "INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, request_hash) "
    "VALUES ('x', 'e', 1, 1, '{}', 1, 1, 'h')",
    "UPDATE turns SET superseded = true",
    "DELETE FROM steps",
    "UPDATE reward_scores SET score = 1",
    "INSERT INTO trajectory_feed (xid, episode_id, attempt, group_id, batch_id) VALUES (1, 'a', 1, 'g', 'b')",
    "DELETE FROM export_cursors",
    "CREATE TABLE mine (x int)",
]


@pytest.mark.parametrize("statement", WRITES)
def test_reader_role_cannot_write(database_url: str, reader_url: str, statement: str) -> None:
    seed_batch(database_url, "ro", [[Traj()]])
    with psycopg.connect(libpq_url(reader_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM trajectories").fetchone() == (1,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)
    assert run(database_url, "SELECT count(*), min(reward) FROM trajectories") == [(1, 1.0)]


def test_exporter_runs_as_the_reader(database_url: str, reader_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "rr", [[Traj(reward=1.0), Traj(reward=0.0)]])
    assert export(reader_url, Selection(), tmp_path / "all.parquet", "slime").records == 2
    f = Follower(reader_url, "as-reader", Selection(complete_groups=True), tmp_path / "c", "trl")
    try:
        path, count = f.step() or (None, 0)
        assert path is not None and count == 2
        assert f.step() is None
    finally:
        f.close()
    assert run(database_url, "SELECT deliveries, delivered FROM export_cursors WHERE consumer = 'as-reader'") == [
        (1, 2)]
