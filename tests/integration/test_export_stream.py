"""``source.stream`` reads a one-shot export as one streamed query (``selection.stream_query``): every selected
trajectory arrives once, in the same order and with the same keys (reward, advantage, group size) as a consumer's
whole read (``source.fetch``), with the arrays it was stored with, for any chunk size and selection; a trajectory
replaced during the read does not leak in; the plan never sorts the token arrays."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest

from rollout_ledger.client import source
from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
from rollout_ledger.client.selection import Selection, stream_query
from rollout_ledger.client.source import _rendered, connect, connect_arrow, fetch, stream
from rollout_ledger.shared.errors import StoreError
from tests.helpers import wait_for
from tests.integration.export_data import Traj, run, seed_batch


@pytest.fixture
def seeded(database_url: str) -> list[str]:
    groups = [[Traj(reward=float(i % 3), segments=((3 + g, ((2, 1), (i % 3, 2))),), versions=(g, g + 1))
               for i in range(3)] for g in range(7)]
    groups.append([Traj(segments=((2, ()),))])  # a prompt that sampled nothing
    ids = seed_batch(database_url, "s", groups)
    return [e for g in ids for e in g]


@pytest.mark.parametrize("chunk", [1, 2, 4, 5, 500])
def test_every_row_once_in_selection_order(database_url: str, seeded: list[str], chunk: int) -> None:
    stored = {r[0]: r[1:] for r in run(database_url, "SELECT episode_id, token_ids, logprobs, loss_mask, "
                                                     "weight_versions, action_ranges FROM trajectories")}
    with connect(database_url) as conn, connect_arrow(database_url) as arrow:
        want = [r["episode_id"] for r in fetch(conn, arrow, Selection())]
    got = [row for c in stream(database_url, Selection(), chunk) for row in c]
    assert [r["episode_id"] for r in got] == want and sorted(want) == sorted(seeded)
    for row in got:
        ids, lps, mask, wv, ranges = stored[row["episode_id"]]
        assert row["token_ids"].tolist() == ids and row["loss_mask"].tolist() == mask
        assert row["weight_versions"].tolist() == wv and row["action_ranges"] == (ranges or [])
        assert np.array_equal(row["logprobs"], np.array(lps, np.float32))


def test_a_replacement_during_the_read_is_not_seen(database_url: str, seeded: list[str]) -> None:
    rows = stream(database_url, Selection(), 2)
    first = next(rows)
    run(database_url, "UPDATE trajectories SET attempt = attempt + 1, reward = 42")
    rest = [r for c in rows for r in c]
    assert len(first) + len(rest) == len(seeded)
    assert all(r["attempt"] == 1 and r["rollout_reward"] != 42 for r in [*first, *rest])


SELECTIONS = [
    Selection(),
    Selection(complete_groups=True),
    Selection(drop_uniform=True),
    Selection(complete_groups=True, drop_uniform=True, reward_min=0.5),
    Selection(envs=("nope",)),
    Selection(advantage=AdvantageSpec(AdvantageKind.RLOO)),
    Selection(advantage=AdvantageSpec(AdvantageKind.GRPO, normalize_std=False)),
    Selection(advantage=AdvantageSpec(AdvantageKind.NONE), statuses=("completed",)),
]


@pytest.mark.parametrize("sel", SELECTIONS)
def test_a_stream_in_chunks_and_a_whole_read_agree(database_url: str, seeded: list[str], sel: Selection) -> None:
    # the one-shot export (streamed, cut into chunks) and a consumer's read (taken whole in an imported snapshot)
    # must agree on rows, order and every key column
    with connect(database_url) as conn, connect_arrow(database_url) as arrow:
        want = fetch(conn, arrow, sel)
    got = [row for c in stream(database_url, sel, 3) for row in c]
    keys = ("episode_id", "attempt", "reward", "advantage", "group_size")
    assert [tuple(r[k] for k in keys) for r in got] == [tuple(r[k] for k in keys) for r in want]


def test_a_consumer_that_stops_early_releases_the_connection(database_url: str, seeded: list[str]) -> None:
    # the reader closes its connection before the unfinished stream (which would otherwise be read to its end)
    rows = stream(database_url, Selection(), 1)
    assert len(next(rows)) == 1
    rows.close()
    query = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'rollout-exporter' "
             "AND pid <> pg_backend_pid()")
    # a backend leaves pg_stat_activity once its process has exited
    wait_for(lambda: run(database_url, query) == [(0,)], 5, "the exporter's backend to leave pg_stat_activity",
             interval_s=0.05)


def test_the_token_arrays_are_fetched_by_address_after_the_keys_are_ordered(database_url: str,
                                                                           seeded: list[str]) -> None:
    # late materialisation: whatever plan Postgres picks for the filters, only narrow keys are sorted and each
    # wide row is fetched by its ctid in a nested loop that keeps the keys' order (no sort above it)
    for sel in (Selection(), Selection(batch_ids=("s",), complete_groups=True, drop_uniform=True)):
        query, params, _ = stream_query(sel, None)
        plan = run(database_url, "EXPLAIN (FORMAT JSON) " + _rendered(query, params))[0][0][0]["Plan"]
        assert plan["Node Type"] == "Nested Loop", plan["Node Type"]
        inner = json.dumps(plan["Plans"][1])
        assert '"Tid Scan"' in inner and '"Sort"' not in inner


def test_parameters_are_rendered_as_quoted_literals(database_url: str, seeded: list[str]) -> None:
    # ADBC streams through COPY, which takes no bound parameters: values are quoted by psycopg into the query
    now = dt.datetime.now(dt.UTC)
    sel = Selection(batch_ids=("s", "it's; DROP TABLE trajectories; --"), since=now - dt.timedelta(days=1),
                    until=now + dt.timedelta(days=1), reward_min=-1e308)
    got = [r["episode_id"] for c in stream(database_url, sel) for r in c]
    assert sorted(got) == sorted(seeded)
    assert [r["episode_id"] for c in stream(database_url, Selection(batch_ids=("it's",))) for r in c] == []


def test_an_unreachable_store_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="cannot connect to Postgres"):
        list(stream("postgresql://nobody@127.0.0.1:1/none", Selection()))


def test_long_trajectories_stored_out_of_line_stream_exactly(database_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # 40,000-token trajectories: every per-token column is moved out of line (TOAST, compressed where it
    # shrinks), and with a 64 KiB driver batch each batch holds about one of them
    long = Traj(segments=((3000, ((12000, 5000), (15000, 0))), (30000, ((5000, 0),))), versions=(3, 4, 5))
    seed_batch(database_url, "long", [[long, Traj()], [long]])
    stored = {r[0]: r[1:] for r in run(database_url, "SELECT episode_id, token_ids, logprobs, loss_mask, "
                                                     "weight_versions, pg_column_toast_chunk_id(token_ids_le) IS NOT "
                                                     "NULL FROM trajectories")}
    assert [stored[e][4] for e in ("long.0.0", "long.0.1", "long.1.0")] == [True, False, True]  # out of line
    monkeypatch.setattr(source, "BATCH_BYTES", 64 << 10)
    got = [row for c in stream(database_url, Selection(), 2000) for row in c]
    assert sorted(r["episode_id"] for r in got) == sorted(stored)
    for row in got:
        ids, lps, mask, wv, _ = stored[row["episode_id"]]
        assert row["token_ids"].tolist() == ids and row["loss_mask"].tolist() == mask
        assert row["weight_versions"].tolist() == wv
        assert np.array_equal(row["logprobs"], np.array(lps, np.float32))
    assert max(len(r["token_ids"]) for r in got) == 70_000
