"""The env worker's process lifecycle on real NATS: SIGTERM drains or hands work back, SIGKILL is redelivered,
a dead inference worker's turn fails over.

The in-test policy is tests/integration/policy.py (fixtures in conftest.py); helpers come from test_env_worker.py.
"""

from __future__ import annotations

import asyncio
import signal

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import WORK_STREAM
from tests.helpers import publish_event, until
from tests.integration.policy import Policy
from tests.integration.test_env_worker import (
    TERMINAL,
    check_contract,
    episode_events,
    start_worker,
    terminal_of,
    work_item,
    work_queue_empty,
)


async def test_sigterm_drains_in_flight_episodes(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    policy.delay_s = 0.1
    worker = await start_worker(stack)
    js = nc.jetstream()
    items = [work_item("fixed-turns", {"turns": 5}, index=i) for i in range(4)]
    for item in items:
        await publish_event(js, item)
    await until(lambda: len({r.episode_id for r in policy.requests}) == 4, 10, "all episodes running")
    code = await asyncio.to_thread(worker.stop, 30.0)
    assert code == 0
    for item in items:
        ev = await terminal_of(js, item.episode_id, timeout_s=5)
        assert ev.type == "episode.finished" and ev.num_turns == 5
    assert await work_queue_empty(js)


async def test_sigterm_past_drain_timeout_hands_work_back(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    worker = await start_worker(stack, ROLLOUT_DRAIN_TIMEOUT_S="0.5")
    js = nc.jetstream()
    item = work_item("fixed-turns", {"turns": 3})
    policy.hold = lambda r: r.turn_index == 1
    await publish_event(js, item)
    await until(lambda: any(r.turn_index == 1 for r in policy.requests), 10, "turn 1 requested")
    code = await asyncio.to_thread(worker.stop, 30.0)
    assert code == 0
    assert (await js.stream_info(WORK_STREAM)).state.messages == 1  # nak'ed: still on the queue
    assert not [e for e in await episode_events(js, item.episode_id) if e.type in TERMINAL]
    policy.hold = lambda r: False
    policy.release.set()
    await start_worker(stack, name="env-worker-2")
    ev = await terminal_of(js, item.episode_id, attempt=2)
    assert ev.type == "episode.finished" and ev.produced_by == "env-worker/env-worker-2"
    assert await work_queue_empty(js)


async def test_sigkill_mid_episode_is_redelivered_as_attempt_2(stack: Stack, nc: bus.NATS, policy: Policy) -> None:
    first = await start_worker(stack, name="doomed", ROLLOUT_ACK_WAIT_S="3")
    js = nc.jetstream()
    item = work_item("fixed-turns", {"turns": 3})
    policy.hold = lambda r: r.attempt == 1 and r.turn_index == 1
    await publish_event(js, item)
    await until(lambda: any(r.turn_index == 1 for r in policy.requests), 10, "turn 1 requested")
    await asyncio.to_thread(first.kill)
    assert first.proc is not None and first.proc.returncode == -signal.SIGKILL
    await start_worker(stack, name="survivor", ROLLOUT_ACK_WAIT_S="3")
    ev = await terminal_of(js, item.episode_id, timeout_s=20, attempt=2)
    assert ev.type == "episode.finished" and ev.num_turns == 3 and ev.info["token_check"] == "ok"
    events = await episode_events(js, item.episode_id)
    check_contract(events, item.episode_id, 2, 3)
    assert {e.attempt for e in events} == {1, 2}
    assert not [e for e in events if e.attempt == 1 and e.type in TERMINAL]
    assert await work_queue_empty(js)
    policy.release.set()


async def test_failover_when_an_inference_worker_dies(stack: Stack, nc: bus.NATS) -> None:
    """SIGKILL the inference worker holding a turn: its heartbeats stop and the turn is retried on another.

    The workers beat every 0.2 s against the env worker's 1 s timeout. With the default 1 s beat, a beat a few ms
    late on a busy machine had the env worker fail over inference-a's turn while it was still alive (CI saw r3,
    not r2); the env worker now warns of such a setting (``inference.heartbeat_timeout_short``)."""
    doomed = await asyncio.to_thread(stack.start, "inference-worker", "inference-a", ROLLOUT_ENGINE="fake",
                                     ROLLOUT_FAKE_DELAY_S="30", ROLLOUT_HEARTBEAT_S="0.2")
    await start_worker(stack, ROLLOUT_HEARTBEAT_TIMEOUT_S="1", ROLLOUT_INFERENCE_BACKOFF_S="0.05")
    js = nc.jetstream()
    item = work_item("fixed-turns", {"turns": 2})
    await publish_event(js, item)

    async def started() -> bool:
        return any(e.type == "episode.started" for e in await episode_events(js, item.episode_id))

    await until(started, 10, "episode started (turn 0 waiting in inference-a)")
    await asyncio.to_thread(stack.start, "inference-worker", "inference-b", ROLLOUT_ENGINE="fake",
                            ROLLOUT_HEARTBEAT_S="0.2")
    await asyncio.to_thread(doomed.kill)
    ev = await terminal_of(js, item.episode_id, timeout_s=15)
    assert ev.type == "episode.finished" and ev.num_turns == 2 and ev.info["token_check"] == "ok"
    turns = sorted((e for e in await episode_events(js, item.episode_id) if e.type == "turn.generated"),
                   key=lambda e: e.seq)
    assert [(t.worker_id, t.request_id.rsplit(":", 2)[1:]) for t in turns] == [
        ("inference-b", ["t0", "r2"]), ("inference-b", ["t1", "r1"])]
