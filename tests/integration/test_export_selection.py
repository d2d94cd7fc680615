"""Selection in SQL: staleness window, complete groups, uniform groups, filters, single-segment trajectories,
advantages, versioned rewards."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout_ledger.cli.main import app
from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
from rollout_ledger.client.selection import BeyondStaleness, RewardChoice, Selection
from rollout_ledger.client.source import connect, connect_arrow, fetch
from rollout_ledger.services.exporter.export import export
from rollout_ledger.services.exporter.retention import lag_query, stored_selection
from rollout_ledger.services.exporter.rewards import RewardError, RewardInput, rescore, resolve
from tests.advantages_reference import group_advantages
from tests.integration.export_data import Traj, run, seed_batch


def select(url: str, sel: Selection) -> list[dict]:
    with connect(url) as conn, connect_arrow(url) as arrow:
        return list(fetch(conn, arrow, sel))


def ids(rows: list[dict]) -> list[str]:
    return [r["episode_id"] for r in rows]


def test_staleness_window_is_a_query(database_url: str) -> None:
    seed_batch(database_url, "w", [[
        Traj(segments=((4, ((2, 1), (2, 0))),), versions=(10, 12)),  # oldest token 2 behind 12
        Traj(segments=((4, ((2, 1), (2, 0))),), versions=(9, 12)),   # 3 behind: stale
        Traj(versions=(12,)),
        Traj(versions=(13,)),                                         # newer than V: not in [V - k, V]
    ]])
    assert ids(select(database_url, Selection(version=12, max_staleness=2))) == ["w.0.0", "w.0.2"]
    assert ids(select(database_url, Selection(version=12, max_staleness=3))) == ["w.0.0", "w.0.1", "w.0.2"]
    assert ids(select(database_url, Selection(version=12, max_staleness=0))) == ["w.0.2"]
    assert ids(select(database_url, Selection(version=13, max_staleness=0))) == ["w.0.3"]


def test_complete_groups_and_uniform_groups(database_url: str) -> None:
    seed_batch(database_url, "g", [
        [Traj(reward=1.0), Traj(reward=0.0)],                                   # complete, mixed
        [Traj(reward=1.0), Traj(reward=None, status="running", with_trajectory=False)],  # one still running
        [Traj(reward=1.0), Traj(reward=0.0, status="failed")],                 # a failed member
        [Traj(reward=0.5), Traj(reward=0.5)],                                  # complete, all equal
        [Traj(reward=1.0), Traj(status="failed", with_trajectory=False)],      # failed without a trajectory
    ])
    everything = ids(select(database_url, Selection()))
    assert len(everything) == 8
    complete = select(database_url, Selection(complete_groups=True))
    # a member that ended without a trajectory has nothing to train on: its group is complete without it
    assert ids(complete) == ["g.0.0", "g.0.1", "g.2.0", "g.2.1", "g.3.0", "g.3.1", "g.4.0"]
    assert [r["group_size"] for r in complete] == [2, 2, 2, 2, 2, 2, 1]
    trainable = Selection(complete_groups=True, statuses=("completed", "truncated"))
    assert ids(select(database_url, trainable)) == ["g.0.0", "g.0.1", "g.3.0", "g.3.1", "g.4.0"]
    both = Selection(complete_groups=True, drop_uniform=True, statuses=("completed", "truncated"))
    assert ids(select(database_url, both)) == ["g.0.0", "g.0.1"]
    assert ids(select(database_url, Selection(drop_uniform=True))) == ["g.0.0", "g.0.1", "g.2.0", "g.2.1"]


def test_row_filters(database_url: str) -> None:
    seed_batch(database_url, "r1", [[Traj(reward=0.2), Traj(reward=0.9, status="truncated")]], env="arithmetic",
               created_at="2026-01-01T00:00:00Z")
    seed_batch(database_url, "r2", [[Traj(reward=0.5)]], env="guess-number", created_at="2026-02-01T00:00:00Z")
    assert ids(select(database_url, Selection(batch_ids=("r2",)))) == ["r2.0.0"]
    assert ids(select(database_url, Selection(envs=("arithmetic",)))) == ["r1.0.0", "r1.0.1"]
    assert ids(select(database_url, Selection(statuses=("truncated",)))) == ["r1.0.1"]
    assert ids(select(database_url, Selection(reward_min=0.3, reward_max=0.6))) == ["r2.0.0"]
    jan = Selection(since=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), until=dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    assert ids(select(database_url, jan)) == ["r1.0.0", "r1.0.1"]


@pytest.mark.parametrize("spec", [
    AdvantageSpec(AdvantageKind.GRPO, epsilon=1e-6),
    AdvantageSpec(AdvantageKind.GRPO, epsilon=0.5),
    AdvantageSpec(AdvantageKind.GRPO, normalize_std=False),
    AdvantageSpec(AdvantageKind.RLOO),
    AdvantageSpec(AdvantageKind.NONE),
], ids=lambda s: s.describe())
def test_group_advantages_in_sql(database_url: str, spec: AdvantageSpec) -> None:
    groups = [[1.0, 0.0, 0.0, 1.0], [0.25, 0.75, 2.0], [0.3]]
    seed_batch(database_url, "a", [[Traj(reward=r) for r in g] for g in groups])
    rows = select(database_url, Selection(advantage=spec))
    got = [r["advantage"] for r in rows]
    want = [a for g in groups for a in group_advantages(g, spec)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    if spec.kind is AdvantageKind.GRPO and spec.normalize_std and spec.epsilon == 1e-6:
        std = (1 / 3) ** 0.5  # group 0 by hand: mean 0.5, sample std sqrt(1/3)
        assert got[:4] == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6),
                                         0.5 / (std + 1e-6)])
        assert got[7] == 0.0  # a group of one
    if spec.kind is AdvantageKind.RLOO:
        assert got[4:7] == pytest.approx([0.25 - 1.375, 0.75 - 1.125, 2.0 - 0.5])


def shorter(x: RewardInput) -> tuple[float, dict]:
    """A user reward: 1 / sampled tokens, with an info dict."""
    return 1.0 / x.num_sampled_tokens, {"actions": len(x.actions)}


def test_rescore_with_versioned_rewards_and_export_them(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "v", [[Traj(reward=1.0), Traj(reward=0.0, segments=((4, ((4, 1),)),))]])
    rf = resolve("shorter", "1", f"{__name__}:shorter")
    assert rescore(database_url, rf, Selection(batch_ids=("v",))).scored == 2
    again = rescore(database_url, rf, Selection(batch_ids=("v",)))
    assert (again.scored, again.skipped) == (0, 2)  # a version is immutable: scored once per attempt
    assert rescore(database_url, resolve("length_penalty"), Selection()).scored == 2
    scores = run(database_url, "SELECT episode_id, reward_name, reward_version, attempt, score, info FROM "
                 "reward_scores ORDER BY 2, 1")
    assert scores == [
        ("v.0.0", "length_penalty", "1", 1, pytest.approx(1.0 - 0.003), {}),
        ("v.0.1", "length_penalty", "1", 1, pytest.approx(-0.004), {}),
        ("v.0.0", "shorter", "1", 1, pytest.approx(1 / 3), {"actions": 0}),
        ("v.0.1", "shorter", "1", 1, pytest.approx(1 / 4), {"actions": 0}),
    ]
    chosen = select(database_url, Selection(reward=RewardChoice("shorter", "1"), advantage=AdvantageSpec(
        AdvantageKind.NONE)))
    assert [r["reward"] for r in chosen] == pytest.approx([1 / 3, 1 / 4])
    assert [r["rollout_reward"] for r in chosen] == [1.0, 0.0]
    assert select(database_url, Selection(reward=RewardChoice("shorter", "2"))) == []
    out = export(database_url, Selection(reward=RewardChoice("shorter", "1")), tmp_path / "x.jsonl", "jsonl")
    assert out.records == 2
    # a replaced trajectory (higher attempt) is scored again
    run(database_url, "UPDATE trajectories SET attempt = 2 WHERE episode_id = 'v.0.0'")
    assert rescore(database_url, rf, Selection()).scored == 1
    with pytest.raises(RewardError, match="--version is required"):
        resolve("mine", None, f"{__name__}:shorter")
    with pytest.raises(RewardError, match="unknown built-in"):
        resolve("nope")


def test_cli_export_and_rescore(database_url: str, tmp_path: Path) -> None:
    """The command line maps its options onto the same selection (and refuses bad ones with a message)."""
    seed_batch(database_url, "c", [[Traj(reward=1.0, versions=(11,)), Traj(reward=0.0, versions=(12,))],
                                   [Traj(reward=1.0, versions=(8,)), Traj(reward=1.0, versions=(12,))]])
    runner = CliRunner()
    env = {"DATABASE_URL": database_url}
    res = runner.invoke(app, ["export", "--batch", "c", "--version", "12", "--max-staleness", "2",
                              "--complete-groups", "--advantage", "rloo", "--format", "verl", "--file-type", "jsonl",
                              "--out", str(tmp_path)], env=env)
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "c.verl.jsonl").read_text().splitlines()
    assert [(json.loads(x)["episode_id"], json.loads(x)["advantage"]) for x in lines] == [("c.0.0", 1.0),
                                                                                           ("c.0.1", -1.0)]
    res = runner.invoke(app, ["rescore", "--reward", "success", "--batch", "c"], env=env)
    assert res.exit_code == 0 and "scored 4" in res.output, res.output
    res = runner.invoke(app, ["export", "--reward", "success@1", "--format", "parquet", "--name", "s.parquet",
                              "--out", str(tmp_path)], env=env)
    assert res.exit_code == 0 and res.output.startswith("4 records"), res.output
    bad = runner.invoke(app, ["export", "--max-staleness", "2"], env=env)
    assert bad.exit_code == 2 and "staleness window needs" in bad.output
    bad = runner.invoke(app, ["export", "--format", "megatron"], env=env)
    assert bad.exit_code == 2 and "unknown format" in bad.output
    bad = runner.invoke(app, ["export", "--follow"], env=env)
    assert bad.exit_code == 2 and "--follow needs --consumer" in bad.output


def test_trajectories_beyond_their_batch_staleness_are_marked_and_selectable(database_url: str,
                                                                            tmp_path: Path) -> None:
    seed_batch(database_url, "k1", [[
        Traj(segments=((4, ((2, 1), (2, 0))),), versions=(10, 12)),  # spans 2 versions: beyond k = 1
        Traj(segments=((4, ((2, 1), (2, 0))),), versions=(11, 12)),  # spans 1: within
        Traj(versions=(12,)),
    ]])
    seed_batch(database_url, "free", [[Traj(segments=((4, ((2, 1), (2, 0))),), versions=(3, 9))]])  # no bound
    run(database_url, "UPDATE batches SET max_staleness = 1 WHERE id = 'k1'")
    marked = run(database_url, "SELECT episode_id, version_span, max_staleness, beyond_staleness "
                               "FROM v_trajectory_versions ORDER BY episode_id")
    assert marked == [("free.0.0", 6, None, False), ("k1.0.0", 2, 1, True), ("k1.0.1", 1, 1, False),
                      ("k1.0.2", 0, 1, False)]
    assert ids(select(database_url, Selection())) == ["free.0.0", "k1.0.0", "k1.0.1", "k1.0.2"]
    assert ids(select(database_url, Selection(beyond_staleness=BeyondStaleness.EXCLUDE))) == [
        "free.0.0", "k1.0.1", "k1.0.2"]
    assert ids(select(database_url, Selection(beyond_staleness=BeyondStaleness.ONLY))) == ["k1.0.0"]
    with pytest.raises(ValueError, match="'some' is not a valid BeyondStaleness"):
        Selection(beyond_staleness="some")  # type: ignore[arg-type]
    out = CliRunner().invoke(app, ["export", "--batch", "k1", "--beyond-staleness", "exclude", "--format", "jsonl",
                                   "--database-url", database_url, "--out", str(tmp_path), "--name", "k1.jsonl"])
    assert out.exit_code == 0, out.output
    exported = [json.loads(line)["episode_id"] for line in (tmp_path / "k1.jsonl").read_text().splitlines()]
    assert exported == ["k1.0.1", "k1.0.2"]


def test_single_segment_selection_drops_multi_segment_trajectories(database_url: str, tmp_path: Path) -> None:
    two = ((4, ((2, 1),)), (5, ((2, 0),)))  # a second segment: the context was rendered again
    seed_batch(database_url, "ss", [
        [Traj(reward=1.0), Traj(reward=0.0, segments=two)],   # one member has two segments
        [Traj(reward=1.0), Traj(reward=0.0)],                  # both one segment
        [Traj(reward=0.5, segments=((4, ((2, 1), (3, 0))),))],  # two turns, one segment
    ])
    run(database_url, "UPDATE trajectories SET num_segments = 0, segments = '{}' WHERE episode_id = 'ss.1.1'")
    assert run(database_url, "SELECT episode_id, num_segments FROM trajectories ORDER BY 1") == [
        ("ss.0.0", 1), ("ss.0.1", 2), ("ss.1.0", 1), ("ss.1.1", 0), ("ss.2.0", 1)]
    assert len(select(database_url, Selection())) == 5
    single = Selection(single_segment=True)
    rows = select(database_url, single)  # a trajectory without recorded segments is read as one
    assert ids(rows) == ["ss.0.0", "ss.1.0", "ss.1.1", "ss.2.0"]
    assert all(len(r["segments"]) == 1 for r in rows)
    assert [r["group_size"] for r in rows] == [1, 2, 2, 1]  # group statistics over the selected members only
    # a row filter: a group with a multi-segment member is not complete under it
    assert ids(select(database_url, replace(single, complete_groups=True))) == ["ss.1.0", "ss.1.1", "ss.2.0"]
    assert single.as_json()["single_segment"] is True
    assert stored_selection(json.loads(json.dumps(single.as_json()))) == single  # what a consumer's cursor keeps
    assert "t.num_segments <= 1" in lag_query(single)[0]
    out = CliRunner().invoke(app, ["export", "--batch", "ss", "--single-segment", "--format", "slime",
                                   "--file-type", "jsonl", "--database-url", database_url, "--out", str(tmp_path),
                                   "--name", "s.jsonl"])
    assert out.exit_code == 0 and out.output.startswith("4 records"), out.output  # one sample per trajectory
    assert [json.loads(line)["episode_id"] for line in (tmp_path / "s.jsonl").read_text().splitlines()] == [
        "ss.0.0", "ss.1.0", "ss.1.1", "ss.2.0"]
    out = CliRunner().invoke(app, ["export", "--batch", "ss", "--format", "slime", "--file-type", "jsonl",
                                   "--database-url", database_url, "--out", str(tmp_path), "--name", "all.jsonl"])
    assert out.exit_code == 0 and out.output.startswith("6 records"), out.output  # ss.0.1: two samples
