"""``retail-orders`` through a real env-worker process, with a scripted tool-calling policy answering the turns.

A 135M model seldom emits a tool call, so the policy here is an in-test inference responder that answers each
``InferenceRequested`` with the next turn of a script (Hermes tool calls, tokenised with the real tokenizer).
Checks the events (ids, seq, reward, status), the tool-aware prompt, token exactness, and malformed calls:
an error observation by default, status ``aborted`` with ``abort_on_error``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.env_worker.tokenization import TOOLS_TEMPLATE
from rollout_ledger.services.envs.retail import build_task, solution
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.events import InferenceRequested
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.subjects import ENVS_BUCKET
from tests.helpers import publish_event
from tests.integration.policy import Policy
from tests.integration.test_env_worker import (
    check_contract,
    episode_events,
    terminal_of,
    work_item,
    work_queue_empty,
)


class ScriptedPolicy(Policy):
    """Answers turn t of an episode with ``scripts[episode_id][t]`` (+ end-of-turn), as an inference worker would."""

    def __init__(self, nc: bus.NATS, tok: ChatTokenizer, worker_id: str = "scripted") -> None:
        super().__init__(nc, tok, worker_id)
        self.scripts: dict[str, Sequence[str]] = {}

    def text_for(self, req: InferenceRequested) -> str:
        return self.scripts[req.episode_id][req.turn_index]


@pytest.fixture
def tools_tok(model_dir: str) -> ChatTokenizer:
    return ChatTokenizer(model_dir, chat_template=TOOLS_TEMPLATE.read_text())


@pytest.fixture
async def policy(nc: bus.NATS, tools_tok: ChatTokenizer) -> AsyncIterator[ScriptedPolicy]:
    p = await ScriptedPolicy(nc, tools_tok).start()
    yield p
    await p.stop()


async def start_worker(stack: Stack) -> None:
    await asyncio.to_thread(stack.start, "env-worker", "env-worker", ROLLOUT_ENVS="retail-orders")


async def test_retail_episodes_with_a_scripted_tool_policy(stack: Stack, nc: bus.NATS, policy: ScriptedPolicy,
                                                           tools_tok: ChatTokenizer) -> None:
    await start_worker(stack)
    js = nc.jetstream()
    advert = (await (await js.key_value(ENVS_BUCKET)).get("retail-orders")).value
    assert advert is not None and b'"multi_turn":true' in advert

    task = build_task(21, 2)
    solved = work_item("retail-orders", {"seed": 21, "num_requests": 2}, max_turns=12)
    policy.scripts[solved.episode_id] = ["Hello! Let me help you.", *solution(task)]
    bad_then_fixed = work_item("retail-orders", {"seed": 21, "num_requests": 2}, batch_id=solved.batch_id,
                               max_turns=12, index=1)
    policy.scripts[bad_then_fixed.episode_id] = ['<tool_call>{"name": "refund_everything"}</tool_call>',
                                                 "<tool_call>{oops</tool_call>", *solution(task)]
    for item in (solved, bad_then_fixed):
        await publish_event(js, item)

    done = await terminal_of(js, solved.episode_id)
    assert (done.type, done.status, done.reward, done.stop_reason) == ("episode.finished", "completed", 1.0,
                                                                       "terminated")
    assert done.num_turns == 1 + len(solution(task)) and done.info["token_check"] == "ok"
    events = await episode_events(js, solved.episode_id)
    check_contract(events, solved.episode_id, 1, done.num_turns)
    started = events[0]
    assert started.type == "episode.started" and "<tools>\n" in started.prompt_text
    assert '"name": "cancel_order"' in started.prompt_text or '"name": "return_items"' in started.prompt_text
    assert tools_tok.decode(started.prompt_token_ids) == started.prompt_text
    assert [m["role"] for m in started.messages] == ["system", "user"]
    steps = [e for e in events if e.type == "step.completed"]
    assert steps[0].observation.startswith("That's not done yet.")  # the scripted user answers plain text
    assert tools_tok.decode(steps[0].observation_token_ids).startswith("\n<|im_start|>user\nThat's not done yet.")
    assert tools_tok.decode(steps[1].observation_token_ids).startswith("\n<|im_start|>tool\n<tool_response>\n{")
    assert steps[1].info["tool"] == "find_user_by_email" and steps[-1].info["end"] == "done"
    assert [s.reward for s in steps] == [0.0] * (len(steps) - 1) + [1.0] and steps[-1].terminated
    turns = sorted((e for e in events if e.type == "turn.generated"), key=lambda e: e.seq)
    assert done.num_tokens == len(started.prompt_token_ids) + sum(len(t.token_ids) for t in turns) + sum(
        len(s.observation_token_ids) for s in steps)

    done = await terminal_of(js, bad_then_fixed.episode_id)
    assert (done.status, done.reward, done.info["token_check"]) == ("completed", 1.0, "ok")
    steps = sorted((e for e in await episode_events(js, bad_then_fixed.episode_id) if e.type == "step.completed"),
                   key=lambda e: e.seq)
    assert [s.info.get("tool_error") for s in steps[:2]] == ["unknown_tool", "malformed_json"]
    assert all(s.observation.startswith("Error: malformed tool call") for s in steps[:2])
    assert tools_tok.decode(steps[0].observation_token_ids).startswith("\n<|im_start|>tool\n<tool_response>\nError")
    assert steps[-1].info["malformed_calls"] == 2
    assert await work_queue_empty(js)


async def test_malformed_call_aborts_with_abort_on_error(stack: Stack, nc: bus.NATS, policy: ScriptedPolicy) -> None:
    await start_worker(stack)
    js = nc.jetstream()
    task = build_task(5)
    item = work_item("retail-orders", {"seed": 5, "abort_on_error": True}, max_turns=12)
    policy.scripts[item.episode_id] = [solution(task)[0], format_call("get_order", {"id": 3}), *solution(task)[1:]]
    await publish_event(js, item)
    done = await terminal_of(js, item.episode_id)
    assert (done.type, done.status, done.stop_reason, done.reward) == ("episode.finished", "aborted", "aborted", 0.0)
    assert done.num_turns == 2 and done.seq == 5 and done.info["token_check"] == "ok"
    events = await episode_events(js, item.episode_id)
    check_contract(events, item.episode_id, 1, 2)
    last_step = max((e for e in events if e.type == "step.completed"), key=lambda e: e.seq)
    assert last_step.info["aborted"] is True and last_step.info["tool_error"] == "invalid_arguments"
    assert not last_step.terminated and len(last_step.observation_token_ids) == 0
    assert len(policy.requests) == 2
    assert await work_queue_empty(js)
