"""The agent process pool on real processes: runs spread over them, results and tracebacks come back, deadlines
are enforced in the agent process (and a process that blocks its event loop is killed), a process that dies
ends its runs ``lost`` and is started again, a cancelled run is cancelled in its process.

The agents here make no model calls, except ``chat`` and ``sleepy``, which tests/integration/test_agent_pool.py
runs against the session endpoint (this module imports little, so agent processes start fast).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollout_ledger.services.env_worker.agents import pool as agent_pool
from rollout_ledger.services.env_worker.agents.pool import AgentPool
from rollout_ledger.services.env_worker.agents.run import AgentRun, RunEnd
from tests.helpers import until

HERE = "tests.unit.test_agent_pool"


async def echo(task: dict[str, Any], client: Any) -> dict[str, Any]:
    """Returns the task's reward; says which process and which HTTP client ran it."""
    await asyncio.sleep(task.get("sleep", 0))
    if task.get("close"):
        await client.close()  # an agent closing its client leaves the shared one open
    return {"reward": task["reward"], "answer": str(client.base_url),
            "info": {"pid": os.getpid(), "http": id(client._client)}}


async def raises(task: dict[str, Any], client: Any) -> float:
    return _parse("nope")


def _parse(text: str) -> float:
    return float(text)


async def sleeps(task: dict[str, Any], client: Any) -> float:
    """Sleeps; marks that it started, and again when it is cancelled."""
    Path(task["mark"]).write_text("started")  # noqa: ASYNC240 - a one-off mark the test reads
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        Path(task["mark"]).write_text("cancelled")  # noqa: ASYNC240 - a one-off mark the test reads
        raise
    return 1.0


async def blocks(task: dict[str, Any], client: Any) -> float:
    """Blocks its process's event loop (a deadline cannot cancel it)."""
    time.sleep(60)  # noqa: ASYNC251 - the point: a blocked event loop
    return 1.0


async def crashes(task: dict[str, Any], client: Any) -> float:
    await asyncio.sleep(task.get("sleep", 0))
    os._exit(3)


async def chat(task: dict[str, Any], client: Any) -> dict[str, Any]:
    """``task["turns"]`` calls, each answer sent back with a follow-up; every other call streamed, the first
    with logprobs."""
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["q"]}]
    text = ""
    for t in range(task["turns"]):
        if t % 2:
            stream = await client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                          max_tokens=32)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32,
                                                        logprobs=t == 0)
            text = resp.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then ({t})?"}]
    return {"reward": float(len(text) > 0), "answer": text, "info": {"pid": os.getpid()}}


async def sleepy(task: dict[str, Any], client: Any) -> float:
    """One call, then hangs (the deadline cancels it in its agent process)."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    await asyncio.sleep(3600)
    return 1.0


AGENTS = ",".join(f"{n}={HERE}:{n}" for n in ("echo", "raises", "sleeps", "blocks", "crashes"))


def run(agent: str, timeout_s: float = 10.0, **task: Any) -> AgentRun:
    return AgentRun(agent=agent, task=task, base_url="http://127.0.0.1:9/sessions/ep/v1", api_key="sess-x",
                    timeout_s=timeout_s)


@pytest.fixture
async def pool(request: pytest.FixtureRequest) -> AsyncIterator[AgentPool]:
    p = await AgentPool(AGENTS, getattr(request, "param", 2)).start()
    yield p
    await p.stop()


async def test_runs_spread_over_processes_sharing_one_http_client(pool: AgentPool) -> None:
    outs = await asyncio.gather(*(pool.run(run("echo", reward=i / 10, sleep=0.2, close=i == 0)) for i in range(8)))
    assert [o.end for o in outs] == [RunEnd.RETURNED] * 8
    assert [o.result.reward for o in outs if o.result] == [i / 10 for i in range(8)]
    assert outs[0].result is not None and outs[0].result.answer == "http://127.0.0.1:9/sessions/ep/v1/"
    by_pid: dict[int, set[int]] = {}
    for o in outs:
        assert o.result is not None
        by_pid.setdefault(o.result.info["pid"], set()).add(o.result.info["http"])
    assert len(by_pid) == 2 and set(pool.pids()) == set(by_pid) and os.getpid() not in by_pid
    assert all(len(clients) == 1 for clients in by_pid.values())  # one HTTP client per process


async def test_tracebacks_and_deadlines_come_from_the_agent_process(pool: AgentPool) -> None:
    raised = await pool.run(run("raises"))
    assert raised.end is RunEnd.RAISED and raised.error == "ValueError: could not convert string to float: 'nope'"
    assert "Traceback" in raised.message and "_parse" in raised.message
    started = time.monotonic()
    timed_out = await pool.run(run("sleeps", timeout_s=0.5, mark="/dev/null"))
    assert timed_out.end is RunEnd.TIMEOUT and timed_out.message == ""  # the process cancelled it, on time
    assert time.monotonic() - started < 0.5 + agent_pool.GRACE_S


@pytest.mark.parametrize("pool", [1], indirect=True)
async def test_a_dead_process_loses_its_runs_and_is_restarted(pool: AgentPool, tmp_path: Path) -> None:
    (pid,) = pool.pids()
    other = asyncio.create_task(pool.run(run("sleeps", mark=str(tmp_path / "m"))))
    crashed = await pool.run(run("crashes", sleep=0.2))
    assert crashed.end is RunEnd.LOST and f"pid {pid}" in crashed.message and "exited with code 3" in crashed.message
    lost = await other
    assert lost.end is RunEnd.LOST
    after = await pool.run(run("echo", reward=1.0))  # waits for the restarted process
    assert after.end is RunEnd.RETURNED and after.result is not None and after.result.info["pid"] != pid
    assert pool.restarts == 1 and pool.pids() == [after.result.info["pid"]]


@pytest.mark.parametrize("pool", [1], indirect=True)
async def test_a_process_blocking_past_the_deadline_is_killed(pool: AgentPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_pool, "GRACE_S", 0.5)
    (pid,) = pool.pids()
    stuck = await pool.run(run("blocks", timeout_s=0.3))
    assert stuck.end is RunEnd.TIMEOUT and f"pid {pid}" in stuck.message and "was killed" in stuck.message
    after = await pool.run(run("echo", reward=0.0))
    assert after.end is RunEnd.RETURNED and pool.pids() != [pid]


async def test_cancelling_a_run_cancels_it_in_its_process(pool: AgentPool, tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    task = asyncio.create_task(pool.run(run("sleeps", mark=str(mark))))
    await until(lambda: mark.exists() and mark.read_text() == "started", 30, "the run started in its process")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: mark.read_text() == "cancelled", 30, "the run cancelled in its process")
    assert all(not p.pending for p in pool.procs)
