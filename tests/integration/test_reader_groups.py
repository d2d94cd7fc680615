"""``TrajectoryReader.read_groups``: exactly N complete groups per read, in the order they completed, each delivered
once; a group still running holds nothing back and is not taken; fewer than N takes nothing."""

from __future__ import annotations

import threading

import pytest

from rollout_ledger.client import Selection, TrajectoryReader
from rollout_ledger.client.cursor import CursorError
from tests.integration.export_data import Traj, run, seed_batch


def groups_of(batch: object) -> list[str]:
    cols = batch.numpy()  # type: ignore[attr-defined]
    return list(dict.fromkeys(str(g) for g in cols["group_id"]))


def test_exactly_n_groups_a_read_each_once(database_url: str) -> None:
    seed_batch(database_url, "rg", [[Traj(), Traj()] for _ in range(5)])
    sel = Selection(complete_groups=True, batch_ids=("rg",))
    seen: list[str] = []
    with TrajectoryReader(database_url, "rg-groups", selection=sel, fmt="trl") as reader:
        for _ in range(2):
            batch = reader.read_groups(2, timeout_s=0)
            assert batch is not None and len(batch) == 4
            got = groups_of(batch)
            assert len(got) == 2 and not set(got) & set(seen)
            seen += got
            with pytest.raises(CursorError):  # the previous batch first
                reader.read_groups(2, timeout_s=0)
            batch.ack()
        assert reader.read_groups(2, timeout_s=0.3) is None  # one group left: nothing taken
        last = reader.read_groups(1, timeout_s=0)
        assert last is not None and len(last) == 2
        seen += groups_of(last)
        last.ack()
        assert reader.read_groups(1, timeout_s=0) is None
    assert sorted(seen) == [f"rg.{i}" for i in range(5)]
    assert run(database_url, "SELECT deliveries, delivered FROM export_cursors WHERE consumer = 'rg-groups'") \
        == [(3, 10)]


def test_a_running_group_is_not_taken_and_holds_nothing_back(database_url: str) -> None:
    running = Traj(episode_status="running", with_trajectory=False)
    seed_batch(database_url, "rh", [[Traj(), running], [Traj(), Traj()], [Traj(), Traj()]])
    sel = Selection(complete_groups=True, batch_ids=("rh",))
    with TrajectoryReader(database_url, "rh-groups", selection=sel, fmt="slime") as reader:
        batch = reader.read_groups(2, timeout_s=0)
        assert batch is not None and groups_of(batch) == ["rh.1", "rh.2"]
        batch.ack()
        # the running member ends: its trajectory's feed entry completes group 0, delivered now
        run(database_url, "UPDATE episodes SET status = 'completed' WHERE id = 'rh.0.1'")
        cols = ("batch_id, group_id, env, attempt, status, reward, token_ids, loss_mask, logprobs, weight_versions, "
                "action_ranges, prompt_len, num_tokens, num_sampled_tokens, num_turns, segments, num_segments")
        run(database_url, f"INSERT INTO trajectories (episode_id, episode_created_at, {cols}) SELECT 'rh.0.1', "
                          f"(SELECT created_at FROM episodes WHERE id = 'rh.0.1'), {cols} FROM trajectories "
                          "WHERE episode_id = 'rh.0.0'")
        got = reader.read_groups(1, timeout_s=0)
        assert got is not None and groups_of(got) == ["rh.0"] and len(got) == 2
        got.ack()


def test_read_groups_waits_for_them_and_stops_on_request(database_url: str) -> None:
    sel = Selection(complete_groups=True, batch_ids=("rw",))
    with TrajectoryReader(database_url, "rw-groups", selection=sel, fmt="verl") as reader:
        stop = threading.Event()
        stop.set()
        assert reader.read_groups(1, stop=stop) is None
        timer = threading.Timer(0.5, lambda: seed_batch(database_url, "rw", [[Traj()]]))
        timer.start()
        try:
            batch = reader.read_groups(1, timeout_s=60, poll_s=0.05)  # waits for the condition, not a sleep
        finally:
            timer.join()
        assert batch is not None and groups_of(batch) == ["rw.0"]
        batch.ack()


def test_whole_groups_need_a_complete_groups_selection(database_url: str) -> None:
    with TrajectoryReader(database_url, "rx-groups", selection=Selection(), fmt="trl") as reader, \
            pytest.raises(CursorError, match="complete_groups"):
        reader.read_groups(1, timeout_s=0)


def test_a_consumer_far_behind_steps_over_what_selects_nothing(database_url: str) -> None:
    """More feed entries of other batches than one look takes: they are stepped over, the groups are read."""
    seed_batch(database_url, "ro", [[Traj(), Traj()] for _ in range(6)])  # 12 entries of another batch first
    seed_batch(database_url, "rs", [[Traj(), Traj()] for _ in range(2)])
    sel = Selection(complete_groups=True, batch_ids=("rs",))
    with TrajectoryReader(database_url, "rs-groups", selection=sel, fmt="trl") as reader:
        batch = reader.read_groups(2, timeout_s=0, scan=5)
        assert batch is not None and groups_of(batch) == ["rs.0", "rs.1"]
        batch.ack()
    deliveries, delivered = run(database_url, "SELECT deliveries, delivered FROM export_cursors "
                                              "WHERE consumer = 'rs-groups'")[0]
    assert (deliveries, delivered) == (1, 4), "stepping over is not a delivery"
