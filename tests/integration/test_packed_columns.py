"""The exporter's copies on ``trajectories`` (migration 0005): ``token_ids_le`` / ``logprobs_le`` (packed
little-endian) and ``action_versions`` agree with the SQL arrays whoever writes the row: the recorder writes them
(tests/integration/test_export_rebuild.py compares its rows), any other writer gets them from the trigger, an
UPDATE of an array refreshes them, and a copy of the wrong length is refused."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest

from tests.integration.export_data import Traj, run, seed_batch


def stored(database_url: str) -> list[tuple]:
    return run(database_url, "SELECT episode_id, token_ids, logprobs, weight_versions, action_ranges, token_ids_le, "
                             "logprobs_le, action_versions FROM trajectories ORDER BY episode_id")


def check(row: tuple) -> None:
    _, ids, lps, wv, ranges, ids_le, lps_le, versions = row
    assert np.frombuffer(ids_le, "<i4").tolist() == ids
    assert np.frombuffer(lps_le, "<f4").tolist() == pytest.approx(lps)
    assert np.frombuffer(lps_le, "<f4").tobytes() == np.array(lps, "<f4").tobytes()
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
        run(database_url, "UPDATE trajectories SET action_versions = '{}'")
