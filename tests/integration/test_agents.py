"""Agent functions as episodes through a real env-worker process (session endpoint; the ``openai`` SDK,
LangChain and the OpenAI Agents SDK) and a real recorder, on real NATS + Postgres, with a scripted policy
answering the turns (so the tool calls are exact).

The same agents against the real model through vLLM: tests/e2e/test_agents_vllm.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.records import samples
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.subjects import ENVS_BUCKET
from tests.agents import AGENTS_SETTING
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_env_worker import terminal_of, work_item
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_tool_env import ScriptedPolicy

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture
async def policy(nc: bus.NATS, model_dir: str) -> AsyncIterator[ScriptedPolicy]:
    p = ScriptedPolicy(nc, ChatTokenizer(model_dir))
    await p.start()
    yield p
    await p.stop()


def agent_env(**extra: str) -> dict[str, str]:
    """Settings of an env worker running the test agents (importable from the repository root)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    agents = f"{AGENTS_SETTING},calculator=examples.agent.calculator:run"  # the README's example too
    return {"ROLLOUT_AGENTS": agents, "PYTHONPATH": path, "ROLLOUT_ENVS": "fixed-turns", **extra}


def check_segments(sql: Sql, episode_id: str) -> dict[str, Any]:
    """The trajectory's segments cover its ids, each kept turn was generated from exactly its segment so far, and
    decode == render held for every segment (the env worker's token check)."""
    tr = sql.rows("select * from trajectories where episode_id = :e", e=episode_id)[0]
    segs = tr["segments"]
    assert segs[0][0] == 0 and segs[-1][1] == tr["num_tokens"] and len(segs) == tr["num_segments"]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))
    turns = sql.rows("select t.prompt_len from steps s join turns t on t.event_id = s.turn_event_id "
                     "where s.episode_id = :e and not s.superseded order by s.turn_index", e=episode_id)
    for (start, _), turn in zip(tr["action_ranges"], turns, strict=True):
        seg_start = max(a for a, _ in segs if a <= start)
        assert turn["prompt_len"] == start - seg_start
    assert tr["token_check"] == "ok", tr
    return tr


async def test_agent_episodes_are_recorded_token_exact(stack: Stack, nc: bus.NATS, policy: ScriptedPolicy,
                                                       database_url: str) -> None:
    await asyncio.to_thread(stack.start, "env-worker", "env-worker", **agent_env(ROLLOUT_AGENT_TIMEOUT_S="8"))
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    js = nc.jetstream()
    kv = await js.key_value(ENVS_BUCKET)
    advert = (await kv.get("tools")).value
    assert advert is not None and b'"kind":"agent"' in advert and b"tests.agents:tools" in advert

    scripts: dict[str, tuple[dict[str, Any], list[str]]] = {
        "plain": ({"question": "What is 2 + 2?", "seed": 1}, ["It is 4.", "Again: 4."]),
        "streaming": ({"question": "Hello?"}, ["Hi! Ünïcödé 🎲 works.", "Nothing else."]),
        "tools": ({"a": 2, "b": 3, "few_shot": True},
                  [f"Let me add. {format_call('add', {'a': 2, 'b': 3})}", "The sum is 5."]),
        "rewrite": ({"question": "Capital of France?"}, ["Paris is the capital of France.", "Paris."]),
        "raises": ({"question": "x"}, ["ok"]),
        "silent": ({"question": "x"}, []),
        "sleepy": ({"question": "x"}, ["zzz"]),
        "calculator": ({"question": "What is 17 * 3?", "answer": 51},
                       [format_call("calculate", {"expression": "17 * 3"}), "17 * 3 = 51.0"]),
        # LangChain: plain ainvoke, then bind_tools (the tools change the prompt: a new segment), tool, answer
        "langchain": ({"a": 4, "b": 5}, ["Maybe 9.", f"Let me check. {format_call('add', {'a': 4, 'b': 5})}",
                                         "The sum is 9."]),
        # the OpenAI Agents SDK (OpenAIChatCompletionsModel + Runner.run): tool call, tool output, final answer
        "openai_agents": ({"a": 6, "b": 7}, [format_call("add_numbers", {"a": 6, "b": 7}), "The sum is 13."]),
        # the same with the SDK's default model: the Responses API (/v1/responses), function_call items
        "openai_agents_responses": ({"a": 8, "b": 9},
                                    [format_call("add_numbers", {"a": 8, "b": 9}), "The sum is 17."]),
    }
    items = {}
    held = work_item("plain", {"question": "held"}, max_turns=4)  # its first generation never returns in time
    policy.hold = lambda req: req.episode_id == held.episode_id
    for name, (task, script) in [*scripts.items(), ("held", ({"question": "held"}, ["late"]))]:
        item = held if name == "held" else work_item(name, task, max_turns=4)
        policy.scripts[item.episode_id] = script
        items[name] = item
        resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
            "env": item.env, "tasks": [task], "max_turns": 4, "batch_id": item.batch_id,
            "sampling": {"max_tokens": 32}})
        assert resp.status_code == 201, resp.text
    ends = {name: await terminal_of(js, item.episode_id, timeout_s=60) for name, item in items.items()}

    turns = {"langchain": 3}
    for name in ("plain", "streaming", "tools", "rewrite", "calculator", "langchain", "openai_agents",
                 "openai_agents_responses"):
        assert ends[name].type == "episode.finished", (name, ends[name])
        assert ends[name].status == "completed" and ends[name].num_turns == turns.get(name, 2), (name, ends[name])
        assert ends[name].info["token_check"] == "ok", (name, ends[name].info)
    assert ends["plain"].reward == 1.0 and ends["plain"].info["answer"] == "Again: 4."
    assert ends["streaming"].reward == 1.0 and ends["calculator"].reward == 1.0
    assert ends["tools"].reward == 1.0 and ends["tools"].info["agent_info"] == {"tool_calls": 1}
    assert ends["rewrite"].info["drifts"] == [{"turn": 0, "class": "history_rewrite"}]
    lc, oa = ends["langchain"], ends["openai_agents"]
    assert lc.reward == 1.0 and lc.info["answer"] == "The sum is 9." and lc.info["model_calls"] == 3
    assert lc.info["agent_info"] == {"tool_calls": 1, "first": "Maybe 9.", "usage": lc.info["agent_info"]["usage"]}
    assert lc.info["agent_info"]["usage"] > 0  # LangChain read our usage
    # only the tools appearing is a rewrite; the tool round trip through LangChain's messages extends the context
    assert lc.info["drifts"] == [{"turn": 0, "class": "history_rewrite"}]
    assert oa.reward == 1.0 and oa.info["answer"] == "The sum is 13." and "drifts" not in oa.info
    assert oa.info["agent_info"] == {"tool_calls": 1, "requests": 2}
    oar = ends["openai_agents_responses"]
    assert oar.reward == 1.0 and oar.info["answer"] == "The sum is 17." and "drifts" not in oar.info
    assert oar.info["agent_info"] == {"tool_calls": 1, "requests": 2, "model": "OpenAIResponsesModel"}
    # the batch's sampling unless the call sets its own: plain asked for top_logprobs=2 and seed 1
    first = next(r for r in policy.requests if r.episode_id == items["plain"].episode_id)
    assert first.sampling.logprobs == 2 and first.sampling.seed == 1 and first.max_tokens == 24
    sdk_requests = {name: [r for r in policy.requests if r.episode_id == items[name].episode_id]
                    for name in ("langchain", "openai_agents", "openai_agents_responses")}
    assert [r.max_tokens for r in sdk_requests["langchain"]] == [48] * 3  # max_completion_tokens
    assert [(r.max_tokens, r.sampling.logprobs) for r in sdk_requests["openai_agents"]] == [(48, 1)] * 2
    assert [(r.max_tokens, r.sampling.logprobs) for r in sdk_requests["openai_agents_responses"]] == [(48, 1)] * 2

    raised, silent, sleepy = ends["raises"], ends["silent"], ends["sleepy"]
    assert (raised.type, raised.failure_class) == ("episode.failed", "agent")
    assert "ValueError" in raised.reason and "_parse_score" in raised.reason and "Traceback" in raised.reason
    assert (silent.failure_class, silent.num_turns) == ("agent", 0) and "no model calls" in silent.reason
    assert sleepy.failure_class == "timeout" and "8s deadline" in sleepy.reason
    # the deadline cancelled the agent in the middle of a generation: no turn kept, the worker went on
    assert ends["held"].failure_class == "timeout" and "after 0 model calls" in ends["held"].reason
    assert ends["held"].num_turns == 0
    policy.release.set()

    sql = Sql(database_url)
    try:
        def recorded() -> bool:
            n = sql.scalar("select count(*) from episodes where id = any(:ids) and status in "
                           "('completed', 'failed')", ids=[i.episode_id for i in items.values()])
            return bool(n == len(items))

        wait_for(recorded, 30, "every agent episode recorded")
        for name in ("plain", "streaming", "tools", "rewrite", "calculator", "langchain", "openai_agents",
                 "openai_agents_responses"):
            assert check_token_exact(sql, items[name].batch_id) == 1
            tr = check_segments(sql, items[name].episode_id)
            assert tr["num_segments"] == (2 if name in ("rewrite", "langchain") else 1)
            assert len(samples(tr)) == tr["num_segments"]  # the exporter's training samples: one per segment
        for name, result in (("langchain", 9), ("openai_agents", 13)):
            sdk_tr = sql.rows("select token_ids, action_ranges from trajectories where episode_id = :e",
                              e=items[name].episode_id)[0]
            sdk_text = policy.tok.decode(sdk_tr["token_ids"])
            assert f"<tool_response>\n{result}\n</tool_response>" in sdk_text and "<tools>" in sdk_text, name
            # the sampled ids are the scripted turns, verbatim
            sampled = [policy.tok.decode(sdk_tr["token_ids"][a:b]) for a, b in sdk_tr["action_ranges"]]
            assert sampled == [f"{text}<|im_end|>" for text in scripts[name][1]], (name, sampled)
        tools_tr = sql.rows("select token_ids from trajectories where episode_id = :e",
                            e=items["tools"].episode_id)[0]
        tok = policy.tok
        text = tok.decode(tools_tr["token_ids"])
        # the tool schema is in the prompt, the call verbatim, the result rendered as a tool turn
        assert '"name": "add"' in text and "<tool_call>" in text and "<tool_response>\n5\n</tool_response>" in text
        assert "<tool_response>\n2\n</tool_response>" in text  # the few-shot history's tool turn
        last = sql.rows("select info, reward from steps where episode_id = :e order by turn_index desc limit 1",
                        e=items["plain"].episode_id)[0]
        assert last["info"]["answer"] == "Again: 4." and last["reward"] == 1.0
        failed = sql.rows("select failure_class, failure_reason from episodes where id = :e",
                          e=items["raises"].episode_id)[0]
        assert failed["failure_class"] == "agent" and "_parse_score" in failed["failure_reason"]
    finally:
        sql.close()
