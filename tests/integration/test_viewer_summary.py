"""The viewer's batch summary, counted in Postgres, against the same counts made in Python from the episode rows:
rewards on bin edges and float noise beside them, negative and one-value ranges, episodes without a reward or a
version, failures without a class, and a batch of 3,000 random episodes."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import pytest
from sqlalchemy import text

from rollout_ledger.services.scheduler.viewer import queries
from rollout_ledger.services.scheduler.viewer.queries import bin_edges, bin_of, version_label
from rollout_ledger.shared.db import create_engine
from rollout_ledger.shared.kit.settings import normalize_database_url
from tests.helpers import Sql

Episode = tuple[str, str, float | None, list[int] | None, str | None]
"""env, status, reward, weight_versions, failure_class."""


def _insert(sql: Sql, batch_id: str, episodes: list[Episode]) -> None:
    with sql.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, request_hash) "
            "VALUES (:b, 'mixed', 1, 1, '{}', :n, :n, 'x')"), {"b": batch_id, "n": len(episodes)})
        conn.execute(text(
            "INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status, reward, "
            "weight_versions, failure_class) VALUES (:id, :b, :id, 0, :i, :env, '{}', :status, :reward, "
            ":versions, :fc)"),
            [{"id": f"{batch_id}-{i}", "b": batch_id, "i": i, "env": env, "status": status, "reward": reward,
              "versions": versions, "fc": fc} for i, (env, status, reward, versions, fc) in enumerate(episodes)])


def _expected(episodes: list[Episode]) -> dict[str, Any]:
    """The summary made in Python, one episode at a time (how the viewer counted before Postgres did)."""
    rewards = [r for _, _, r, _, _ in episodes if r is not None]
    edges = bin_edges(rewards)
    counts: dict[tuple[str, str], list[int]] = {}
    sums: dict[tuple[str, str], float] = defaultdict(float)
    for env, _, reward, versions, _ in episodes:
        if reward is not None:
            key = (env, version_label(versions))
            counts.setdefault(key, [0] * (len(edges) - 1))[bin_of(edges, reward)] += 1
            sums[key] += reward
    return {
        "edges": edges,
        "histograms": {k: (c, sum(c), sums[k] / sum(c)) for k, c in counts.items()},
        "failures": dict(Counter(fc or "unknown" for _, s, _, _, fc in episodes if s == "failed")),
        "statuses": dict(Counter(s for _, s, _, _, _ in episodes)),
        "envs": sorted({e for e, *_ in episodes}),
        "versions": sorted({v for *_, vs, _ in episodes for v in (vs or ())}),
    }


async def _summary(database_url: str, batch_id: str) -> queries.BatchSummary:
    engine = create_engine(normalize_database_url(database_url))
    try:
        async with engine.connect() as conn:
            return await queries.batch_summary(conn, batch_id)
    finally:
        await engine.dispose()


def _check(summary: queries.BatchSummary, expected: dict[str, Any]) -> None:
    assert summary.edges == expected["edges"]
    got = {(h.env, h.version): (h.counts, h.n, h.mean) for h in summary.histograms}
    assert got.keys() == expected["histograms"].keys()
    for key, (counts, n, mean) in expected["histograms"].items():
        assert got[key][:2] == (counts, n), key
        assert got[key][2] == pytest.approx(mean), key
    assert [(h.env, h.version) for h in summary.histograms] == sorted(got)
    assert summary.failures == expected["failures"]
    assert summary.statuses == expected["statuses"]
    assert summary.envs == expected["envs"]
    assert summary.versions == expected["versions"]


EDGE_CASES: list[Episode] = [
    # rewards on every edge of [0, 1] in tenths, as 0.1 * k gives them (0.30000000000000004 lies just above 0.3)
    *[("math", "completed", 0.1 * k, [1], None) for k in range(11)],
    *[("math", "completed", k / 10, [1, 2], None) for k in range(11)],
    ("math", "completed", 0.30000000000000004, [3, 1, 2], None),
    ("math", "completed", 0.7, [], None),  # an episode with no sampled turn kept: version "none"
    ("math", "completed", 0.9999999999999999, None, None),
    ("tools", "failed", None, [2], "env"),
    ("tools", "failed", None, None, None),  # a failure without a class counts as "unknown"
    ("tools", "failed", 0.0, [2], "timeout"),  # a failed episode that still has a reward is binned too
    ("tools", "running", None, [2], None),
    ("tools", "waiting", None, None, None),
]


async def test_edges_noise_and_missing_values_count_as_in_python(database_url: str, sql: Sql) -> None:
    _insert(sql, "edges", EDGE_CASES)
    summary = await _summary(database_url, "edges")
    expected = _expected(EDGE_CASES)
    _check(summary, expected)
    assert summary.edges[0] == 0.0 and summary.edges[-1] == 1.0
    # 0.3 (= 3 / 10) and 0.30000000000000004 (= 0.1 * 3) both land in bin 3, 1.0 in the last bin
    assert expected["histograms"][("math", "v1")][0] == [1, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    assert summary.failures == {"env": 1, "unknown": 1, "timeout": 1}


async def test_a_one_value_range_a_negative_range_and_no_rewards(database_url: str, sql: Sql) -> None:
    one_value: list[Episode] = [("math", "completed", 2.0, [4], None)] * 3
    negative: list[Episode] = [("math", "completed", r, [0], None) for r in (-3.0, -2.5, -1.0, -0.1)]
    unrewarded: list[Episode] = [("math", "failed", None, None, "infra"), ("math", "running", None, [1], None)]
    for batch_id, episodes in (("one", one_value), ("negative", negative), ("none", unrewarded)):
        _insert(sql, batch_id, episodes)
        _check(await _summary(database_url, batch_id), _expected(episodes))
    assert (await _summary(database_url, "one")).edges == pytest.approx([1.5 + 0.1 * i for i in range(11)])
    empty = await _summary(database_url, "none")
    assert empty.edges == [0.0, 1.0] and empty.histograms == [] and empty.versions == [1]


async def test_a_random_batch_counts_as_in_python(database_url: str, sql: Sql) -> None:
    rng = random.Random(19)
    episodes: list[Episode] = []
    for _ in range(3000):
        status = rng.choice(["completed"] * 8 + ["failed", "running"])
        reward = None if status == "running" else rng.choice(
            [rng.randint(-7, 7) / 7, rng.uniform(-1, 1), 0.1 * rng.randint(-10, 10)])
        versions = rng.choice([None, [], sorted(rng.sample(range(6), rng.randint(1, 3)))])
        fc = rng.choice([None, "env", "inference"]) if status == "failed" else None
        episodes.append((rng.choice(["math", "tools", "tau2"]), status, reward, versions, fc))
    _insert(sql, "random", episodes)
    _check(await _summary(database_url, "random"), _expected(episodes))
