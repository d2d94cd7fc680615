"""Agent functions in the env worker's pool of agent processes (``ROLLOUT_AGENT_PROCESSES``), through a real
env-worker process, recorder and scheduler on real NATS + Postgres, with a scripted policy answering the turns:
the trajectories equal those of the same agents run in-process, token for token; the deadline is enforced in the
agent process; an agent process killed in the middle of an episode fails that episode with class ``agent`` and
the pool starts it again.

The agents (``chat``: plain ``openai`` SDK calls, non-streamed and streamed; ``sleepy``) are in
tests/unit/test_agent_pool.py, whose imports are light: the agent processes import that module.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_env_worker import terminal_of
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_tool_env import ScriptedPolicy

REPO = str(Path(__file__).resolve().parents[2])
AGENTS = "tests.unit.test_agent_pool"
"""Where ``chat`` and ``sleepy`` live (a module that imports little: the agent processes import it)."""


def worker_env(processes: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {"ROLLOUT_AGENTS": f"chat={AGENTS}:chat,sleepy={AGENTS}:sleepy", "PYTHONPATH": path,
            "ROLLOUT_ENVS": "fixed-turns", "ROLLOUT_AGENT_PROCESSES": str(processes), "ROLLOUT_AGENT_TIMEOUT_S": "3"}


SCRIPTS = [["Hello there.", "Ünïcödé 🎲 streamed.", "Third."], ["One.", "Two, streamed."],
           ["A tool-less answer: 42.", "Streamed: 43.", "44.", "Last, streamed."]]
"""The scripted turns of the ``chat`` episodes compared between the pool and in-process."""


@pytest.fixture
async def policy(nc: bus.NATS, model_dir: str) -> AsyncIterator[ScriptedPolicy]:
    p = ScriptedPolicy(nc, ChatTokenizer(model_dir))
    await p.start()
    yield p
    await p.stop()


async def submit(url: str, policy: ScriptedPolicy, batch_id: str, env: str, tasks: list[dict[str, Any]],
                 scripts: list[list[str]]) -> list[str]:
    """A batch of ``tasks`` (max 4 turns each), episode ``i`` answered with ``scripts[i]``; its episode ids."""
    ids = [f"{batch_id}.{i}.0" for i in range(len(tasks))]
    policy.scripts.update(zip(ids, scripts, strict=True))
    resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": env, "tasks": tasks, "max_turns": 4, "batch_id": batch_id, "sampling": {"max_tokens": 32}})
    assert resp.status_code == 201, resp.text
    return ids


def agent_processes(worker: ServiceProcess) -> list[int]:
    return [p.pid for p in worker.descendants() if "env_worker.agents.process" in " ".join(p.cmdline())]


async def test_pool_is_token_exact_enforces_deadlines_and_survives_a_killed_process(
        stack: Stack, nc: bus.NATS, policy: ScriptedPolicy, database_url: str) -> None:
    worker = await asyncio.to_thread(stack.start, "env-worker", "env-worker-pool", **worker_env(2))
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    js = nc.jetstream()
    pids = agent_processes(worker)
    assert len(pids) == 2

    chats = [{"q": f"Question {i}?", "turns": len(s)} for i, s in enumerate(SCRIPTS)]
    pooled = await submit(url, policy, "pool", "chat", chats, SCRIPTS)
    (slow,) = await submit(url, policy, "slow", "sleepy", [{}], [["zzz"]])
    ends = [await terminal_of(js, ep, timeout_s=30) for ep in pooled]
    for end, script in zip(ends, SCRIPTS, strict=True):
        assert (end.type, end.status, end.num_turns) == ("episode.finished", "completed", len(script)), end
        assert end.info["token_check"] == "ok" and end.info["answer"] == script[-1]
        assert end.info["agent_info"]["pid"] in pids  # run by an agent process, not the worker
    timed_out = await terminal_of(js, slow, timeout_s=30)
    assert (timed_out.failure_class, timed_out.num_turns) == ("timeout", 1)
    assert "3s deadline" in timed_out.reason and "killed" not in timed_out.reason  # cancelled in its process

    # kill -9 every agent process while the held episode's agent waits for its first turn
    policy.hold = lambda req: req.episode_id == "held.0.0"
    (held,) = await submit(url, policy, "held", "chat", [{"q": "held", "turns": 2}], [["never"]])
    await asyncio.to_thread(wait_for, lambda: any(r.episode_id == held for r in policy.requests), 20, "held call")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    lost = await terminal_of(js, held, timeout_s=30)
    assert (lost.type, lost.failure_class) == ("episode.failed", "agent"), lost
    assert "was killed by signal 9 before the agent returned" in lost.reason, lost.reason
    assert "after 0 model calls" in lost.reason, lost.reason
    (after,) = await submit(url, policy, "after", "chat", [{"q": "Again?", "turns": 1}], [["Back."]])
    assert (await terminal_of(js, after, timeout_s=30)).status == "completed"  # the pool started them again
    restarted = agent_processes(worker)
    assert len(restarted) == 2 and not set(restarted) & set(pids) and worker.alive
    policy.release.set()

    # the same agents in-process: the same trajectories
    await asyncio.to_thread(worker.stop)
    inproc = await asyncio.to_thread(stack.start, "env-worker", "env-worker-inproc", **worker_env(0))
    assert agent_processes(inproc) == []
    local = await submit(url, policy, "local", "chat", chats, SCRIPTS)
    for ep in local:
        assert (await terminal_of(js, ep, timeout_s=30)).status == "completed"

    sql = Sql(database_url)
    try:
        episodes = [*pooled, *local, slow, held, after]

        def recorded() -> bool:
            n = sql.scalar("select count(*) from episodes where id = any(:ids) and status in "
                           "('completed', 'failed')", ids=episodes)
            return bool(n == len(episodes))

        await asyncio.to_thread(wait_for, recorded, 30, "every episode recorded")
        assert check_token_exact(sql, "pool") == check_token_exact(sql, "local") == len(SCRIPTS)
        cols = "token_ids, loss_mask, logprobs, action_ranges, segments, num_tokens, reward"
        for a, b in zip(pooled, local, strict=True):
            pool_tr = sql.rows(f"select {cols} from trajectories where episode_id = :e", e=a)[0]
            local_tr = sql.rows(f"select {cols} from trajectories where episode_id = :e", e=b)[0]
            assert pool_tr == local_tr
        failed = sql.rows("select failure_class, failure_reason from episodes where id = :e", e=held)[0]
        assert failed["failure_class"] == "agent" and failed["failure_reason"] == lost.reason
    finally:
        sql.close()
