"""``retail-orders`` through a real env-worker process, with a scripted tool-calling policy answering the turns.

A 135M model seldom emits a tool call, so the policy here is an in-test inference responder that answers each
``InferenceRequested`` with the next turn of a script (Hermes tool calls, tokenised with the real tokenizer).
Checks the events (ids, seq, reward, status), the tool-aware prompt, token exactness, and malformed calls:
an error observation by default, status ``aborted`` with ``abort_on_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.services.env_worker.envs.retail import build_task, solution
from rollout_ledger.services.env_worker.envs.tools import format_call
from rollout_ledger.services.env_worker.tokenization import TOOLS_TEMPLATE
from rollout_ledger.services.supervisor import Stack
from rollout_ledger.shared import bus
from rollout_ledger.shared.chat import ChatTokenizer
from rollout_ledger.shared.events import FinishReason, InferenceRequested, TurnGenerated, decode_as, dumps, encode
from rollout_ledger.shared.subjects import ENVS_BUCKET, INFER_ANY, INFER_HEARTBEAT, INFER_QUEUE, infer_worker_subject
from tests.integration.test_env_worker import check_contract, episode_events, terminal_of, work_item, work_queue_empty


class ScriptedPolicy:
    """Answers turn t of an episode with ``scripts[episode_id][t]`` (+ end-of-turn), as an inference worker would."""

    def __init__(self, nc: bus.NATS, tok: ChatTokenizer, worker_id: str = "scripted") -> None:
        self.nc, self.js, self.tok, self.worker_id = nc, nc.jetstream(), tok, worker_id
        self.scripts: dict[str, Sequence[str]] = {}
        self.requests: list[InferenceRequested] = []
        self._subs: list[Subscription] = []
        self._beat: asyncio.Task[None] | None = None

    async def start(self) -> ScriptedPolicy:
        for subject, queue in ((infer_worker_subject(self.worker_id), ""), (INFER_ANY, INFER_QUEUE)):
            self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=self._serve))
        self._beat = asyncio.create_task(self._beat_forever())
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _beat_forever(self) -> None:
        while not self.nc.is_closed:
            await self.nc.publish(INFER_HEARTBEAT, dumps({
                "worker_id": self.worker_id, "subject": infer_worker_subject(self.worker_id), "inflight": 0,
                "capacity": 1000, "weight_version": 0, "engine": "scripted", "draining": False, "time": time.time()}))
            await asyncio.sleep(0.5)

    async def _serve(self, msg: Msg) -> None:
        req = decode_as(msg.data, InferenceRequested)
        self.requests.append(req)
        text = self.scripts[req.episode_id][req.turn_index]
        assert self.tok.eos_token_id is not None
        ids = np.append(self.tok.encode(text), self.tok.eos_token_id).astype(np.int32)
        turn = TurnGenerated(
            event_id=req.request_id, episode_id=req.episode_id, batch_id=req.batch_id, attempt=req.attempt,
            seq=req.reply_seq, produced_by=f"inference-worker/{self.worker_id}", request_id=req.request_id,
            turn_index=req.turn_index, prompt_len=len(req.prompt_token_ids), token_ids=ids,
            logprobs=np.full(len(ids), -0.5, dtype=np.float32), finish_reason=FinishReason.STOP, weight_version=0,
            engine="scripted", worker_id=self.worker_id, queue_ms=0.0, generate_ms=0.0)
        await bus.publish_event(self.js, turn)
        await self.nc.publish(msg.reply, encode(turn))


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
        await bus.publish_event(js, item)

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
    await bus.publish_event(js, item)
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
