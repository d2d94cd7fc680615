"""An agent written with the official ``anthropic`` SDK (tests/harness_agents.py) as an episode through a real
env-worker process (the session endpoint's Messages route), a real recorder, NATS and Postgres, with a scripted
policy answering its turns: a multi-turn tool loop (plain and streamed calls, ``count_tokens``) recorded
token-exact in one segment.

The dialect itself, in process: tests/unit/test_messages_dialect.py; the ``llm-comply`` Anthropic checks:
tests/integration/test_llm_comply.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_agents import REPO, check_segments
from tests.integration.test_env_worker import terminal_of, work_item
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_tool_env import ScriptedPolicy

SCRIPT = [f"Let me add. {format_call('add', {'a': 2, 'b': 3})}",
          f"Checking the other way. {format_call('add', {'a': 3, 'b': 2})}",
          "The sum is 5 🎲."]
"""The policy's turns: a call (answered by a plain call), a second call and the answer (both streamed)."""


@pytest.fixture
async def policy(nc: bus.NATS, model_dir: str) -> AsyncIterator[ScriptedPolicy]:
    p = ScriptedPolicy(nc, ChatTokenizer(model_dir))
    await p.start()
    yield p
    await p.stop()


async def test_an_anthropic_sdk_agent_is_recorded_token_exact(stack: Stack, nc: bus.NATS, policy: ScriptedPolicy,
                                                               database_url: str) -> None:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    await asyncio.to_thread(stack.start, "env-worker", "env-worker", PYTHONPATH=path, ROLLOUT_ENVS="fixed-turns",
                            ROLLOUT_AGENTS="claude=tests.harness_agents:anthropic_tools",
                            ROLLOUT_AGENT_TIMEOUT_S="60")
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    task = {"a": 2, "b": 3, "temperature": 0.5}
    item = work_item("claude", task, max_turns=6)
    policy.scripts[item.episode_id] = SCRIPT
    resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "claude", "tasks": [task], "max_turns": 6, "batch_id": item.batch_id,
        "sampling": {"max_tokens": 32}})
    assert resp.status_code == 201, resp.text

    end = await terminal_of(nc.jetstream(), item.episode_id, timeout_s=90)
    assert end.type == "episode.finished" and end.status == "completed", end
    assert end.num_turns == 3 and end.reward == 1.0 and end.info["answer"] == "The sum is 5 🎲."
    assert end.info["agent_info"] == {"tool_calls": 2, "streamed": 2, "counted": True}
    assert end.info["token_check"] == "ok" and "drifts" not in end.info  # one segment: no rewrite
    requests = [r for r in policy.requests if r.episode_id == item.episode_id]
    # count_tokens sampled nothing; each call's max_tokens and (extra-body) temperature reached the policy
    assert [(r.turn_index, r.max_tokens, r.sampling.temperature) for r in requests] == [
        (0, 48, 0.5), (1, 48, 0.5), (2, 48, 0.5)]

    sql = Sql(database_url)
    try:
        def recorded() -> bool:
            return bool(sql.scalar("select count(*) from episodes where id = :e and status = 'completed'",
                                   e=item.episode_id) == 1)

        await asyncio.to_thread(wait_for, recorded, 30, "the agent episode recorded")
        assert check_token_exact(sql, item.batch_id) == 1
        tr = check_segments(sql, item.episode_id)  # decode == render, each turn generated from its segment
        assert tr["num_segments"] == 1 and tr["num_turns"] == 3
        row = sql.rows("select token_ids, action_ranges from trajectories where episode_id = :e",
                       e=item.episode_id)[0]
        tok = policy.tok
        # the sampled ids are the scripted turns, verbatim; the tool results came back as tool turns
        assert [tok.decode(row["token_ids"][a:b]) for a, b in row["action_ranges"]] == [
            f"{text}<|im_end|>" for text in SCRIPT]
        text = tok.decode(row["token_ids"])
        assert text.count("<tool_response>\n5\n</tool_response>") == 2 and '"name": "add"' in text
        observations = sql.rows("select observation from steps where episode_id = :e and not superseded "
                                "order by turn_index", e=item.episode_id)
        assert [o["observation"] for o in observations] == ["5", "5", ""]  # the tool results' text; the end
    finally:
        sql.close()
