"""The exporter does not read ``loss_mask`` and ``weight_versions``: it rebuilds them from ``action_ranges`` and one
weight version per range (``rows.rebuild_sampled``), and reads the logprobs of the sampled tokens only
(``sampled_logprobs_le``), laid back on the ranges. On trajectories the real recorder assembled (real NATS and
Postgres) the rebuilt arrays equal the stored ones: several turns and versions, an empty sampled turn, a retried
turn, several segments, and a failed episode's partial trajectory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psycopg
import pyarrow.parquet as pq
from pydantic import BaseModel

from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import connect, connect_arrow, fetch
from rollout_ledger.services.exporter.export import export
from rollout_ledger.shared.events import StepCompleted, TurnGenerated
from rollout_ledger.shared.kit import bus
from tests.helpers import Sql, until
from tests.integration.test_recorder import (
    PROMPT,
    drained,
    env_failed,
    episode_events,
    publish,
    recorder,
    seed_episodes,
    settings_for,
)


def _versions(events: list[BaseModel], versions: list[int]) -> list[BaseModel]:
    """Each turn ``t`` of ``events`` sampled by weight version ``versions[t]``."""
    return [ev.model_copy(update={"weight_version": versions[ev.turn_index]}) if isinstance(ev, TurnGenerated)
            else ev for ev in events]


def _new_segments(events: list[BaseModel], after: set[int]) -> list[BaseModel]:
    """The steps of turns ``after`` start a new segment (their observation ids are the re-rendered context)."""
    return [ev.model_copy(update={"new_segment": True}) if isinstance(ev, StepCompleted) and ev.turn_index in after
            else ev for ev in events]


async def test_rebuilt_mask_and_versions_equal_the_stored_arrays(nc: bus.NATS, nats_url: str, database_url: str,
                                                                 sql: Sql, tmp_path: Path) -> None:
    multi, empty_turn, retried, segmented, failed, failed_early = seed_episodes(sql, "rb", num_tasks=6)
    await publish(nc, _versions(episode_events(
        multi, [([20, 21], [2, 30, 31, 1]), ([22], [2, 32]), ([23, 24], [])]), [4, 5, 5]))
    await publish(nc, episode_events(empty_turn, [([40, 41], [2]), ([], [2, 42]), ([43], [])], version=7))
    await publish(nc, episode_events(retried, [([50], [2, 51]), ([52, 53, 54], [])], tries={1: 3}))
    # segment 2 starts with the whole re-rendered context of turn 1 (mask 0), segment 3 likewise at turn 2
    await publish(nc, _versions(_new_segments(episode_events(
        segmented, [([60, 61], [*PROMPT, 60, 61, 2]), ([62], [*PROMPT, 62, 2, 9]), ([63, 64], [])]), {0, 1}),
        [1, 2, 2]))
    events = episode_events(failed, [([70, 71], [2, 72]), ([73], [2])], terminal=False)
    events.append(env_failed(failed, "rb", 5, "env raised", num_turns=2))
    events.append(env_failed(failed_early, "rb", 1, "reset raised"))
    await publish(nc, events)
    async with recorder(settings_for(nats_url, database_url)):
        await until(lambda: sql.scalar("select count(*) from trajectories") == 5, 20, "five trajectories")
        await until(lambda: drained(nc), 10, "consumer drained")

    stored = {r["episode_id"]: r for r in sql.rows(
        "SELECT episode_id, status, token_ids, loss_mask, logprobs, weight_versions, action_ranges, segments "
        "FROM trajectories")}
    assert stored[segmented]["segments"] == [[0, 10], [10, 22], [22, 35]]
    assert stored[failed]["status"] == "failed" and stored[empty_turn]["action_ranges"] == [[8, 10], [13, 14]]
    assert set(stored[multi]["weight_versions"]) == {-1, 4, 5}

    with connect(database_url) as conn, connect_arrow(database_url) as arrow:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            rows = fetch(conn, arrow, Selection())
    assert sorted(r["episode_id"] for r in rows) == sorted(stored)
    for row in rows:
        s = stored[row["episode_id"]]
        assert row["token_ids"].tolist() == s["token_ids"]
        assert row["loss_mask"].tolist() == s["loss_mask"], row["episode_id"]
        assert row["weight_versions"].tolist() == s["weight_versions"], row["episode_id"]
        assert np.array_equal(row["logprobs"], np.array(s["logprobs"], np.float32))
        assert row["action_ranges"] == s["action_ranges"] and row["segments"] == s["segments"]

    # and through the whole export path (chunks smaller than the selection, so rows of several chunks meet)
    out = export(database_url, Selection(), tmp_path / "full.parquet", "parquet", chunk=2)
    assert out.records == 5
    for rec in pq.read_table(out.path).to_pylist():
        s = stored[rec["episode_id"]]
        assert (rec["loss_mask"], rec["weight_versions"]) == (s["loss_mask"], s["weight_versions"])
        assert np.array(rec["logprobs"], np.float32).tobytes() == np.array(s["logprobs"], np.float32).tobytes()
