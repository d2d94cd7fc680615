"""The slime adapter against a real ledger (real scheduler, env worker, fake-engine inference worker and recorder
processes on real NATS and Postgres): the rollout function submits slime's data-source prompts and returns exactly
``rollout_batch_size`` groups of slime ``Sample``s (the pinned stand-in, tests/unit/slime_contract.py), multi-segment
trajectories nested as slime nests them; step after step through one consumer; a restarted step whose groups were
delivered stops with the cause; the post-write hook serves the directory slime writes and the next step's tokens
carry that version."""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.adapters import slime as adapter
from tests.helpers import API_TOKEN, AUTH, Sql
from tests.integration.test_pipeline import start_all
from tests.unit import slime_contract
from tests.unit.slime_contract import Sample
from tests.unit.test_slime_adapter import check_sample
from tests.unit.test_weight_swap import checkpoint


class DataSource:
    """slime's ``RolloutDataSource.get_samples``: n copies of each dataset row per group, indices counted on."""

    def __init__(self, n: int, rows: list[dict[str, Any]]) -> None:
        self.n, self.rows, self.offset, self.group_index, self.index = n, rows, 0, 0, 0

    def get_samples(self, num: int) -> list[list[Sample]]:
        out = []
        for r in self.rows[self.offset:self.offset + num]:
            group = []
            for _ in range(self.n):
                s = Sample(prompt=r["input"], label=r["label"], metadata=copy.deepcopy(r["metadata"]))
                s.group_index, s.index = self.group_index, self.index
                self.index += 1
                group.append(s)
            self.group_index += 1
            out.append(group)
        self.offset += num
        return out


def segments_by_episode(sql: Sql, batch_id: str) -> dict[str, int]:
    return {r["episode_id"]: r["num_segments"] for r in sql.rows(
        "select episode_id, num_segments from trajectories where batch_id = :b", b=batch_id)}


def test_slime_rollouts_and_weights_through_a_real_ledger(stack: Stack, database_url: str, model_dir: str,
                                                           service_logins: dict[str, str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "SETTLE_S", 1.0)  # the restarted step below gives up after this
    url = start_all(stack)
    args = types.SimpleNamespace(
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_temperature=1.0, rollout_max_response_len=8,
        update_weight_mode="full", ledger_url=url, ledger_token=API_TOKEN,
        ledger_database_url=service_logins["exporter"],  # the exporter's read-only login (and its cursors) suffices
        ledger_env="fixed-turns", ledger_consumer="slime-it", ledger_timeout_s=180,
        # a window of one turn re-renders the context before every turn: several segments per episode
        ledger_batch={"max_turns": 4, "context": {"policy": "window", "window_turns": 1}})
    rows = [{"input": f"talk {i}", "label": f"l{i}", "metadata": {"turns": 3 - i % 2}} for i in range(6)]
    source = DataSource(2, rows)
    sql = Sql(database_url)
    try:
        step0 = adapter.generate_rollout(args, 0, source, sample_cls=Sample, environ={})
        assert len(step0) == 2 and [len(g) for g in step0] == [2, 2]
        segments = segments_by_episode(sql, "slime-it-r0")
        assert len(segments) == 4 and max(segments.values()) > 1
        for t, group in enumerate(step0):
            for m, rollout in enumerate(group):
                assert isinstance(rollout, list)  # nested: some trajectory of the step has several samples
                assert len(rollout) == segments[f"slime-it-r0.{t}.{m}"]
                for s in rollout:
                    check_sample(s)
                    assert (s.group_index, s.index, s.rollout_id) == (t, 2 * t + m, 2 * t + m)
                    assert s.label == f"l{t}" and s.metadata["turns"] == 3 - t % 2
                    assert s.status is Sample.Status.COMPLETED and s.weight_versions == ["0"]
        slime_contract.validate_rollout_id_annotated(step0)
        assert len(slime_contract.flatten(step0)) == sum(segments.values())
        raw, advantages = adapter.reward_post_process(args, slime_contract.flatten(step0))
        assert len(raw) == len(advantages) == sum(segments.values())

        # slime writes weight_v000001 and runs the hook: it returns once the inference worker serves version 1
        version_dir = checkpoint(model_dir, tmp_path / "weights" / "weight_v000001")
        adapter.post_write_hook(args, str(version_dir), [], environ={})
        policy = httpx.get(f"{url}/v1/policy", headers=AUTH, timeout=10).json()
        assert policy["current"]["version"] == 1 and policy["current"]["checkpoint"] == str(version_dir)
        assert [w["serving"] for w in policy["workers"]] == [1]
        adapter.post_write_hook(args, str(version_dir), [], environ={})  # a rank that retries: idempotent

        step1 = adapter.generate_rollout(args, 1, source, sample_cls=Sample, environ={})
        flat = slime_contract.flatten(step1)
        assert [len(g) for g in step1] == [2, 2] and {s.group_index for s in flat} == {2, 3}
        assert {tuple(s.weight_versions) for s in flat} == {("1",)}
        assert {s.metadata["batch_id"] for s in flat} == {"slime-it-r1"}

        # a restart that runs step 1 again: the same batch comes back, its groups were delivered, it says so
        again = DataSource(2, rows)
        again.get_samples(2)
        with pytest.raises(adapter.LedgerRolloutError, match="delivered to consumer 'slime-it' already"):
            adapter.generate_rollout(args, 1, again, sample_cls=Sample, environ={})
        assert sql.scalar("select count(*) from batches where id like 'slime-it-%'") == 2
    finally:
        sql.close()
