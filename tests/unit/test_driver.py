"""The episode driver in process on real NATS: the events it leaves assemble into the exact token sequence."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from nats.aio.msg import Msg

from rollout_ledger.services.env_worker.attempt import AttemptDeps
from rollout_ledger.services.env_worker.driver import EpisodeDriver
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.envs.base import Env, EnvSpec, Message, StepResult
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.shared.events import (
    EpisodeRequested,
    Event,
    FinishReason,
    InferenceRequested,
    SamplingParams,
    StepCompleted,
    TurnGenerated,
    decode,
    decode_as,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.subjects import EVENTS_STREAM, INFER_ANY, INFER_QUEUE, event_subject
from tests.helpers import publish_event

ANSWERS = ["Hello there.", "A longer answer that will be cut", "Fine."]


@pytest.fixture
async def served(nc: bus.NATS, model_dir: str) -> AsyncIterator[ChatTokenizer]:
    """An INFER_ANY responder answering turn t with ANSWERS[t % 3]; turn 1 is cut (finish length, no eos)."""
    tok = ChatTokenizer(model_dir)
    js = nc.jetstream()

    async def on_request(msg: Msg) -> None:
        req = decode_as(msg.data, InferenceRequested)
        ids = tok.encode(ANSWERS[req.turn_index % 3])
        cut = req.turn_index % 3 == 1
        if not cut:
            ids = np.append(ids, np.int32(2))
        turn = TurnGenerated(
            event_id=req.request_id, episode_id=req.episode_id, batch_id=req.batch_id, attempt=req.attempt,
            seq=req.reply_seq, produced_by="test", request_id=req.request_id, turn_index=req.turn_index,
            prompt_len=len(req.prompt_token_ids), token_ids=ids.astype(np.int32),
            logprobs=np.zeros(len(ids), dtype=np.float32),
            finish_reason=FinishReason.LENGTH if cut else FinishReason.STOP, weight_version=0, engine="test",
            worker_id="w", queue_ms=0.0, generate_ms=0.0)
        await publish_event(js, turn)
        await nc.publish(msg.reply, encode(turn))

    sub = await nc.subscribe(INFER_ANY, queue=INFER_QUEUE, cb=on_request)
    yield tok
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


async def run_episode(nc: bus.NATS, tok: ChatTokenizer, env: str, task: dict[str, Any], max_turns: int,
                      cancelled: bool = False, envs: EnvRegistry | None = None,
                      sampling: SamplingParams | None = None) -> tuple[Any, list[Event]]:
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=5, heartbeat_timeout_s=5))
    await client.start()
    publisher = StreamPublisher(nc)
    await publisher.start()
    deps = AttemptDeps(publisher=publisher, client=client, envs=envs or builtin_registry(), template=TurnTemplate(tok),
                      is_cancelled=lambda _b: cancelled, metrics=build_metrics(), worker_id="w0")
    item = EpisodeRequested(event_id="b.0.0:requested", episode_id="b.0.0", batch_id="b", attempt=1, seq=0,
                            produced_by="test", env=env, task=task, group_id="b.0", group_index=0, group_size=1,
                            sampling=sampling or SamplingParams(max_tokens=16), max_turns=max_turns)
    try:
        outcome = await EpisodeDriver(deps, item, attempt=1).run()
    finally:
        await publisher.stop()
        await client.stop()
    js = nc.jetstream()
    info = await js.stream_info(EVENTS_STREAM)
    events = [decode((await js.get_msg(EVENTS_STREAM, s)).data or b"")
              for s in range(info.state.first_seq, info.state.last_seq + 1)]
    return outcome, sorted(events, key=lambda e: e.seq)


async def test_events_assemble_into_the_rendered_conversation(nc: bus.NATS, served: ChatTokenizer) -> None:
    tok = served
    outcome, events = await run_episode(nc, tok, "fixed-turns", {"turns": 5}, max_turns=5)
    assert outcome.status == "completed" and outcome.num_turns == 5
    started, *middle, finished = events
    turns = [e for e in middle if e.type == "turn.generated"]
    steps = [e for e in middle if e.type == "step.completed"]
    assert started.type == "episode.started" and finished.type == "episode.finished"
    ids = [started.prompt_token_ids]
    mask = [np.zeros(len(started.prompt_token_ids), dtype=np.int8)]
    for turn, step in zip(turns, steps, strict=True):
        assert step.turn_event_id == turn.event_id
        ids += [turn.token_ids, step.observation_token_ids]
        mask += [np.ones(len(turn.token_ids), dtype=np.int8), np.zeros(len(step.observation_token_ids), np.int8)]
    full = np.concatenate(ids)
    conversation = list(started.messages)
    for step in steps[:-1]:
        conversation += [{"role": "assistant", "content": step.action}, {"role": "user", "content": step.observation}]
    conversation.append({"role": "assistant", "content": steps[-1].action})
    # the sequence ends with the last sampled ids (turn 4 was cut, no eos); the template would close it with
    # "<|im_end|>\n", which is not part of the trajectory
    assert tok.decode(full) + "<|im_end|>\n" == tok.render(conversation)
    assert full[-1] != 2
    assert steps[-1].observation == "" and len(steps[-1].observation_token_ids) == 0
    assert steps[-1].info["final_observation"] == "Turn 5 of 5 done. Continue."
    assert finished.num_tokens == len(full) and finished.info == {"token_check": "ok", "segment_checks": ["ok"]}
    assert int(np.concatenate(mask).sum()) == sum(len(t.token_ids) for t in turns)
    assert steps[1].observation_token_ids[0] == 2  # turn 1 was cut: the delta closes it with <|im_end|>
    assert finished.reward == 1.0 and finished.stop_reason == "terminated"


async def test_a_stop_string_cuts_the_action_not_the_ids(nc: bus.NATS, served: ChatTokenizer) -> None:
    """As OpenAI answers: the env gets the text before the stop string (turn 1 sampled "A longer answer that will be
    cut"; an engine may return the stop string and text after it); the trajectory keeps every sampled id."""
    tok = served
    outcome, events = await run_episode(nc, tok, "fixed-turns", {"turns": 3}, max_turns=3,
                                        sampling=SamplingParams(max_tokens=16, stop=[" will", "answer"]))
    assert outcome.status == "completed"
    turns = [e for e in events if e.type == "turn.generated"]
    steps = [e for e in events if e.type == "step.completed"]
    assert [s.action for s in steps] == ["Hello there.", "A longer ", "Fine."]
    assert tok.decode(turns[1].token_ids) == "A longer answer that will be cut"  # verbatim
    assert events[-1].info["token_check"] == "ok"


async def test_cancelled_batch_never_starts(nc: bus.NATS, served: ChatTokenizer) -> None:
    outcome, events = await run_episode(nc, served, "arithmetic", {"seed": 1}, max_turns=1, cancelled=True)
    assert outcome.status == "cancelled"
    assert [(e.type, e.event_id, e.seq) for e in events] == [("episode.cancelled", "b.0.0:a1:end", 1)]


async def test_env_reset_failure_is_an_env_failure(nc: bus.NATS, served: ChatTokenizer) -> None:
    outcome, events = await run_episode(nc, served, "guess-number", {"target": 0, "low": 1, "high": 9}, max_turns=3)
    assert outcome.status == "failed"
    (failed,) = events
    assert failed.type == "episode.failed" and failed.failure_class == "env" and "TaskError" in failed.reason


class _RewardEnv(Env):
    """Step 0 answers reward 1.0, steps 1 and 2 answer the task's ``reward`` (NaN, +/-inf, 1.7e308)."""

    def __init__(self) -> None:
        self._reward = 0.0
        self._steps = 0

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self._reward = float(task["reward"])
        return [{"role": "user", "content": "Say anything."}]

    async def step(self, action: str) -> StepResult:
        self._steps += 1
        return StepResult([{"role": "user", "content": "More."}], reward=1.0 if self._steps == 1 else self._reward,
                          terminated=self._steps >= 3)


@pytest.mark.parametrize(("reward", "reason", "kept"), [
    ("nan", "non-finite reward", [1.0]), ("inf", "non-finite reward", [1.0]),
    ("-inf", "non-finite reward", [1.0]), ("1.7e308", "reward sum overflowed", [1.0, 1.7e308])])
async def test_non_finite_reward_fails_the_attempt_as_env(nc: bus.NATS, served: ChatTokenizer, reward: str,
                                                          reason: str, kept: list[float]) -> None:
    """A NaN / infinite step reward, or a reward sum that overflows, fails the attempt with class env: no step
    and no finished event carries it."""
    envs = EnvRegistry([EnvSpec(name="reward-env", factory=_RewardEnv, description="test", multi_turn=True)])
    outcome, events = await run_episode(nc, served, "reward-env", {"reward": reward}, max_turns=3, envs=envs)
    assert outcome.status == "failed"
    failed = events[-1]
    assert failed.type == "episode.failed" and failed.failure_class == "env" and not failed.will_retry
    assert reason in failed.reason and failed.num_turns == len(kept)
    assert [e.reward for e in events if e.type == "step.completed"] == kept
    assert not any(e.type == "episode.finished" for e in events)


async def test_a_step_whose_ack_was_lost_is_published_again_not_the_attempt(nc: bus.NATS,
                                                                             served: ChatTokenizer) -> None:
    """A step published as NATS went down never gets its ack: before the terminal event it is published once more
    (same Nats-Msg-Id) instead of handing the whole attempt back to be generated again."""
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=5, heartbeat_timeout_s=5))
    publisher = StreamPublisher(nc, ack_timeout_s=0.3)
    await publisher.start()
    deps = AttemptDeps(publisher=publisher, client=client, envs=builtin_registry(), template=TurnTemplate(served),
                      is_cancelled=lambda _b: False, metrics=build_metrics(), worker_id="w0", publish_timeout_s=0.3)
    item = EpisodeRequested(event_id="b.0.0:requested", episode_id="b.0.0", batch_id="b", attempt=1, seq=0,
                            produced_by="test", env="fixed-turns", task={"turns": 1}, group_id="b.0", group_index=0,
                            group_size=1, sampling=SamplingParams(max_tokens=16), max_turns=1)
    driver = EpisodeDriver(deps, item, attempt=1)
    step = StepCompleted(event_id="b.0.0:a1:s0", episode_id="b.0.0", batch_id="b", attempt=1, seq=2,
                         produced_by="test", turn_index=0, turn_event_id="b.0.0:a1:t0:r1", action="a",
                         observation="o", observation_token_ids=np.zeros(0, dtype=np.int32), reward=0.0,
                         terminated=True, truncated=False)
    lost: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # the ack that never comes
    driver._pending_acks.append((lost, step))
    try:
        await driver.flush()
    finally:
        await publisher.stop()
    js = nc.jetstream()
    stored = await js.get_msg(EVENTS_STREAM, subject=event_subject("step.completed"))
    assert decode(stored.data or b"").event_id == "b.0.0:a1:s0"
