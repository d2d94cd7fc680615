"""A remote environment actor driven by the real model through vLLM: the reference environment server as its
own process, episodes over HTTP, trajectories token-exact in SQL.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_remote_env import EnvServerProcess

pytestmark = pytest.mark.e2e


def test_real_model_on_a_remote_env_is_token_exact(stack: Stack, database_url: str, model_dir: str,
                                                   tmp_path: Path, vllm_worker: InProcessWorker) -> None:
    server = EnvServerProcess(tmp_path / "envserver-logs", tmp_path / "envserver-state").start()
    try:
        stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN),
                    ROLLOUT_REMOTE_ENVS=f"guess-number={server.url},arithmetic={server.url}",
                    ROLLOUT_REMOTE_STARTUP_JITTER_S="0")
        stack.start("recorder")
        url = stack.start("scheduler").url
        batches = {}
        for env, tasks, max_turns in (("remote:arithmetic", [{"seed": i} for i in range(2)], 1),
                                      ("remote:guess-number", [{"seed": 7}], 3)):
            resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
                "env": env, "tasks": tasks, "group_size": 2, "max_turns": max_turns,
                "sampling": {"temperature": 1.0, "max_tokens": 24}})
            assert resp.status_code == 201, resp.text
            batches[env] = resp.json()["batch_id"]

        def all_done() -> bool:
            return all(httpx.get(f"{url}/v1/batches/{b}", headers=AUTH, timeout=10).json()["done"]
                       for b in batches.values())

        wait_for(all_done, 300, "the remote-env batches to finish on the real engine", interval_s=0.5)
        sql = Sql(database_url)
        tok = load_chat_tokenizer(model_dir)
        try:
            for env, batch_id in batches.items():
                n = check_token_exact(sql, batch_id)  # the engine's ids verbatim; mask and logprobs aligned
                assert n == sql.scalar("select count(*) from episodes where batch_id = :b", b=batch_id), env
                assert sql.scalar("select count(*) from episodes where batch_id = :b and status = 'failed'",
                                  b=batch_id) == 0
                assert {r["engine"] for r in sql.rows(
                    "select distinct t.engine from turns t join episodes e on e.id = t.episode_id "
                    "where e.batch_id = :b", b=batch_id)} == {"vllm"}
                for tr in sql.rows("select t.token_ids, t.num_turns, t.token_check, e.prompt_text "
                                   "from trajectories t join episodes e on e.id = t.episode_id "
                                   "where t.batch_id = :b", b=batch_id):
                    text = tok.decode(tr["token_ids"])
                    assert text.startswith(tr["prompt_text"])
                    assert text.count("<|im_start|>assistant\n") == tr["num_turns"]
                    assert tr["token_check"] == "ok"
            # the arithmetic question came from the server: the same text the built-in env asks
            prompt = sql.scalar("select prompt_text from episodes where batch_id = :b and task->>'seed' = '0' "
                                "limit 1", b=batches["remote:arithmetic"])
            assert "Answer with a single integer." in prompt
        finally:
            sql.close()
        stats = server.stats()
        assert stats["reset"] == 6 and stats["close"] == 6 and stats.get("step.5xx", 0) == 0
    finally:
        server.stop()
