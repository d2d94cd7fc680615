"""Agent functions written with the official ``openai`` SDK, run as episodes against the real model through vLLM:
REST submit -> env worker (session endpoint) -> vLLM -> recorder -> token-exact trajectories in SQL.

One engine for the session (tests/e2e/conftest.py: ``vllm_worker``); the env worker, recorder and scheduler are
real processes. The agents are tests/agents.py; the scripted-policy version (exact tool calls) is
tests/integration/test_agents.py.
"""

from __future__ import annotations

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.records import samples
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_agents import agent_env, check_segments
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e

SAMPLING = {"temperature": 1.0, "max_tokens": 32, "seed": 1234}


def test_openai_sdk_agents_on_the_real_model(stack: Stack, database_url: str, model_dir: str,
                                             vllm_worker: InProcessWorker) -> None:
    stack.start("env-worker", **agent_env(ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN),
                                          ROLLOUT_ENVS="guess-number", ROLLOUT_AGENT_TIMEOUT_S="240"))
    stack.start("recorder")
    url = stack.start("scheduler").url
    batches: dict[str, str] = {}
    for env, tasks, extra in (
        ("plain", [{"question": "What is 12 + 7?", "seed": 3}, {"question": "Name a prime number.", "seed": 4}], {}),
        ("streaming", [{"question": "Say hello in French."}], {}),
        ("tools", [{"a": 2, "b": 3}, {"a": 40, "b": 2, "few_shot": True}], {}),
        ("rewrite", [{"question": "What is the capital of France?"}], {}),
        ("raises", [{"question": "Hi"}], {}),
        ("guess-number", [{"seed": 7}], {"context": {"policy": "window", "window_turns": 1}}),
    ):
        resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
            "env": env, "tasks": tasks, "group_size": 1, "max_turns": 3, "sampling": SAMPLING, **extra})
        assert resp.status_code == 201, resp.text
        batches[env] = resp.json()["batch_id"]

    def all_done() -> bool:
        return all(httpx.get(f"{url}/v1/batches/{b}", headers=AUTH, timeout=10).json()["done"]
                   for b in batches.values())

    wait_for(all_done, 600, "every agent batch to finish on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    tok = load_chat_tokenizer(model_dir)
    try:
        def episodes(env: str) -> list[dict[str, object]]:
            return sql.rows("select * from episodes where batch_id = :b order by id", b=batches[env])

        for env in ("plain", "streaming", "tools", "rewrite"):
            eps = episodes(env)
            assert all(e["status"] == "completed" for e in eps), eps
            # sampled ids == the engine's turn ids, mask/logprobs aligned, prompt and observations in place
            assert check_token_exact(sql, batches[env]) == len(eps)
            for e in eps:
                tr = check_segments(sql, str(e["id"]))  # each turn's context is its segment; decode == render
                assert tr["num_segments"] == (2 if env == "rewrite" else 1)
                engines = sql.rows("select distinct engine from turns where episode_id = :e", e=e["id"])
                assert engines == [{"engine": "vllm"}]
        assert sql.scalar("select count(*) from turns t join episodes e on e.id = t.episode_id "
                          "where e.batch_id = :b and not t.superseded", b=batches["plain"]) == 4  # 2 calls each
        # the tools request ran against the model: the schema was rendered into the prompt it saw
        for e in episodes("tools"):
            assert '"name": "add"' in str(e["prompt_text"]) and "<tools>" in str(e["prompt_text"])
        # a history with an assistant tool call and a tool result, rendered by the tool-aware template
        few_shot = str(episodes("tools")[1]["prompt_text"])
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
                '<|im_end|>\n<|im_start|>tool\n<tool_response>\n2\n</tool_response>') in few_shot
        rewritten = sql.rows("select drifts, segments from trajectories where batch_id = :b", b=batches["rewrite"])[0]
        assert rewritten["drifts"] == [{"turn": 0, "class": "history_rewrite"}]
        seg2 = rewritten["segments"][1]
        ids = sql.scalar("select token_ids from trajectories where batch_id = :b", b=batches["rewrite"])
        assert tok.decode(ids[seg2[0]:]).startswith("<|im_start|>system\nEarlier you said:")

        (raised,) = episodes("raises")
        assert raised["status"] == "failed" and raised["failure_class"] == "agent"
        assert "Traceback" in str(raised["failure_reason"]) and "_parse_score" in str(raised["failure_reason"])

        # sliding window: every turn is its own segment (its own training sample), each checked decode == render
        (windowed,) = episodes("guess-number")
        tr = check_segments(sql, str(windowed["id"]))
        assert tr["num_turns"] >= 1 and tr["num_segments"] == tr["num_turns"]
        assert tr["drifts"] == [{"turn": t, "class": "window"} for t in range(tr["num_turns"] - 1)]
        found = samples(tr)  # what the exporter writes: one training sample per turn, its window as the prompt
        assert [(s.start, s.end) for s in found] == [tuple(seg) for seg in tr["segments"]]
        assert check_token_exact(sql, batches["guess-number"]) == 1
        print("\nagent episodes:", sql.rows(  # a summary for -s runs
            "select e.env, e.status, e.reward, t.num_turns, t.num_segments, t.num_sampled_tokens, t.num_tokens "
            "from episodes e left join trajectories t on t.episode_id = e.id order by e.env, e.id"))
        print("tool calls made by the model:", sql.rows(
            "select s.info->'agent_info' as info from steps s join episodes e on e.id = s.episode_id "
            "where e.batch_id = :b and s.info ? 'agent_info'", b=batches["tools"]))
    finally:
        sql.close()
