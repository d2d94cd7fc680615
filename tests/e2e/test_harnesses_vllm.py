"""mini-swe-agent, unmodified, as an agent against the real model through vLLM: its prompt and ``bash`` tool (~1k
tokens) fit SmolLM2's context, so the harness's calls, litellm's requests and the session's recording run end to end
on the real engine (Claude Code's prompt does not fit; it, Codex and mini with a tool round trip are
tests/integration/test_harnesses.py, on a scripted policy).

SmolLM2-135M's commands are not run: the harness is given ``tool_choice: none`` (its own config key), so the policy
sees the tool and answers in text, which mini answers with its format-error message; after three in a row it exits.
mini does not keep a reply it could not parse, so each call rewrites the history: a segment per call.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from examples.harnesses.mini_swe_agent import MINI_SWE_AGENT
from rollout_ledger.cli.stack.supervisor import Stack
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_agents import check_segments
from tests.integration.test_harnesses import harness_env
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e

MINI_TEXT_ONLY = dataclasses.replace(MINI_SWE_AGENT, argv=[*MINI_SWE_AGENT.argv,
                                                            "--config", "model.model_kwargs.tool_choice=none"])
"""mini-swe-agent whose calls ask for no tool call (nothing the policy writes is run)."""


def test_mini_swe_agent_on_the_real_model(stack: Stack, database_url: str, vllm_worker: InProcessWorker) -> None:
    stack.start("env-worker", **harness_env("mini=tests.e2e.test_harnesses_vllm:MINI_TEXT_ONLY",
                                            ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN),
                                            ROLLOUT_AGENT_TIMEOUT_S="240"))
    stack.start("recorder")
    url = stack.start("scheduler").url
    task = {"prompt": "Write the word hello into the file answer.txt.", "path": "answer.txt", "expected": "hello"}
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "mini", "tasks": [task], "max_turns": 6, "sampling": {"temperature": 0.0, "max_tokens": 48}})
    assert resp.status_code == 201, resp.text
    batch = resp.json()["batch_id"]
    wait_for(lambda: httpx.get(f"{url}/v1/batches/{batch}", headers=AUTH, timeout=10).json()["done"], 300,
             "the mini-swe-agent episode on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    try:
        (episode,) = sql.rows("select * from episodes where batch_id = :b", b=batch)
        assert episode["status"] == "completed", episode
        assert check_token_exact(sql, batch) == 1
        tr = check_segments(sql, str(episode["id"]))
        assert tr["num_turns"] == 3 and tr["num_segments"] == 3, tr  # three replies without a tool call
        assert sql.rows("select distinct engine from turns where episode_id = :e", e=episode["id"]) == [
            {"engine": "vllm"}]
        assert "Please solve this issue: Write the word hello" in str(episode["prompt_text"])
        assert '"name": "bash"' in str(episode["prompt_text"])
        assert tr["reward"] == 0.0  # it wrote nothing
    finally:
        sql.close()
