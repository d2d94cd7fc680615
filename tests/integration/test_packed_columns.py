"""The exporter's copies on ``trajectories`` (migrations 0005, 0008): ``token_ids_le`` (packed little-endian),
``sampled_logprobs_le`` (the logprobs inside the action ranges, packed) and ``action_versions`` agree with the SQL
arrays whoever writes the row: the recorder writes them (tests/integration/test_export_rebuild.py compares its
rows), any other writer gets them from the trigger, an UPDATE of an array or of the ranges refreshes them, and a
copy of the wrong length is refused."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest

from rollout_ledger.migrations.runner import downgrade, upgrade
from tests.integration.export_data import Traj, run, seed_batch


def stored(database_url: str) -> list[tuple]:
    return run(database_url, "SELECT episode_id, token_ids, logprobs, weight_versions, action_ranges, token_ids_le, "
                             "sampled_logprobs_le, action_versions FROM trajectories ORDER BY episode_id")


def check(row: tuple) -> None:
    _, ids, lps, wv, ranges, ids_le, lps_le, versions = row
    assert np.frombuffer(ids_le, "<i4").tolist() == ids
    assert lps_le == b"".join(np.array(lps[a:b], "<f4").tobytes() for a, b in ranges)
    assert versions == [wv[a] if b > a else None for a, b in ranges]


def test_the_trigger_fills_the_copies_for_any_writer(database_url: str) -> None:
    seed_batch(database_url, "p", [[Traj(segments=((4, ((3, 2), (0, 1), (2, 0))),), versions=(3, 4, 5)),
                                    Traj(segments=((2, ()),))]])
    rows = stored(database_url)
    assert len(rows) == 2
    for row in rows:
        check(row)
    assert rows[0][7] == [3, None, 5] and rows[1][7] == []


def test_extreme_values_pack_exactly(database_url: str) -> None:
    seed_batch(database_url, "x", [[Traj()]])
    run(database_url, "UPDATE trajectories SET token_ids = %s, logprobs = %s::float4[], loss_mask = '{0,1,1}', "
                      "weight_versions = '{-1,7,7}', action_ranges = '{{1,3}}', num_tokens = 3",
        ([-(2**31), 2**31 - 1, 0], [0.0, -1e-45, float("-inf")]))
    (row,) = stored(database_url)
    check(row)
    assert row[7] == [7]


def test_an_update_of_the_ranges_refreshes_the_sampled_logprobs(database_url: str) -> None:
    seed_batch(database_url, "r", [[Traj(segments=((4, ((3, 2),)),), versions=(2,))]])
    run(database_url, "UPDATE trajectories SET action_ranges = '{{4,6}}', loss_mask = '{0,0,0,0,1,1,0,0,0}', "
                      "logprobs[6] = -0.75::float4")
    (row,) = stored(database_url)
    check(row)
    assert np.frombuffer(row[6], "<f4").tolist() == np.array([row[2][4], -0.75], np.float32).tolist()


def test_an_update_of_the_arrays_refreshes_the_copies(database_url: str) -> None:
    seed_batch(database_url, "u", [[Traj(segments=((4, ((3, 2),)),), versions=(2,))]])
    run(database_url, "UPDATE trajectories SET token_ids = array_append(token_ids, 99), "
                      "logprobs = array_append(logprobs, -0.5::float4), "
                      "weight_versions = '{-1,-1,-1,-1,9,9,9,-1,-1,-1}'")
    (row,) = stored(database_url)
    check(row)
    assert row[1][-1] == 99 and row[7] == [9]


def test_a_copy_of_the_wrong_length_is_refused(database_url: str) -> None:
    seed_batch(database_url, "w", [[Traj()]])
    with pytest.raises(psycopg.errors.CheckViolation):
        run(database_url, "UPDATE trajectories SET token_ids_le = substring(token_ids_le from 5)")
    with pytest.raises(psycopg.errors.CheckViolation):
        run(database_url, "UPDATE trajectories SET sampled_logprobs_le = sampled_logprobs_le || '\\x00000000'")
    with pytest.raises(psycopg.errors.CheckViolation):
        run(database_url, "UPDATE trajectories SET action_versions = '{}'")


def test_migration_0008_moves_stored_rows_to_the_sampled_copy_and_back(database_url: str) -> None:
    downgrade(database_url, "0007")
    seed_batch(database_url, "m", [[Traj(segments=((4, ((3, 2), (0, 1), (2, 0))),), versions=(3, 4, 5)),
                                    Traj(segments=((2, ()),)), Traj(segments=((3, ((2, 2),)), (5, ((1, 0),))))]])
    feed = run(database_url, "SELECT count(*) FROM trajectory_feed")
    upgrade(database_url)
    rows = stored(database_url)
    assert len(rows) == 3
    for row in rows:
        check(row)
    assert run(database_url, "SELECT count(*) FROM trajectory_feed") == feed  # the backfill announced nothing
    downgrade(database_url, "0007")
    for _, _, lps, _, _, _, lps_le, _ in run(database_url, "SELECT episode_id, token_ids, logprobs, weight_versions, "
                                             "action_ranges, token_ids_le, logprobs_le, action_versions "
                                             "FROM trajectories ORDER BY episode_id"):
        assert lps_le == np.array(lps, "<f4").tobytes()
