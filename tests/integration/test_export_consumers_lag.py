"""How far behind a consumer is (`rollout feed consumers`, docs/sql.md): only the feed entries after its cursor
that it would read into its selection count (rollout_ledger/services/exporter/retention.py, ``lag_query``)."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg

from rollout_ledger.client.selection import RewardChoice, Selection
from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.follow import Follower
from rollout_ledger.services.exporter.retention import consumers, stored_selection
from tests.integration.export_data import Traj, run, seed_batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "sql.md"


def drain(url: str, consumer: str, sel: Selection, out: Path) -> None:
    f = Follower(url, consumer, sel, out / consumer, "jsonl")
    try:
        while f.step() is not None:
            pass
    finally:
        f.close()


def lag(url: str) -> dict[str, tuple[int, int]]:
    """consumer -> (behind, entries after the cursor)."""
    return {c.consumer: (c.behind, c.entries) for c in consumers(url)}


def doc_lag(url: str) -> dict[str, tuple[int, int]]:
    """The same, by docs/sql.md's "how far behind" query."""
    (query,) = [q for q in re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S) if "export_cursors c" in q]
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        cur = conn.execute(query)
        assert cur.description is not None
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return {r["consumer"]: (int(r["behind"]), int(r["entries"])) for r in rows}


def new_episode(url: str, source: str, episode_id: str, group_id: str) -> None:
    """A new episode and trajectory in ``source``'s batch: copies of its rows under new ids (one feed entry)."""
    patch = f'{{"id": "{episode_id}", "episode_id": "{episode_id}", "group_id": "{group_id}"}}'
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("INSERT INTO episodes SELECT (jsonb_populate_record(NULL::episodes, to_jsonb(e) || %s)).* "
                     "FROM episodes e WHERE id = %s", (patch, source))
        conn.execute("INSERT INTO trajectories SELECT (jsonb_populate_record(NULL::trajectories, "
                     "to_jsonb(t) || %s)).* FROM trajectories t WHERE episode_id = %s", (patch, source))


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_ledger.cli.main", *args], capture_output=True,
                          text=True, timeout=60, check=False, env=dict(os.environ, ROLLOUT_LOG_FORMAT="json"))


def test_behind_counts_only_the_entries_of_the_consumers_batch(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "a", [[Traj(), Traj()], [Traj(), Traj()]])
    drain(database_url, "only-a", Selection(batch_ids=("a",)), tmp_path)
    drain(database_url, "everything", Selection(), tmp_path)
    assert lag(database_url) == {"only-a": (0, 0), "everything": (0, 0)}

    seed_batch(database_url, "b", [[Traj(), Traj()], [Traj(), Traj()], [Traj(), Traj()]])
    # the consumer of batch a has read all of it: b's entries after its cursor are not its to read
    assert lag(database_url) == {"only-a": (0, 6), "everything": (6, 6)}
    listed = rollout("feed", "consumers", "--database-url", database_url)
    assert listed.returncode == 0, listed.stderr
    assert "only-a\tposition " in listed.stdout and "\tbehind 0 (of 6 feed entries after the cursor)\t" in listed.stdout
    assert "\tbehind 6 (of 6 feed entries after the cursor)\t" in listed.stdout

    new_episode(database_url, "a.0.0", "a.9.0", "a.9")
    assert lag(database_url) == {"only-a": (1, 7), "everything": (7, 7)}
    assert doc_lag(database_url) == lag(database_url)

    drain(database_url, "only-a", Selection(batch_ids=("a",)), tmp_path)
    assert lag(database_url) == {"only-a": (0, 0), "everything": (7, 7)}
    assert doc_lag(database_url) == lag(database_url)


def test_behind_applies_every_row_filter_of_the_stored_selection(database_url: str, tmp_path: Path) -> None:
    selections = {
        "all": Selection(),
        "batch-a": Selection(batch_ids=("a",)),
        "env": Selection(envs=("guess-number",)),
        "completed": Selection(statuses=("completed",)),
        "a-rewarded": Selection(batch_ids=("a",), reward_min=0.5),
        "low-reward": Selection(reward_max=0.25),
        "version-3": Selection(version=3, max_staleness=0),
        "rescored": Selection(reward=RewardChoice("judge", "v1")),
        "rescored-high": Selection(reward=RewardChoice("judge", "v1"), reward_min=0.9),
        "since-2000": Selection(since=dt.datetime(2000, 1, 1, tzinfo=dt.UTC)),
        "until-2000": Selection(until=dt.datetime(2000, 1, 1, tzinfo=dt.UTC)),
        "groups-a": Selection(batch_ids=("a",), complete_groups=True, drop_uniform=True),
    }
    seed_batch(database_url, "z", [[Traj()]])  # every consumer reads it: its selection is stored
    for name, sel in selections.items():
        drain(database_url, name, sel, tmp_path)
    Follower(database_url, "fresh", Selection(), tmp_path / "fresh", "jsonl").close()  # registered, never advanced

    seed_batch(database_url, "a", [[Traj(reward=1.0), Traj(reward=0.0, status="truncated")],
                                   [Traj(reward=0.5, versions=(3,)), Traj(with_trajectory=False, status="running")]])
    run(database_url, "UPDATE episodes SET status = 'failed' WHERE id = 'a.1.1'")  # a group marker: no trajectory
    seed_batch(database_url, "b", [[Traj(reward=1.0), Traj(reward=1.0, status="failed")]], env="guess-number")
    run(database_url, "INSERT INTO reward_scores (episode_id, reward_name, reward_version, attempt, score) VALUES "
                      "('a.0.0', 'judge', 'v1', 1, 1.0), ('b.0.0', 'judge', 'v1', 1, 0.2), "
                      "('b.0.1', 'judge', 'v2', 1, 1.0)")
    (marker,) = run(database_url, "SELECT count(*) FROM trajectory_feed WHERE attempt = 0")
    assert marker == (1,)

    got = lag(database_url)
    entries = 6  # a: 3 trajectories and the marker; b: 2 trajectories
    assert got == {
        "all": (5, entries), "batch-a": (3, entries), "env": (2, entries), "completed": (3, entries),
        "a-rewarded": (2, entries), "low-reward": (1, entries), "version-3": (1, entries),
        "rescored": (2, entries), "rescored-high": (1, entries), "since-2000": (5, entries),
        "until-2000": (0, entries),
        "groups-a": (3, entries),  # group filters are decided by a read, per group: not applied
        "fresh": (6, 7),  # no selection stored yet: every trajectory entry, z's included
    }
    assert doc_lag(database_url) == got
    stored = {c.consumer: c.selection for c in consumers(database_url)}
    assert stored == {**selections, "fresh": None}  # the stored selection reads back as it was served

    # what the consumers then read agrees: those whose selection takes something from a or b get it
    for name in ("batch-a", "env", "version-3"):
        drain(database_url, name, selections[name], tmp_path)
    assert lag(database_url)["batch-a"] == lag(database_url)["env"] == lag(database_url)["version-3"] == (0, 0)


def test_an_unreadable_stored_selection_counts_every_entry(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "z", [[Traj()]])
    drain(database_url, "odd", Selection(batch_ids=("z",)), tmp_path)
    seed_batch(database_url, "a", [[Traj(), Traj()]])
    assert lag(database_url) == {"odd": (0, 2)}
    run(database_url, """UPDATE export_cursors SET selection = '{"reward": "no-version@"}' WHERE consumer = 'odd'""")
    assert stored_selection({"reward": "no-version@"}) is None
    assert lag(database_url) == {"odd": (2, 2)}
    assert stored_selection(None) is None and stored_selection({}) == Selection()
