"""The env worker as a real process on real NATS, with an in-test inference responder (a scripted policy).

Checks the events each episode leaves on RL_EVENTS (ids and seq per the contract), the work item's ack,
env and inference failures, cancellation, truncation, and episodes through a real inference-worker process
(fake engine). Process lifecycle tests (SIGTERM, SIGKILL, failover) are in test_env_worker_lifecycle.py.
The policy is ``tests/integration/policy.py``; its fixtures (``tok``, ``policy``) are in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.shared.events import EpisodeRequested, Event, SamplingParams, decode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.subjects import CANCEL_BUCKET, ENVS_BUCKET, EVENTS_STREAM, WORK_STREAM
from tests.helpers import metric, publish_event, until
from tests.integration.policy import Policy

TERMINAL = ("episode.finished", "episode.failed", "episode.cancelled")


# --- helpers ------------------------------------------------------------------------------------------
def work_item(env: str, task: dict[str, Any], batch_id: str | None = None, max_turns: int = 10,
              index: int = 0) -> EpisodeRequested:
    batch_id = batch_id or uuid.uuid4().hex
    episode_id = f"{batch_id}.{index}.0"
    return EpisodeRequested(event_id=f"{episode_id}:requested", episode_id=episode_id, batch_id=batch_id, attempt=1,
                            seq=0, produced_by="test", env=env, task=task, group_id=f"{batch_id}.{index}",
                            group_index=0, group_size=1, sampling=SamplingParams(max_tokens=32),
                            max_turns=max_turns)


async def read_events(js: bus.JetStreamContext) -> list[Event]:
    info = await js.stream_info(EVENTS_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(Exception):
            out.append(decode((await js.get_msg(EVENTS_STREAM, seq)).data or b""))
    return out


async def episode_events(js: bus.JetStreamContext, episode_id: str) -> list[Event]:
    return [e for e in await read_events(js) if e.episode_id == episode_id]


async def terminal_of(js: bus.JetStreamContext, episode_id: str, timeout_s: float = 20.0, attempt: int = 0) -> Any:
    async def find() -> Any:
        for e in await episode_events(js, episode_id):
            if e.type in TERMINAL and (not attempt or e.attempt == attempt):
                return e
        return None
    return await until(find, timeout_s, f"terminal event of {episode_id}")


async def work_queue_empty(js: bus.JetStreamContext) -> bool:
    async def empty() -> bool:
        return (await js.stream_info(WORK_STREAM)).state.messages == 0
    return bool(await until(empty, 10, "RL_WORK to be empty"))


def check_contract(events: list[Event], episode_id: str, attempt: int, turns: int) -> None:
    """Started, turn/step pairs and the terminal event, with the contract's ids and seq."""
    mine = sorted((e for e in events if e.attempt == attempt), key=lambda e: e.seq)
    p = f"{episode_id}:a{attempt}"
    expected = [("episode.started", f"{p}:started", 0)]
    for t in range(turns):
        expected.append(("turn.generated", f"{p}:t{t}:r1", 2 * t + 1))
        expected.append(("step.completed", f"{p}:s{t}", 2 * t + 2))
    expected.append((mine[-1].type, f"{p}:end", 2 * turns + 1))
    assert [(e.type, e.event_id, e.seq) for e in mine] == expected
    assert mine[-1].type in TERMINAL


async def start_worker(stack: Stack, name: str = "env-worker", **env: str) -> ServiceProcess:
    return await asyncio.to_thread(stack.start, "env-worker", name, **env)


# --- tests --------------------------------------------------------------------------------------------
async def test_arithmetic_and_guess_number_episodes(stack: Stack, nc: bus.NATS, policy: Policy,
                                                    tok: ChatTokenizer) -> None:
    worker = await start_worker(stack)
    js = nc.jetstream()
    envs = await js.key_value(ENVS_BUCKET)
    advert = (await envs.get("guess-number")).value
    assert advert is not None and b'"multi_turn":true' in advert and b'"registered_by":"env-worker"' in advert

    arith = work_item("arithmetic", {"a": 17, "b": 25, "op": "+"})
    guess = work_item("guess-number", {"target": 37, "low": 1, "high": 100})
    for item in (arith, guess):
        await publish_event(js, item)

    done = await terminal_of(js, arith.episode_id)
    assert done.type == "episode.finished" and done.status == "completed" and done.reward == 1.0
    assert done.num_turns == 1 and done.stop_reason == "terminated" and done.info["token_check"] == "ok"
    events = await episode_events(js, arith.episode_id)
    check_contract(events, arith.episode_id, 1, 1)
    started, turn, step = events[0], events[1], events[2]
    assert started.type == "episode.started" and started.worker_id == "env-worker"
    assert tok.decode(started.prompt_token_ids) == started.prompt_text
    assert step.type == "step.completed" and step.action == "The answer is 42." and step.turn_event_id == turn.event_id
    assert done.num_tokens == len(started.prompt_token_ids) + len(turn.token_ids) + len(step.observation_token_ids)

    done = await terminal_of(js, guess.episode_id)
    assert done.type == "episode.finished" and done.status == "completed" and done.reward == 1.0
    assert done.info["token_check"] == "ok"
    events = await episode_events(js, guess.episode_id)
    check_contract(events, guess.episode_id, 1, done.num_turns)
    steps = [e for e in events if e.type == "step.completed"]
    assert [s.observation for s in steps] == ["lower", "higher", ""]  # 50, 25, 37
    assert [s.action for s in steps] == ["My guess is 50.", "My guess is 25.", "My guess is 37."]
    assert done.num_turns == 3
    assert await work_queue_empty(js)
    assert worker.alive


async def test_env_failures(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    worker = await start_worker(stack)
    js = nc.jetstream()
    faulty = work_item("fixed-turns", {"turns": 4, "fail_at": 2})
    bad_task = work_item("arithmetic", {"a": 1, "b": 2, "op": "/"})
    unknown = work_item("no-such-env", {})
    for item in (faulty, bad_task, unknown):
        await publish_event(js, item)
    failed = await terminal_of(js, faulty.episode_id)
    assert failed.type == "episode.failed" and failed.failure_class == "env"
    # turn 1 was generated (seq 3) but its step failed: the partial trajectory keeps turn 0 only
    assert "InjectedEnvFault" in failed.reason and failed.num_turns == 1 and failed.seq == 5
    events = await episode_events(js, faulty.episode_id)
    assert [e.type for e in sorted(events, key=lambda e: e.seq)] == [
        "episode.started", "turn.generated", "step.completed", "turn.generated", "episode.failed"]
    reset_failed = await terminal_of(js, bad_task.episode_id)
    assert reset_failed.failure_class == "env" and "TaskError" in reset_failed.reason and reset_failed.seq == 1
    # an env this worker lacks does not fail: the item is handed back (no delivery spent) and waits for a worker
    # that has it (tests/integration/test_env_routing.py): wait until it was delivered and handed back twice
    def handed_back() -> int:
        return sum(1 for line in worker.log_path.read_text(errors="replace").splitlines()
                   if "work_item.not_my_env" in line and unknown.episode_id in line)

    await until(lambda: handed_back() >= 2, 20, "the unknown env's item handed back twice")
    assert not [e for e in await episode_events(js, unknown.episode_id) if e.type in TERMINAL]
    assert (await js.stream_info(WORK_STREAM)).state.messages == 1


async def test_no_inference_worker_fails_after_budget(stack: Stack, nc: bus.NATS) -> None:
    worker = await start_worker(stack, ROLLOUT_INFERENCE_MAX_TRIES="3", ROLLOUT_INFERENCE_BACKOFF_S="0.05")
    js = nc.jetstream()
    item = work_item("arithmetic", {"seed": 1})
    await publish_event(js, item)
    failed = await terminal_of(js, item.episode_id)
    assert failed.type == "episode.failed" and failed.failure_class == "inference" and "3 tries" in failed.reason
    assert failed.num_turns == 0 and failed.seq == 1
    assert await work_queue_empty(js)
    assert metric(worker.url, "rollout_inference_retries_total") == 2
    assert metric(worker.url, "rollout_episodes_total", {"status": "failed"}) == 1


async def test_cancel_before_start_and_mid_episode(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    worker = await start_worker(stack)
    js = nc.jetstream()
    cancels = await js.key_value(CANCEL_BUCKET)
    early = work_item("fixed-turns", {"turns": 3})
    await cancels.put(early.batch_id, b"2026-01-01T00:00:00Z")
    # "before start" means the worker knows of the cancel when the item arrives: the KV watch and the work
    # consumer are separate subscriptions, so an item published right after the put can be delivered first (the
    # episode then stops at its next turn, as the mid-episode case below checks)
    await until(lambda: metric(worker.url, "rollout_cancelled_batches") == 1, 10, "the worker to see the cancel")
    await publish_event(js, early)
    ev = await terminal_of(js, early.episode_id)
    assert ev.type == "episode.cancelled" and ev.num_turns == 0 and ev.event_id == f"{early.episode_id}:a1:end"
    assert [e.type for e in await episode_events(js, early.episode_id)] == ["episode.cancelled"]

    late = work_item("fixed-turns", {"turns": 50}, max_turns=50)
    policy.hold = lambda r: r.episode_id == late.episode_id and r.turn_index == 2
    await publish_event(js, late)
    await until(lambda: any(r.episode_id == late.episode_id and r.turn_index == 2 for r in policy.requests), 10,
                "turn 2 requested")
    await cancels.put(late.batch_id, b"2026-01-01T00:00:00Z")
    await until(lambda: metric(worker.url, "rollout_cancelled_batches") == 2, 10, "the worker to see the cancel")
    policy.release.set()
    ev = await terminal_of(js, late.episode_id)
    assert ev.type == "episode.cancelled" and ev.num_turns == 3 and ev.seq == 7
    assert await work_queue_empty(js)


async def test_max_turns_and_context_length_truncate(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    await start_worker(stack, ROLLOUT_MAX_MODEL_LEN="160")
    js = nc.jetstream()
    short = work_item("fixed-turns", {"turns": 10}, max_turns=2)
    long = work_item("fixed-turns", {"turns": 50}, max_turns=50, index=1)
    for item in (short, long):
        await publish_event(js, item)
    ev = await terminal_of(js, short.episode_id)
    assert (ev.status, ev.stop_reason, ev.num_turns, ev.info["token_check"]) == ("truncated", "max_turns", 2, "ok")
    ev = await terminal_of(js, long.episode_id)
    assert (ev.status, ev.stop_reason, ev.info["token_check"]) == ("truncated", "context_length", "ok")
    assert 1 < ev.num_turns < 50 and ev.num_tokens >= 160
    for req in (r for r in policy.requests if r.episode_id == long.episode_id):
        assert req.max_tokens == min(32, 160 - len(req.prompt_token_ids))
    check_contract(await episode_events(js, long.episode_id), long.episode_id, 1, ev.num_turns)


async def test_episodes_through_a_real_inference_worker(stack: Stack, nc: bus.NATS) -> None:
    """The fake engine in a real inference-worker process; every episode ends token-exact."""
    await asyncio.to_thread(stack.start, "inference-worker", "inference-1", ROLLOUT_ENGINE="fake")
    await start_worker(stack)
    js = nc.jetstream()
    items = [work_item("arithmetic", {"seed": 3}), work_item("guess-number", {"seed": 5}, max_turns=8, index=1),
             work_item("fixed-turns", {"turns": 4}, index=2)]
    for item in items:
        await publish_event(js, item)
    for item in items:
        ev = await terminal_of(js, item.episode_id)
        assert ev.type == "episode.finished" and ev.info["token_check"] == "ok", ev
        events = await episode_events(js, item.episode_id)
        check_contract(events, item.episode_id, 1, ev.num_turns)
        assert {e.worker_id for e in events if e.type == "turn.generated"} == {"inference-1"}
    assert (await terminal_of(js, items[2].episode_id)).num_turns == 4
    assert await work_queue_empty(js)
