"""The TRL adapter's start against a real ledger (real scheduler, env worker, fake-engine inference worker and
recorder processes on real NATS and Postgres): on a ledger that serves version 0 (the model the workers started
with) the first ``rollout_func`` call samples on it and publishes nothing; on a ledger that serves another run's
published version, it first publishes the weights TRL starts from as the next version, waits until every worker
serves it, and only then submits, so every token of the run is sampled by TRL's own weights; the callback's versions
count on from there. TRL's model and tokenizer are fakes that write what the fake engine checks (the real TRL on
vLLM: tests/e2e/trainers/test_trl_vllm.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import httpx

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.adapters.trl import LedgerRollout
from rollout_ledger.client.rest import LedgerClient
from tests.helpers import API_TOKEN, AUTH, Sql
from tests.integration.test_pipeline import start_all
from tests.unit.test_weight_swap import checkpoint


class FakeModel:
    """Stands for TRL's model: ``save_pretrained`` writes a checkpoint the fake engine accepts."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.saved: list[Path] = []

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        made = checkpoint(self.model_dir, Path(path) / "made")
        for f in made.iterdir():
            f.rename(Path(path) / f.name)
        made.rmdir()
        self.saved.append(Path(path))


class FakeTokenizer:
    eos_token_id = 2

    def save_pretrained(self, path: str) -> None:
        return None


def trainer(model_dir: str) -> Any:
    """What ``rollout_func`` reads of TRL's ``GRPOTrainer`` (no accelerator: the model is its own)."""
    return types.SimpleNamespace(num_generations=2, processing_class=FakeTokenizer(), model=FakeModel(model_dir))


def prompts(tasks: list[dict[str, Any]], group_size: int = 2) -> list[str]:
    return [json.dumps(t) for t in tasks for _ in range(group_size)]


def current(url: str) -> dict[str, Any]:
    policy: dict[str, Any] = httpx.get(f"{url}/v1/policy", headers=AUTH, timeout=10).json()
    return policy


def test_the_first_rollout_syncs_the_starting_weights_only_on_another_runs_version(
        stack: Stack, database_url: str, model_dir: str, service_logins: dict[str, str], tmp_path: Path) -> None:
    url = start_all(stack)
    db = service_logins["exporter"]
    sql = Sql(database_url)
    tasks = [{"a": 1, "b": 2, "op": "+"}, {"a": 3, "b": 4, "op": "+"}]
    first = LedgerRollout(url, db, "arithmetic", checkpoint_dir=tmp_path / "first", token=API_TOKEN,
                          sampling={"max_tokens": 8}, timeout_s=120, run_id="first")
    second: LedgerRollout | None = None
    try:
        # version 0 serves: the model the trainer loaded. Nothing is published before the first batch
        assert (first.base_version, first.sync_start) == (0, False)
        fresh = trainer(model_dir)
        rows = first.rollout_func(prompts(tasks), fresh)
        assert len(rows["prompt_ids"]) == 4 and first.synced is None and fresh.model.saved == []
        assert current(url)["current"] is None
        assert sql.scalar("select array_agg(distinct weight_version) from turns t join episodes e "
                          "on e.id = t.episode_id where e.batch_id = 'trl-first-1'") == [0]

        # another run trains on the ledger: its version 1 serves
        with LedgerClient(url, API_TOKEN) as other:
            other.publish_version(1, checkpoint(model_dir, tmp_path / "other" / "v1"), timeout_s=60)

        # a new run on it: before its first batch, its own starting weights are published as version 2 and served
        second = LedgerRollout(url, db, "arithmetic", checkpoint_dir=tmp_path / "second", token=API_TOKEN,
                               sampling={"max_tokens": 8}, timeout_s=120, run_id="second")
        assert (second.base_version, second.sync_start) == (1, True)
        mine = trainer(model_dir)
        rows = second.rollout_func(prompts(tasks), mine)
        assert len(rows["prompt_ids"]) == 4
        assert (second.synced, second.base_version, second.version) == (2, 2, 2)
        assert mine.model.saved == [tmp_path / "second" / ".v2.partial"]  # saved, then renamed to v2
        policy = current(url)
        assert policy["current"]["version"] == 2
        assert policy["current"]["checkpoint"] == str(tmp_path / "second" / "v2")
        assert json.loads(policy["current"]["notes"]) == {"trainer": "trl", "run": "second", "step": 0,
                                                          "sync": "start"}
        assert [w["serving"] for w in policy["workers"]] == [2]
        # every token of the run's first batch was sampled by the synced weights, none by the other run's
        assert sql.scalar("select array_agg(distinct weight_version) from turns t join episodes e "
                          "on e.id = t.episode_id where e.batch_id = 'trl-second-1'") == [2]
        # the callback's versions count on from the synced one: step 1 publishes version 3
        second.publish(mine.model, mine.processing_class, 1)
        assert current(url)["current"]["version"] == 3 and second.version == 3
        # a later call syncs nothing again
        rows = second.rollout_func(prompts(tasks), mine)
        assert len(mine.model.saved) == 2 and current(url)["current"]["version"] == 3
        assert sql.scalar("select array_agg(distinct weight_version) from turns t join episodes e "
                          "on e.id = t.episode_id where e.batch_id = 'trl-second-2'") == [3]
    finally:
        first.close()
        if second is not None:
            second.close()
        sql.close()
