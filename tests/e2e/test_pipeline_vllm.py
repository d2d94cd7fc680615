"""The whole pipeline with the real model through real vLLM: REST submit -> token-exact trajectories in SQL.

One engine for the session (tests/e2e/conftest.py: ``vllm_worker`` serves it on the session's NATS); the env
worker, recorder and scheduler are real processes.
"""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest

from rollout_ledger.services.supervisor import Stack
from rollout_ledger.shared.chat import load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import Sql, wait_for
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e


def test_real_model_episodes_are_token_exact(stack: Stack, database_url: str, model_dir: str,
                                             vllm_worker: InProcessWorker) -> None:
    stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN))
    stack.start("recorder")
    url = stack.start("scheduler").url
    batches = {}
    for env, tasks, max_turns in (("arithmetic", [{"seed": i} for i in range(3)], 1),
                                  ("guess-number", [{"seed": 7}], 3)):
        resp = httpx.post(f"{url}/v1/batches", timeout=30, json={
            "env": env, "tasks": tasks, "group_size": 2, "max_turns": max_turns,
            "sampling": {"temperature": 1.0, "max_tokens": 24}})
        assert resp.status_code == 201, resp.text
        batches[env] = resp.json()["batch_id"]

    def all_done() -> bool:
        return all(httpx.get(f"{url}/v1/batches/{b}", timeout=10).json()["done"] for b in batches.values())

    wait_for(all_done, 300, "both batches to finish on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    tok = load_chat_tokenizer(model_dir)
    try:
        for env, batch_id in batches.items():
            n = check_token_exact(sql, batch_id)  # sampled ids == the engine's ids; mask and logprobs aligned
            assert n == sql.scalar("select count(*) from episodes where batch_id = :b", b=batch_id)
            groups = sql.rows("select group_id, count(*) n from trajectories where batch_id = :b group by 1",
                              b=batch_id)
            assert all(g["n"] == 2 for g in groups)
            turns = sql.rows("select t.engine, t.weight_version, t.logprobs, t.finish_reason from turns t "
                             "join episodes e on e.id = t.episode_id where e.batch_id = :b", b=batch_id)
            assert turns and {t["engine"] for t in turns} == {"vllm"}
            for t in turns:
                lps = np.array(t["logprobs"])
                assert np.all(np.isfinite(lps)) and np.all(lps <= 0)
            for tr in sql.rows("select t.token_ids, t.action_ranges, t.num_turns, t.status, e.prompt_text "
                               "from trajectories t join episodes e on e.id = t.episode_id where t.batch_id = :b",
                               b=batch_id):
                text = tok.decode(tr["token_ids"])
                assert text.startswith(tr["prompt_text"])
                # the chat structure survives: one assistant header per turn, sampled text after it
                assert text.count("<|im_start|>assistant\n") == tr["num_turns"]
                if env == "guess-number" and tr["num_turns"] > 1:
                    ranges = tr["action_ranges"]
                    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(ranges))
    finally:
        sql.close()
