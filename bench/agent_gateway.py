"""Agent-path benchmark: the same multi-turn agent through Rollout Ledger's session endpoint and through
``rllm-model-gateway`` (a session-routed OpenAI proxy that stores every call in SQLite), side by side, each in
front of a zero-cost engine.

- Ours: the whole system (``DevStack``: scheduler, env worker with ``ROLLOUT_AGENT_PROCESSES`` agent processes,
  inference worker on the FAKE engine, recorder, NATS, Postgres); a batch of ``sessions`` episodes of the agent
  ``bench.agent_gateway:agent``. A run ends when every trajectory is in Postgres.
- Theirs: ``python -m rllm_model_gateway`` (v0.1.0, SQLite store, its defaults) in front of a FAKE
  OpenAI-compatible upstream (``--serve-upstream``: the same ``FakeEngine`` answering, prompt ids from a
  per-message token cache, a vLLM-shaped response with ``prompt_token_ids``, ``token_ids`` and logprobs, as the
  gateway asks vLLM for); the same agent function, run by the same ``AgentPool`` with as many agent processes,
  one gateway session per episode. A run ends when every call is in the SQLite file.

The agent makes ``turns`` calls (max_tokens 16), sending back each answer and a short user message, and times
each call (p50/p99 over all calls). CPU per turn is the CPU time of every process of the system (agent processes
included, listed apart) over the run, divided by its turns. Bytes per 50-turn session: ours, the growth of every
table (with indexes and TOAST) over the 16 x 50 run, and the rows' own bytes (``pg_column_size``) per table; the
event log in NATS (RL_EVENTS, limits retention) is listed apart. Theirs: the growth of the SQLite file and
``length(data)`` of its trace rows. Run under ``flock /tmp/heavy.lock`` on an otherwise idle machine:

    python -m bench.agent_gateway                 # 64 x 8 and 16 x 50, the figures in docs/benchmarks.md
    python -m bench.agent_gateway --quick         # 16 x 8 and 4 x 50
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

LATENCY_DIR_ENV = "BENCH_AGENT_LATENCY_DIR"
"""Where the agent appends its per-call latencies (one JSON line per episode, a file per process)."""


async def agent(task: dict[str, Any], client: Any) -> float:
    """The benchmarked agent: ``task["turns"]`` chat calls on one growing conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a concise assistant."},
                                      {"role": "user", "content": "Let us talk for a while. Turn 1, go."}]
    turns = int(task["turns"])
    latencies = []
    for t in range(turns):
        started = time.perf_counter()
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        latencies.append(round((time.perf_counter() - started) * 1000, 3))
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        messages.append({"role": "user", "content": f"Turn {t + 1} of {turns} done. Continue."})
    out = os.environ.get(LATENCY_DIR_ENV)
    if out:
        with open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:  # noqa: ASYNC230 - one small line per episode
            f.write(json.dumps(latencies) + "\n")
    return 1.0


# --- the fake upstream of the gateway ----------------------------------------------------------------------
def upstream_app(model_dir: str) -> Any:
    """A FAKE OpenAI-compatible server (vLLM's response shape) answering with the fake engine."""
    from functools import lru_cache

    import numpy as np
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
    from rollout_ledger.shared.events import SamplingParams
    from rollout_ledger.shared.kit.chat import load_chat_tokenizer

    tok = load_chat_tokenizer(model_dir)
    engine = FakeEngine(model_dir, tokenizer=tok)
    engine.eos_id = tok.eos_token_id
    head = tuple(tok.encode("<|im_start|>assistant\n").tolist())

    @lru_cache(maxsize=65536)
    def chunk(role: str, content: str) -> tuple[int, ...]:
        return tuple(tok.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n").tolist())

    @lru_cache(maxsize=65536)
    def piece(token_id: int) -> str:
        return tok.decode([token_id])

    calls = 0

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def chat(request: Request) -> Response:
        nonlocal calls
        body = orjson.loads(await request.body())
        prompt: list[int] = []
        for m in body["messages"]:
            prompt.extend(chunk(m["role"], m.get("content") or ""))
        prompt.extend(head)
        max_tokens = int(body.get("max_tokens") or 16)
        calls += 1
        gen = await engine.generate(f"u{calls}", np.asarray(prompt, dtype=np.int32),
                                    SamplingParams(max_tokens=max_tokens), max_tokens)
        ids = gen.token_ids.tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": str(gen.finish_reason), "token_ids": ids}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": piece(i), "logprob": float(lp), "bytes": list(piece(i).encode()), "top_logprobs": []}
                for i, lp in zip(ids, gen.logprobs.tolist(), strict=True)]}
        resp = {"id": f"chatcmpl-{calls}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "policy"), "choices": [choice], "prompt_token_ids": prompt,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}
        return Response(orjson.dumps(resp), media_type="application/json")

    return Starlette(routes=[Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])])


# --- measuring ---------------------------------------------------------------------------------------------
def _latencies(folder: str) -> list[float]:
    out: list[float] = []
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                out.extend(json.loads(line))
        os.remove(os.path.join(folder, name))
    return out


def _summary(system: str, sessions: int, turns: int, wall: float, lat: list[float], cpu0: dict[str, float],
             cpu1: dict[str, float], extra: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    n = sessions * turns
    per = {k: round((cpu1[k] - cpu0[k]) * 1000 / n, 3) for k in cpu0}
    agents = per.pop("agents", 0.0)
    arr = np.array(lat, dtype=float)
    return {"system": system, "sessions": sessions, "turns_per_session": turns, "turns": n,
            "calls_timed": int(arr.size), "wall_s": round(wall, 2), "turns_per_s": round(n / wall, 1),
            "latency_ms_p50": round(float(np.percentile(arr, 50)), 2) if arr.size else None,
            "latency_ms_p99": round(float(np.percentile(arr, 99)), 2) if arr.size else None,
            "cpu_ms_per_turn": round(sum(per.values()) + agents, 3),
            "cpu_ms_per_turn_without_agents": round(sum(per.values()), 3), "cpu_ms_per_turn_agents": agents,
            "cpu_ms_per_turn_by_process": per, **extra}


# --- ours ------------------------------------------------------------------------------------------------
_TABLE_BYTES = """
with eps as (select id from episodes where batch_id = :b)
select 'trajectories' as t, coalesce(sum(pg_column_size(x.*)), 0) from trajectories x where batch_id = :b
union all select 'turns', coalesce(sum(pg_column_size(x.*)), 0) from turns x where episode_id in (select id from eps)
union all select 'steps', coalesce(sum(pg_column_size(x.*)), 0) from steps x where episode_id in (select id from eps)
union all select 'episodes', coalesce(sum(pg_column_size(x.*)), 0) from episodes x where batch_id = :b
"""
_DB_BYTES = """select coalesce(sum(pg_total_relation_size(c.oid)), 0) from pg_class c
join pg_namespace n on n.oid = c.relnamespace where n.nspname = 'public' and c.relkind in ('r', 'p', 'm')"""


def _events_bytes(monitor_port: int) -> int:
    import httpx

    info = httpx.get(f"http://127.0.0.1:{monitor_port}/jsz?streams=true", timeout=10).json()
    for account in info.get("account_details", []):
        for stream in account.get("stream_detail", []):
            if stream["name"] == "RL_EVENTS":
                return int(stream["state"]["bytes"])
    return 0


def run_ours(shapes: list[tuple[int, int]], processes: int, latency_dir: str) -> list[dict[str, Any]]:
    import psutil
    from sqlalchemy import create_engine, text

    from bench.stack_measure import all_pids, cpu_seconds, submit, wait_trajectories
    from rollout_ledger.cli.stack.devstack import DevStack
    from rollout_ledger.migrations.runner import sync_url

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"ROLLOUT_AGENTS": "bench=bench.agent_gateway:agent", "ROLLOUT_AGENT_PROCESSES": str(processes),
           "ROLLOUT_ENVS": "fixed-turns", "ROLLOUT_CONCURRENCY": "256", "ROLLOUT_MAX_INFLIGHT": "2048",
           "ROLLOUT_MAX_MODEL_LEN": "8192", "ROLLOUT_AGENT_TIMEOUT_S": "0", "ROLLOUT_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
           LATENCY_DIR_ENV: latency_dir}
    results = []
    with DevStack(scheduler_port=None, extra_env=env, echo=lambda s: None) as stack:
        assert stack.stack is not None and stack.infra.nats is not None
        engine = create_engine(sync_url(stack.infra.database_url))
        pids = all_pids(stack)
        worker = psutil.Process(pids["env-worker-0"])
        agent_pids = [c.pid for c in worker.children() if "env_worker.agents.process" in " ".join(c.cmdline())]
        assert len(agent_pids) == processes, agent_pids

        def cpu() -> dict[str, float]:
            out = cpu_seconds(pids)
            # 0 processes: the agents run in the env worker
            out["agents"] = sum(cpu_seconds({str(p): p for p in agent_pids}).values())
            out["env-worker-0"] -= out["agents"]  # its children are the agent processes
            return out

        def batch(sessions: int, turns: int) -> tuple[str, float]:
            started = time.perf_counter()
            batch_id = submit(stack, {"env": "bench", "tasks": [{"turns": turns}] * sessions, "group_size": 1,
                                      "max_turns": turns, "sampling": {"max_tokens": 16, "temperature": 1.0}})
            wait_trajectories(engine, batch_id, sessions, 0.05)
            wall = time.perf_counter() - started
            with engine.connect() as conn:
                failed = conn.execute(text("select count(*) from episodes where batch_id = :b and status <> "
                                           "'completed'"), {"b": batch_id}).scalar_one()
            assert failed == 0, f"{failed} episodes of {batch_id} did not complete"
            return batch_id, wall

        batch(8, 4)  # warm-up
        _latencies(latency_dir)
        for sessions, turns in shapes:
            with engine.connect() as conn:
                db0 = conn.execute(text(_DB_BYTES)).scalar_one()
            ev0 = _events_bytes(stack.infra.nats.monitor_port)
            cpu0 = cpu()
            batch_id, wall = batch(sessions, turns)
            cpu1 = cpu()
            with engine.connect() as conn:
                db1 = conn.execute(text(_DB_BYTES)).scalar_one()
                rows = {t: int(b) for t, b in conn.execute(text(_TABLE_BYTES), {"b": batch_id}).all()}
            ev1 = _events_bytes(stack.infra.nats.monitor_port)
            extra = {"agent_processes": processes,
                     "stored_bytes_per_session": round((db1 - db0) / sessions),
                     "row_bytes_per_session": {t: round(b / sessions) for t, b in rows.items()},
                     "row_bytes_per_session_total": round(sum(rows.values()) / sessions),
                     "event_log_bytes_per_session": round((ev1 - ev0) / sessions)}
            results.append(_summary("rollout-ledger", sessions, turns, wall, _latencies(latency_dir), cpu0, cpu1,
                                    extra))
            print(json.dumps(results[-1]), flush=True)
        engine.dispose()
    return results


# --- theirs ----------------------------------------------------------------------------------------------
def _sqlite(db: str, query: str) -> int:
    import sqlite3

    if not os.path.exists(db):  # the gateway creates it on its first call
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return int(conn.execute(query).fetchone()[0])


def _wait_healthy(port: int) -> None:
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing healthy on port {port}")


def run_gateway(shapes: list[tuple[int, int]], processes: int, latency_dir: str, root: str) -> list[dict[str, Any]]:
    """The gateway and its fake upstream as processes of their own, the agents in an ``AgentPool``."""
    import subprocess
    import sys

    from rollout_ledger.cli.stack.servers import free_port
    from rollout_ledger.shared.kit.settings import default_model_dir

    up_port, gw_port = free_port(), free_port()
    db = os.path.join(root, "gateway_traces.db")
    model = os.environ.get("ROLLOUT_MODEL") or str(default_model_dir())
    with open(os.path.join(root, "gateway.log"), "ab") as log:
        upstream = subprocess.Popen([sys.executable, "-m", "bench.agent_gateway", "--serve-upstream", str(up_port),
                                     "--model", model], stdout=log, stderr=subprocess.STDOUT)
        gateway = subprocess.Popen([sys.executable, "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port",
                                    str(gw_port), "--worker", f"http://127.0.0.1:{up_port}/v1", "--db-path", db,
                                    "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(up_port)
            _wait_healthy(gw_port)
            os.environ[LATENCY_DIR_ENV] = latency_dir  # the pool's processes inherit it
            pids = {"gateway": gateway.pid, "fake-upstream": upstream.pid}
            return asyncio.run(_drive_gateway(shapes, processes, latency_dir, gw_port, db, pids))
        finally:
            for proc in (gateway, upstream):
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def _drive_gateway(shapes: list[tuple[int, int]], processes: int, latency_dir: str, gw_port: int, db: str,
                         pids: dict[str, int]) -> list[dict[str, Any]]:
    import uuid

    from bench.stack_measure import cpu_seconds
    from rollout_ledger.services.env_worker.agents.pool import AgentPool
    from rollout_ledger.services.env_worker.agents.run import (
        AgentRun,
        RunEnd,
        RunOutcome,
        load_agent,
        run_agent,
        shared_http_client,
    )

    count, data = "select count(*) from traces", "select coalesce(sum(length(data)), 0) from traces"
    pool = await AgentPool("bench=bench.agent_gateway:agent", processes).start() if processes else None
    spec = load_agent("bench", "bench.agent_gateway:agent")
    http = shared_http_client()

    def cpu() -> dict[str, float]:
        out = cpu_seconds(pids)
        agent_pids = pool.pids() if pool is not None else [os.getpid()]  # 0: the agents run in this process
        out["agents"] = sum(cpu_seconds({str(p): p for p in agent_pids}).values())
        return out

    async def run_one(run: AgentRun) -> RunOutcome:
        return await (pool.run(run) if pool is not None else run_agent(spec, run, http))

    async def batch(sessions: int, turns: int) -> float:
        before = await asyncio.to_thread(_sqlite, db, count)
        started = time.perf_counter()
        runs = [AgentRun(agent="bench", task={"turns": turns}, api_key="unused", timeout_s=0,
                         base_url=f"http://127.0.0.1:{gw_port}/sessions/{uuid.uuid4().hex}/v1")
                for _ in range(sessions)]
        outcomes = await asyncio.gather(*(run_one(r) for r in runs))
        bad = [o for o in outcomes if o.end is not RunEnd.RETURNED]
        assert not bad, bad[0]
        # the gateway stores each call after answering it: wait until all are in its file
        while await asyncio.to_thread(_sqlite, db, count) < before + sessions * turns:  # noqa: ASYNC110 - a file
            await asyncio.sleep(0.05)
        return time.perf_counter() - started

    results = []
    try:
        await batch(8, 4)  # warm-up
        _latencies(latency_dir)
        for sessions, turns in shapes:
            size0, data0 = await asyncio.to_thread(os.path.getsize, db), await asyncio.to_thread(_sqlite, db, data)
            cpu0 = cpu()
            wall = await batch(sessions, turns)
            cpu1 = cpu()
            size1, data1 = await asyncio.to_thread(os.path.getsize, db), await asyncio.to_thread(_sqlite, db, data)
            extra = {"agent_processes": processes, "stored_bytes_per_session": round((size1 - size0) / sessions),
                     "row_bytes_per_session_total": round((data1 - data0) / sessions)}
            results.append(_summary("rllm-model-gateway", sessions, turns, wall, _latencies(latency_dir), cpu0, cpu1,
                                    extra))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if pool is not None:
            await pool.stop()
        await http.shutdown()
    return results


def serve_upstream(port: int, model: str) -> None:
    import uvicorn

    uvicorn.run(upstream_app(model), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main() -> None:
    import argparse
    import platform
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--processes", type=int, default=2,
                        help="agent processes on both sides (0: ours in the env worker, theirs in this process)")
    parser.add_argument("--only", choices=["ours", "gateway"], default=None)
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.model)
        return
    shapes = [(16, 8), (4, 50)] if args.quick else [(64, 8), (16, 50)]
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                  "platform": platform.platform()}}), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as root:
        latency_dir = os.path.join(root, "latency")
        os.makedirs(latency_dir)
        ours = [] if args.only == "gateway" else run_ours(shapes, args.processes, latency_dir)
        theirs = [] if args.only == "ours" else run_gateway(shapes, args.processes, latency_dir, root)
    for a, b in zip(ours, theirs, strict=False):
        print(json.dumps({"compare": f"{a['sessions']}x{a['turns_per_session']}",
                          "turns_per_s_ratio": round(a["turns_per_s"] / b["turns_per_s"], 2),
                          "cpu_per_turn_ratio": round(a["cpu_ms_per_turn"] / b["cpu_ms_per_turn"], 2),
                          "stored_bytes_ratio": round(a["stored_bytes_per_session"] / b["stored_bytes_per_session"], 3)
                          if b["stored_bytes_per_session"] else None}), flush=True)


if __name__ == "__main__":
    main()
