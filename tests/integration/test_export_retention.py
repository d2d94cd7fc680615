"""Feed retention on real Postgres: `rollout feed prune` deletes only what no consumer can need, so registered and
new consumers still get every trajectory version exactly once (rollout_ledger/services/exporter/retention.py)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.export import export
from rollout_ledger.services.exporter.follow import Follower
from rollout_ledger.services.exporter.retention import PruneResult, RetentionError, consumers, prune
from tests.helpers import wait_for
from tests.integration.export_data import Traj, delivered, run, seed_batch

Entry = tuple[int, int, str, int]
"""(xid, seq, episode_id, attempt)"""

STORED = [("b.0.0", 2), ("b.0.1", 1), ("b.1.0", 1), ("b.1.1", 3)]
"""The trajectory versions ``landscape`` leaves stored."""


def drain(f: Follower) -> None:
    while f.step() is not None:
        pass


def consume(url: str, consumer: str, out: Path, *, batch_size: int = 256, steps: int | None = None,
            complete_groups: bool = False) -> list[tuple[str, int]]:
    """Run consumer ``consumer`` (all it can, or ``steps`` reads) and return everything it delivered so far."""
    f = Follower(url, consumer, Selection(complete_groups=complete_groups), out, "jsonl", batch_size=batch_size)
    try:
        if steps is None:
            drain(f)
        else:
            for _ in range(steps):
                f.step()
    finally:
        f.close()
    return delivered(out)


def feed(url: str) -> list[Entry]:
    return [(int(r[0]), int(r[1]), str(r[2]), int(r[3]))
            for r in run(url, "SELECT xid, seq, episode_id, attempt FROM trajectory_feed ORDER BY xid, seq")]


def position(url: str, consumer: str) -> tuple[int, int]:
    (row,) = run(url, "SELECT xid, seq FROM export_cursors WHERE consumer = %s", (consumer,))
    return int(row[0]), int(row[1])


def bump(url: str, episode_id: str, attempt: int) -> None:
    """A new attempt replaces the stored trajectory (what the recorder's upsert does): one new feed entry."""
    run(url, "UPDATE trajectories SET attempt = %s WHERE episode_id = %s", (attempt, episode_id))


def landscape(url: str) -> None:
    """8 feed entries, 4 of them dead: two superseded versions of b.1.1, one of b.0.0, and b.2.0's row deleted."""
    seed_batch(url, "b", [[Traj(), Traj()], [Traj(), Traj()], [Traj()]])
    bump(url, "b.0.0", 2)
    bump(url, "b.1.1", 2)
    bump(url, "b.1.1", 3)
    run(url, "DELETE FROM trajectories WHERE episode_id = 'b.2.0'")


def xmin_reaches(url: str, xid: int) -> None:
    """Wait until no transaction older than ``xid`` runs anywhere in the cluster: the xmin is cluster-wide, and
    another database's transaction (an autovacuum's analyze, a test before this one) would hold it lower than this
    test's own. The xmin never goes back, so the prune that follows sees at least this one."""
    wait_for(lambda: int(run(url, "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")[0][0]) >= xid, 30,
             f"the cluster's xmin to reach {xid}")


def settled_prune(url: str, **kwargs: Any) -> PruneResult:
    """``prune`` once every feed entry's writer has ended and no older transaction runs (see ``xmin_reaches``)."""
    xmin_reaches(url, int(run(url, "SELECT coalesce(max(xid), 0) + 1 FROM trajectory_feed")[0][0]))
    return prune(url, **kwargs)


def test_dead_entries_are_pruned_only_once_every_consumer_passed_them(database_url: str, tmp_path: Path) -> None:
    landscape(database_url)
    assert len(feed(database_url)) == 8
    assert sorted(consume(database_url, "fast", tmp_path / "fast")) == STORED
    assert consume(database_url, "slow", tmp_path / "slow", steps=0) == []  # registered at the start of the feed

    res = settled_prune(database_url)
    assert (res.dead, res.aged, res.holder, res.consumers) == (0, 0, "slow", 2)
    assert len(feed(database_url)) == 8  # "slow" has passed nothing yet

    consume(database_url, "slow", tmp_path / "slow")
    res = settled_prune(database_url)
    assert (res.dead, res.aged, res.remaining) == (4, 0, 4)
    assert sorted((e[2], e[3]) for e in feed(database_url)) == STORED  # one entry per stored version is kept
    assert settled_prune(database_url).deleted == 0  # nothing more to do


def test_nothing_a_lagging_consumer_still_needs_is_pruned(database_url: str, tmp_path: Path) -> None:
    landscape(database_url)
    consume(database_url, "fast", tmp_path / "fast")
    consume(database_url, "slow", tmp_path / "slow", batch_size=3, steps=1)  # read 3 of the 8 entries
    slow_at = position(database_url, "slow")
    ahead = [e for e in feed(database_url) if (e[0], e[1]) > slow_at]
    assert len(ahead) == 5

    res = settled_prune(database_url)
    assert res.dead == 1 and res.horizon is not None and (res.horizon.xid, res.horizon.seq) == slow_at
    assert [e for e in feed(database_url) if (e[0], e[1]) > slow_at] == ahead  # untouched past the slowest
    got = consume(database_url, "slow", tmp_path / "slow", batch_size=3)
    assert sorted(got) == STORED and len(got) == len(set(got))


def test_consumers_after_a_prune_get_every_trajectory_exactly_once(database_url: str, tmp_path: Path) -> None:
    landscape(database_url)
    before = consume(database_url, "control", tmp_path / "control", batch_size=2)
    before_groups = consume(database_url, "control-groups", tmp_path / "control-groups", complete_groups=True)
    assert settled_prune(database_url).dead == 4

    bump(database_url, "b.0.1", 2)  # a replacement after the prune: a new entry, delivered to everybody
    want = sorted(set(STORED) - {("b.0.1", 1)} | {("b.0.1", 2)})
    assert sorted(before) == sorted(before_groups) == STORED  # group b.2 lost its only trajectory: incomplete
    for name, groups in (("fresh", False), ("fresh-groups", True)):
        got = consume(database_url, name, tmp_path / name, batch_size=2, complete_groups=groups)
        assert len(got) == len(set(got)), f"{name}: duplicates {got}"
        assert sorted(got) == want, name
    after = consume(database_url, "control", tmp_path / "control", batch_size=2)
    assert after == [*before, ("b.0.1", 2)]  # the registered consumer only gets the new version


def test_an_older_xid_can_carry_the_newer_version(database_url: str, tmp_path: Path) -> None:
    """(xid, seq) order is not commit order: "a later entry exists for the episode" alone does not make it dead."""
    seed_batch(database_url, "o", [[Traj()]])
    old = psycopg.connect(libpq_url(database_url))
    try:
        old.execute("SELECT pg_current_xact_id()")  # takes its xid now: older than the next writer's
        bump(database_url, "o.0.0", 2)  # a younger transaction replaces the trajectory first and commits
        old.execute("UPDATE trajectories SET attempt = 3 WHERE episode_id = 'o.0.0'")
        old.commit()
    finally:
        old.close()
    entries = [(e[2], e[3]) for e in feed(database_url)]
    assert entries == [("o.0.0", 1), ("o.0.0", 3), ("o.0.0", 2)]  # the stored version's entry is not the last
    assert consume(database_url, "a", tmp_path / "a") == [("o.0.0", 3)]

    assert settled_prune(database_url).dead == 2
    assert [(e[2], e[3]) for e in feed(database_url)] == [("o.0.0", 3)]
    assert consume(database_url, "new", tmp_path / "new") == [("o.0.0", 3)]


def test_age_retention_keeps_what_a_lagging_consumer_needs(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "old", [[Traj(), Traj()], [Traj(), Traj()]])
    seed_batch(database_url, "new", [[Traj()]])
    run(database_url, "UPDATE trajectory_feed SET logged_at = now() - interval '8 days' WHERE batch_id = 'old'")
    consume(database_url, "fast", tmp_path / "fast")
    consume(database_url, "slow", tmp_path / "slow", batch_size=2, steps=1)

    assert settled_prune(database_url).deleted == 0  # without --older-than live entries stay
    dry = settled_prune(database_url, older_than=dt.timedelta(days=7), dry_run=True)
    assert (dry.dead, dry.aged, dry.dry_run) == (0, 2, True) and len(feed(database_url)) == 5
    res = settled_prune(database_url, older_than=dt.timedelta(days=7))
    assert (res.dead, res.aged) == (0, 2)  # only the two entries "slow" has passed
    got = consume(database_url, "slow", tmp_path / "slow", batch_size=2)
    assert sorted(got) == [("new.0.0", 1), ("old.0.0", 1), ("old.0.1", 1), ("old.1.0", 1), ("old.1.1", 1)]

    assert settled_prune(database_url, older_than=dt.timedelta(days=7)).aged == 2
    assert settled_prune(database_url, older_than=dt.timedelta(days=30)).deleted == 0
    assert [e[2] for e in feed(database_url)] == ["new.0.0"]
    # A new consumer starting at the earliest now begins later; the one-shot export still reads everything.
    assert consume(database_url, "late", tmp_path / "late") == [("new.0.0", 1)]
    assert export(database_url, Selection(), tmp_path / "all.jsonl", "jsonl").records == 5


def test_a_prune_while_a_read_is_open_does_not_break_it(database_url: str, tmp_path: Path) -> None:
    landscape(database_url)
    out = tmp_path / "r"
    f = Follower(database_url, "r", Selection(), out, "jsonl", batch_size=2)
    results: list[PruneResult] = []

    def prune_now(path: Path) -> None:
        """Runs inside the read's REPEATABLE READ transaction, after the file is written, before the advance."""
        results.append(prune(database_url))
        bump(database_url, "b.0.1", 2)  # a delivered trajectory replaced meanwhile

    try:
        assert f.step() is not None  # entries 1-2
        assert f.step(before_commit=prune_now) is not None  # entries 3-4, with a prune in the middle
        assert results[0].dead == 1  # b.0.0@1, at or below the committed position of "r"
        drain(f)
    finally:
        f.close()
    got = delivered(out)
    assert len(got) == len(set(got))
    assert sorted(got) == sorted([*STORED, ("b.0.1", 2)])
    assert settled_prune(database_url).dead == 4  # b.1.1@1, b.1.1@2, b.2.0@1 and now b.0.1@1


def test_entries_at_or_above_the_snapshot_xmin_stay(database_url: str) -> None:
    """With no consumer there is no position bound; the xmin bound still keeps what a transaction still open
    could be ordered before (an open transaction's xid is below every later writer's)."""
    seed_batch(database_url, "x", [[Traj()]])
    open_tx = psycopg.connect(libpq_url(database_url))
    try:
        row = open_tx.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()  # holds every later xmin
        assert row is not None
        bump(database_url, "x.0.0", 2)
        bump(database_url, "x.0.0", 3)  # x.0.0@1 and x.0.0@2 are dead; @2 was written above the xmin
        xmin_reaches(database_url, int(row[0]))
        res = prune(database_url)
        assert (res.dead, res.consumers, res.horizon) == (1, 0, None)  # only x.0.0@1, written before it began
        assert [(e[2], e[3]) for e in feed(database_url)] == [("x.0.0", 2), ("x.0.0", 3)]
    finally:
        open_tx.rollback()
        open_tx.close()
    assert settled_prune(database_url).dead == 1
    assert [(e[2], e[3]) for e in feed(database_url)] == [("x.0.0", 3)]


def test_one_prune_at_a_time(database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended('rollout-feed-prune', 0))")
        with pytest.raises(RetentionError, match="another"):
            prune(database_url)
    assert settled_prune(database_url).deleted == 0


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `rollout` CLI in a process of its own (it configures logging for the process)."""
    return subprocess.run([sys.executable, "-m", "rollout_ledger.cli.main", *args], capture_output=True,
                          text=True, timeout=60, check=False, env=dict(os.environ, ROLLOUT_LOG_FORMAT="json"))


def test_feed_commands(database_url: str, tmp_path: Path) -> None:
    landscape(database_url)
    consume(database_url, "trainer", tmp_path / "t")
    listed = rollout("feed", "consumers", "--database-url", database_url)
    assert listed.returncode == 0 and listed.stdout.startswith("trainer\tposition ") and "behind 0" in listed.stdout
    dry = rollout("feed", "prune", "--database-url", database_url, "--dry-run", "--older-than", "7d")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 4 dead + 0 aged feed entries; 8 left; slowest consumer trainer" in dry.stdout
    done = rollout("feed", "prune", "--database-url", database_url)
    assert "deleted 4 dead + 0 aged feed entries; 4 left" in done.stdout, done.stdout + done.stderr
    assert '"event": "feed_pruned"' in done.stdout + done.stderr
    bad = rollout("feed", "prune", "--database-url", database_url, "--older-than", "soon")
    assert bad.returncode == 2 and "retention period" in bad.stderr
    assert [c.consumer for c in consumers(database_url)] == ["trainer"]
