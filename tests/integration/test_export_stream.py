"""``source.stream`` reads keys on one connection and rows on ``lookups`` others sharing its snapshot, pipelined:
every selected trajectory arrives once, in the selection's order, with the arrays it was stored with, for any
number of lookup connections and any chunk size; a trajectory replaced during the read does not leak in."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_ledger.services.exporter.selection import Selection
from rollout_ledger.services.exporter.source import connect, fetch, stream
from tests.integration.export_data import Traj, run, seed_batch


@pytest.fixture
def seeded(database_url: str) -> list[str]:
    groups = [[Traj(reward=float(i % 3), segments=((3 + g, ((2, 1), (i % 3, 2))),), versions=(g, g + 1))
               for i in range(3)] for g in range(7)]
    groups.append([Traj(segments=((2, ()),))])  # a prompt that sampled nothing
    ids = seed_batch(database_url, "s", groups)
    return [e for g in ids for e in g]


@pytest.mark.parametrize(("lookups", "chunk"), [(1, 1), (1, 4), (2, 1), (2, 5), (3, 2), (2, 500)])
def test_every_row_once_in_selection_order(database_url: str, seeded: list[str], lookups: int, chunk: int) -> None:
    stored = {r[0]: r[1:] for r in run(database_url, "SELECT episode_id, token_ids, logprobs, loss_mask, "
                                                     "weight_versions, action_ranges FROM trajectories")}
    with connect(database_url) as conn:
        want = [r["episode_id"] for r in fetch(conn, Selection())]
    got = [row for c in stream(database_url, Selection(), chunk, lookups=lookups) for row in c]
    assert [r["episode_id"] for r in got] == want and sorted(want) == sorted(seeded)
    for row in got:
        ids, lps, mask, wv, ranges = stored[row["episode_id"]]
        assert row["token_ids"].tolist() == ids and row["loss_mask"].tolist() == mask
        assert row["weight_versions"].tolist() == wv and row["action_ranges"] == (ranges or [])
        assert np.array_equal(row["logprobs"], np.array(lps, np.float32))


def test_a_replacement_during_the_read_is_not_seen(database_url: str, seeded: list[str]) -> None:
    rows = stream(database_url, Selection(), 2, lookups=2)
    first = next(rows)
    run(database_url, "UPDATE trajectories SET attempt = attempt + 1, reward = 42")
    rest = [r for c in rows for r in c]
    assert len(first) + len(rest) == len(seeded)
    assert all(r["attempt"] == 1 and r["rollout_reward"] != 42 for r in [*first, *rest])
