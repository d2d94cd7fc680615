"""Consumer cursors: every trajectory delivered exactly once per consumer, across late commits, replacements,
a crash between file and commit, and a real `rollout export --follow` process killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import psycopg
import pytest

from rollout_ledger.client.cursor import KEEPALIVE, Cursors
from rollout_ledger.client.reader import CursorError, TrajectoryReader
from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.follow import Follower
from rollout_ledger.services.exporter.retention import prune
from tests.helpers import wait_for
from tests.integration.export_data import Traj, consumer_claimed, delivered, run, seed_batch


def at_least(out: Path, n: int) -> bool:
    return len(delivered(out)) >= n


def cursor(url: str, consumer: str) -> tuple[int, int]:
    rows = run(url, "SELECT deliveries, delivered FROM export_cursors WHERE consumer = %s", (consumer,))
    return rows[0] if rows else (0, 0)


def drain(f: Follower) -> None:
    while f.step() is not None:
        pass


def test_a_late_commit_is_never_skipped(database_url: str, tmp_path: Path) -> None:
    """A transaction that took its id first but commits last: its trajectories are delivered, after it commits."""
    seed_batch(database_url, "late", [[Traj(), Traj()]])
    run(database_url, "CREATE TABLE hold AS SELECT * FROM trajectories")
    run(database_url, "DELETE FROM trajectories; DELETE FROM trajectory_feed")
    slow = psycopg.connect(libpq_url(database_url))
    slow.execute("INSERT INTO trajectories SELECT * FROM hold")  # xid taken now, commit later
    seed_batch(database_url, "early", [[Traj()]])  # a younger transaction that commits first
    f = Follower(database_url, "late-test", Selection(), tmp_path, "jsonl")
    try:
        drain(f)
        assert delivered(tmp_path) == []  # "early" is newer than the open transaction: held back, not passed
        slow.commit()
        drain(f)
        assert sorted(delivered(tmp_path)) == [("early.0.0", 1), ("late.0.0", 1), ("late.0.1", 1)]
    finally:
        slow.close()
        f.close()


def test_replaced_trajectories_and_upserts(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "rp", [[Traj(), Traj()]])
    upsert = ("INSERT INTO trajectories SELECT * FROM trajectories WHERE episode_id = %s "
              "ON CONFLICT (episode_id, episode_created_at) DO UPDATE SET attempt = excluded.attempt + 1 "
              "WHERE trajectories.attempt < excluded.attempt + 1")
    run(database_url, upsert, ("rp.0.0",))  # replaced before anyone read attempt 1
    f = Follower(database_url, "rp", Selection(), tmp_path, "jsonl")
    try:
        drain(f)
        assert delivered(tmp_path) == [("rp.0.0", 2), ("rp.0.1", 1)]  # attempt 1 of rp.0.0 is gone: skipped
        run(database_url, upsert, ("rp.0.1",))
        run(database_url, "UPDATE trajectories SET reward = 5 WHERE episode_id = 'rp.0.0'")  # not a new version
        drain(f)
        assert delivered(tmp_path) == [("rp.0.0", 2), ("rp.0.1", 1), ("rp.0.1", 2)]
        assert cursor(database_url, "rp") == (2, 3)
    finally:
        f.close()


def test_crash_between_file_and_commit_recovers_without_duplicates(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "cr", [[Traj() for _ in range(3)] for _ in range(3)])
    f = Follower(database_url, "crash", Selection(), tmp_path, "jsonl", batch_size=4)

    class Killed(Exception):
        pass

    def die(path: Path) -> None:
        assert path.exists()
        raise Killed

    with pytest.raises(Killed):
        f.step(before_commit=die)
    f.close()
    assert len(delivered(tmp_path)) == 4 and cursor(database_url, "crash") == (0, 0)
    again = Follower(database_url, "crash", Selection(), tmp_path, "jsonl", batch_size=4)
    try:
        drain(again)
    finally:
        again.close()
    got = delivered(tmp_path)
    assert sorted(got) == sorted({(f"cr.{t}.{g}", 1) for t in range(3) for g in range(3)})
    assert len(got) == len(set(got)) == 9
    assert cursor(database_url, "crash") == (3, 9)


def test_one_live_reader_per_consumer(database_url: str, tmp_path: Path) -> None:
    f = Follower(database_url, "solo", Selection(), tmp_path, "jsonl")
    try:
        with pytest.raises(CursorError, match="another process"):
            Follower(database_url, "solo", Selection(), tmp_path, "jsonl")
    finally:
        f.close()
    Follower(database_url, "solo", Selection(), tmp_path, "jsonl").close()
    with pytest.raises(CursorError, match="must match"):
        Follower(database_url, "bad.name", Selection(), tmp_path, "jsonl")


def test_a_consumer_session_has_short_tcp_keepalives(database_url: str) -> None:
    # after a node loss Postgres must notice the dead session within seconds, or the consumer's advisory lock
    # (one reader per consumer) keeps the replacement exporter out for the OS default of two hours
    cursors = Cursors.open(database_url, "keepalive")
    try:
        got = dict(cursors.conn.execute("SELECT name, setting::int FROM pg_settings WHERE name = ANY(%s)",
                                        (list(KEEPALIVE),)).fetchall())
    finally:
        cursors.close()
    assert got == KEEPALIVE == {"tcp_keepalives_idle": 10, "tcp_keepalives_interval": 5, "tcp_keepalives_count": 3}


def test_killed_follow_process_delivers_everything_exactly_once(database_url: str, tmp_path: Path) -> None:
    """Trajectories keep landing while a real `rollout export --follow` is SIGKILLed three times mid-stream."""
    out = tmp_path / "out"
    env = dict(os.environ, DATABASE_URL=database_url, ROLLOUT_EXPORT_BATCH_SIZE="4", ROLLOUT_EXPORT_POLL_S="0.02",
               ROLLOUT_LOG_FORMAT="json")
    cmd = [sys.executable, "-m", "rollout_ledger.cli.main", "export", "--consumer", "trainer", "--follow",
           "--format", "jsonl", "--out", str(out)]
    batches = 40
    seeded = threading.Event()

    def seeder() -> None:
        for i in range(batches):
            seed_batch(database_url, f"k{i}", [[Traj(), Traj(), Traj()] for _ in range(2)])
        seeded.set()

    thread = threading.Thread(target=seeder, daemon=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    thread.start()
    try:
        for kill_after in (8, 40, 100):
            wait_for(partial(at_least, out, kill_after), 60, f"{kill_after} records delivered")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert seeded.wait(60)
        total = batches * 6
        wait_for(lambda: cursor(database_url, "trainer")[1] == total, 60, "every trajectory delivered")
        # The last process may have had nothing left to deliver: wait until it holds the consumer (its signal
        # handlers are installed before it claims the consumer's advisory lock), then stop it.
        wait_for(partial(consumer_claimed, database_url, "trainer"), 60, "the last exporter to hold the consumer")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        thread.join(60)
    got = delivered(out)
    want = {(f"k{i}.{t}.{g}", 1) for i in range(batches) for t in range(2) for g in range(3)}
    assert len(got) == len(set(got)) == total  # no duplicates
    assert set(got) == want  # no gaps
    assert not list(out.glob("*.partial"))
    assert cursor(database_url, "trainer") == (len(list(out.glob("*.jsonl"))), total)


def test_trajectory_reader_acknowledges_exactly_once(database_url: str) -> None:
    seed_batch(database_url, "api", [[Traj(reward=1.0), Traj(reward=0.0)], [Traj(reward=0.5)]])
    with TrajectoryReader(database_url, "py", fmt="slime", batch_size=2) as reader:
        first = reader.next_batch()
        assert first is not None and len(first) == 2
        with pytest.raises(CursorError, match="acknowledge"):
            reader.next_batch()
    with TrajectoryReader(database_url, "py", fmt="slime", batch_size=2) as reader:  # a restart before the ack
        again = reader.next_batch()
        assert again is not None and again.table.equals(first.table)
        cols = again.numpy()
        assert cols["tokens"][0].dtype.name == "int32" and cols["reward"].tolist() == [1.0, 0.0]
        again.ack()
        again.ack()  # idempotent
        rest = []
        for batch in reader.batches():
            rest.append(batch.table.column("episode_id").to_pylist())
            batch.ack()
        assert rest == [["api.1.0"]]
        assert reader.next_batch() is None
    assert cursor(database_url, "py") == (2, 3)


def test_complete_groups_are_delivered_once_when_complete(database_url: str) -> None:
    seed_batch(database_url, "cg", [[Traj(reward=1.0), Traj(reward=0.0, status="running", with_trajectory=False)]])
    stop = threading.Event()
    sel = Selection(complete_groups=True)
    with TrajectoryReader(database_url, "groups", selection=sel, fmt="full") as reader:
        assert reader.next_batch() is None  # the group's first member alone: held, cursor steps over it
        template = run(database_url, "SELECT token_ids FROM trajectories WHERE episode_id = 'cg.0.0'")[0][0]
        run(database_url, "INSERT INTO trajectories (episode_id, episode_created_at, batch_id, group_id, env, attempt, "
            "status, reward, token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
            "num_sampled_tokens, num_turns, segments) SELECT 'cg.0.1', (SELECT created_at FROM episodes WHERE id = "
            "'cg.0.1'), batch_id, group_id, env, 1, 'completed', 0.0, "
            "token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
            "num_sampled_tokens, num_turns, segments FROM trajectories WHERE episode_id = 'cg.0.0'")
        run(database_url, "UPDATE episodes SET status = 'completed' WHERE id = 'cg.0.1'")
        tables = []
        for batch in reader.batches(stop=stop):
            tables.append(batch.table)
            batch.ack()
        assert len(tables) == 1
        table = tables[0]
        assert table.column("episode_id").to_pylist() == ["cg.0.0", "cg.0.1"]
        assert table.column("advantage").to_pylist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)], rel=1e-5)
        assert table.column("token_ids").to_pylist()[1] == list(template)
        assert reader.next_batch() is None


def test_a_group_whose_last_member_ends_without_a_trajectory_is_delivered(database_url: str,
                                                                          tmp_path: Path) -> None:
    # the last member fails before producing a trajectory: the episode's end leaves a marker in the feed (migration
    # 0007), the group is read again and is complete without it; a consumer of every trajectory gets nothing extra
    seed_batch(database_url, "gm", [[Traj(reward=1.0), Traj(reward=0.0),
                                     Traj(reward=None, status="running", with_trajectory=False)]])
    every = Follower(database_url, "every", Selection(), tmp_path, "jsonl")
    try:
        with TrajectoryReader(database_url, "grouped", selection=Selection(complete_groups=True), fmt="full") as r:
            assert r.next_batch() is None  # two members stored, the third still running: held
            drain(every)
            run(database_url, "UPDATE episodes SET status = 'failed', failure_class = 'env_error' "
                "WHERE id = 'gm.0.2'")
            markers = run(database_url, "SELECT episode_id, attempt FROM trajectory_feed WHERE attempt = 0")
            assert markers == [("gm.0.2", 0)]
            batch = r.next_batch()
            assert batch is not None
            assert batch.table.column("episode_id").to_pylist() == ["gm.0.0", "gm.0.1"]
            assert batch.table.column("group_size").to_pylist() == [2, 2]
            assert batch.table.column("advantage").to_pylist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)],
                                                                                rel=1e-5)
            batch.ack()
            assert r.next_batch() is None
        assert every.step() == (None, 0)  # the marker: read, nothing selected, the cursor steps over it
        assert every.step() is None
        assert delivered(tmp_path) == [("gm.0.0", 1), ("gm.0.1", 1)]
    finally:
        every.close()
    assert prune(database_url).dead >= 1  # every consumer passed the marker: it goes with the dead entries
    assert run(database_url, "SELECT count(*) FROM trajectory_feed WHERE attempt = 0") == [(0,)]


def test_a_new_consumer_can_start_at_the_latest(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "old", [[Traj(), Traj()]])
    f = Follower(database_url, "fresh", Selection(), tmp_path, "jsonl", start="latest")
    try:
        assert f.step() is None
        seed_batch(database_url, "new", [[Traj()]])
        drain(f)
        assert delivered(tmp_path) == [("new.0.0", 1)]
    finally:
        f.close()
    again = Follower(database_url, "fresh", Selection(), tmp_path, "jsonl", start="earliest")  # keeps its position
    try:
        assert again.step() is None
    finally:
        again.close()
