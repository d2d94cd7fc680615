"""What the benchmarks of a running stack measure the same way: its processes, the CPU seconds each one used (with
its children), and a batch submitted and waited for until its trajectories are stored."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx
import psutil
from sqlalchemy import text
from sqlalchemy.engine import Engine

from rollout_ledger.cli.stack.devstack import DevStack


def all_pids(stack: DevStack) -> dict[str, int]:
    """Service processes plus the NATS server and the Postgres postmaster (its backends are children)."""
    assert stack.stack is not None
    pids = {p.name: p.proc.pid for p in stack.stack.procs if p.proc is not None}
    if stack.infra.nats is not None and stack.infra.nats.proc is not None:
        pids["nats-server"] = stack.infra.nats.proc.pid
    if stack.infra.postgres is not None:
        pidfile = stack.infra.postgres.datadir / "postmaster.pid"
        pids["postgres"] = int(pidfile.read_text().split()[0])
    return pids


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process and its descendants used so far; 0 when it is gone."""
    try:
        proc = psutil.Process(pid)
        total = float(sum(proc.cpu_times()[:2]))
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        return total
    except psutil.Error:
        return 0.0


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """``tree_cpu_s`` of each named process."""
    return {name: tree_cpu_s(pid) for name, pid in pids.items()}


def submit(stack: DevStack, body: dict[str, Any]) -> str:
    """POST the batch ``body`` to the stack's scheduler; its batch id."""
    resp = httpx.post(f"{stack.scheduler_url}/v1/batches", timeout=120,
                      headers={"Authorization": f"Bearer {stack.api_token}"}, json=body)
    resp.raise_for_status()
    return str(resp.json()["batch_id"])


def wait_trajectories(engine: Engine, batch_id: str, count: int, poll_s: float) -> None:
    """Poll every ``poll_s`` until the batch has ``count`` trajectories stored."""
    with engine.connect() as conn:
        q = text("select count(*) from trajectories where batch_id = :b")
        while conn.execute(q, {"b": batch_id}).scalar_one() < count:
            time.sleep(poll_s)
            conn.commit()
