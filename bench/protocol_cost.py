"""Per-turn cost of each wire protocol of the session endpoint: the same multi-turn agent speaking Chat Completions,
the Responses API and the Anthropic Messages API, through the whole system in front of the zero-cost (FAKE) engine,
side by side in one run.

- The system: ``DevStack`` (scheduler, one env worker with ``ROLLOUT_AGENT_PROCESSES`` agent processes, inference
  worker on the FAKE engine, recorder, NATS, Postgres), the three agents below registered in the same worker.
- The agent: ``turns`` calls on one growing conversation (a system prompt, each answer sent back with a short user
  message; max 16 tokens a turn), with the SDK of its protocol (``openai`` chat and responses, ``anthropic``
  messages), each on one HTTP client per process. The Responses agent sends its whole history each call
  (``store=false``), as Codex does, so every protocol tokenises the same conversation.
- A round runs one batch of ``sessions`` episodes per protocol, in a rotating order; ``--rounds`` rounds, medians
  reported. A batch ends when every trajectory is in Postgres. CPU per turn is the CPU time of every process of the
  system (agent processes included) over the batch, divided by its turns; the ratio column is each protocol's CPU
  per turn over chat completions' in the same round (median over rounds). Target: no protocol above 1.2x.

    python -m bench.protocol_cost                 # 32 x 8, 5 rounds: the figures in docs/benchmarks.md
    python -m bench.protocol_cost --quick         # 8 x 4, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

SYSTEM = "You are a concise assistant."
PROTOCOLS = ("chat", "responses", "messages")

_http: Any = None


def _shared_http() -> Any:
    """One HTTP client per agent process for the Anthropic SDK (the OpenAI client the agents get already shares one)."""
    global _http
    if _http is None:
        import importlib

        from anthropic import DefaultAsyncHttpxClient  # the SDK's own client class (httpx or httpx2)

        base = next(c for c in DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
        module = importlib.import_module(base.__module__.split(".")[0])
        _http = DefaultAsyncHttpxClient(limits=module.Limits(max_connections=None, max_keepalive_connections=1024))
    return _http


def _user(t: int, turns: int) -> str:
    return f"Turn {t + 1} of {turns} done. Continue." if t else "Let us talk for a while. Turn 1, go."


async def chat(task: dict[str, Any], client: Any) -> float:
    """Chat Completions: the whole conversation each call."""
    turns = int(task["turns"])
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": _user(t, turns)})
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
    return 1.0


async def responses(task: dict[str, Any], client: Any) -> float:
    """The Responses API: instructions and the whole input each call (store=false)."""
    turns = int(task["turns"])
    items: list[Any] = []
    for t in range(turns):
        items.append({"role": "user", "content": _user(t, turns)})
        resp = await client.responses.create(model="policy", instructions=SYSTEM, input=items, max_output_tokens=16,
                                             store=False)
        items.append({"role": "assistant", "content": resp.output_text})
    return 1.0


async def messages(task: dict[str, Any], client: Any) -> float:
    """The Anthropic Messages API (the ``anthropic`` SDK on the session's root URL, key as x-api-key)."""
    from anthropic import AsyncAnthropic

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    anthropic = AsyncAnthropic(base_url=root, api_key=client.api_key, max_retries=0, http_client=_shared_http())
    turns = int(task["turns"])
    history: list[Any] = []
    for t in range(turns):
        history.append({"role": "user", "content": _user(t, turns)})
        resp = await anthropic.messages.create(model="policy", system=SYSTEM, messages=history, max_tokens=16)
        text = "".join(b.text for b in resp.content if b.type == "text")
        history.append({"role": "assistant", "content": text or "."})
    return 1.0


def run(sessions: int, turns: int, rounds: int, processes: int) -> list[dict[str, Any]]:
    import httpx
    import psutil
    from sqlalchemy import create_engine, text

    from bench.agent_gateway import _cpu
    from bench.pipeline import all_pids
    from rollout_ledger.cli.stack.devstack import DevStack
    from rollout_ledger.migrations.runner import sync_url

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"ROLLOUT_AGENTS": ",".join(f"{p}=bench.protocol_cost:{p}" for p in PROTOCOLS),
           "ROLLOUT_AGENT_PROCESSES": str(processes), "ROLLOUT_ENVS": "fixed-turns", "ROLLOUT_CONCURRENCY": "256",
           "ROLLOUT_MAX_INFLIGHT": "2048", "ROLLOUT_MAX_MODEL_LEN": "8192", "ROLLOUT_AGENT_TIMEOUT_S": "0",
           "ROLLOUT_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)}
    rows: list[dict[str, Any]] = []
    with DevStack(scheduler_port=None, extra_env=env, echo=lambda s: print(s, flush=True)) as stack:
        assert stack.stack is not None
        engine = create_engine(sync_url(stack.infra.database_url))
        pids = all_pids(stack)
        worker = psutil.Process(pids["env-worker-0"])
        agent_pids = [c.pid for c in worker.children() if "env_worker.agents.process" in " ".join(c.cmdline())]

        def cpu() -> float:
            return sum(_cpu(pids).values())  # the env worker's children (agent processes) included

        def batch(protocol: str, n: int, k: int) -> float:
            started = time.perf_counter()
            resp = httpx.post(f"{stack.scheduler_url}/v1/batches", timeout=120,
                              headers={"Authorization": f"Bearer {stack.api_token}"},
                              json={"env": protocol, "tasks": [{"turns": k}] * n, "group_size": 1, "max_turns": k,
                                    "sampling": {"max_tokens": 16, "temperature": 1.0}})
            resp.raise_for_status()
            batch_id = resp.json()["batch_id"]
            with engine.connect() as conn:
                q = text("select (select count(*) from trajectories where batch_id = :b) + (select count(*) from "
                         "episodes where batch_id = :b and status in ('failed', 'cancelled'))")
                while conn.execute(q, {"b": batch_id}).scalar_one() < n:
                    if time.perf_counter() - started > 600:
                        raise TimeoutError(f"{protocol}: batch {batch_id} not done in 600 s")
                    time.sleep(0.05)
                    conn.commit()
            wall = time.perf_counter() - started
            with engine.connect() as conn:
                bad = conn.execute(text("select count(*) from episodes where batch_id = :b and status <> 'completed'"),
                                   {"b": batch_id}).scalar_one()
                turns_done = conn.execute(text("select coalesce(sum(num_turns), 0) from trajectories "
                                               "where batch_id = :b"), {"b": batch_id}).scalar_one()
            if bad:
                with engine.connect() as conn:
                    why = conn.execute(text("select status, failure_reason from episodes where batch_id = :b and "
                                            "status <> 'completed' limit 3"), {"b": batch_id}).all()
                raise AssertionError(f"{bad} {protocol} episodes of {batch_id} did not complete: {why}")
            assert turns_done == n * k, f"{protocol}: {turns_done} turns recorded, expected {n * k}"
            return wall

        for protocol in PROTOCOLS:  # warm-up: imports, connections, the tokenizer's caches
            batch(protocol, 4, 2)
        for r in range(rounds):
            order = PROTOCOLS[r % 3:] + PROTOCOLS[:r % 3]
            for protocol in order:
                cpu0 = cpu()
                wall = batch(protocol, sessions, turns)
                cpu1 = cpu()
                n = sessions * turns
                rows.append({"round": r, "protocol": protocol, "turns": n, "wall_s": round(wall, 3),
                             "turns_per_s": round(n / wall, 1), "cpu_ms_per_turn": round((cpu1 - cpu0) * 1000 / n, 3)})
                print(json.dumps(rows[-1]), flush=True)
        engine.dispose()
        assert len(agent_pids) == processes, agent_pids
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per protocol, and each protocol's CPU per turn over chat's in the same round (median of ratios)."""
    out = []
    chat_cpu = {r["round"]: r["cpu_ms_per_turn"] for r in rows if r["protocol"] == "chat"}
    chat_tps = {r["round"]: r["turns_per_s"] for r in rows if r["protocol"] == "chat"}
    for protocol in PROTOCOLS:
        mine = [r for r in rows if r["protocol"] == protocol]
        out.append({
            "protocol": protocol,
            "turns_per_s": round(statistics.median(r["turns_per_s"] for r in mine), 1),
            "cpu_ms_per_turn": round(statistics.median(r["cpu_ms_per_turn"] for r in mine), 2),
            "cpu_per_turn_vs_chat": round(statistics.median(r["cpu_ms_per_turn"] / chat_cpu[r["round"]]
                                                            for r in mine), 3),
            "turns_per_s_vs_chat": round(statistics.median(r["turns_per_s"] / chat_tps[r["round"]] for r in mine), 3),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2, help="agent processes in the env worker")
    parser.add_argument("--quick", action="store_true", help="8 x 4, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.rounds = 8, 4, 2
    rows = run(args.sessions, args.turns, args.rounds, args.processes)
    summary = summarize(rows)
    print(json.dumps({"sessions": args.sessions, "turns": args.turns, "rounds": args.rounds,
                      "agent_processes": args.processes, "summary": summary}, indent=1))
    worst = max(s["cpu_per_turn_vs_chat"] for s in summary)
    print(f"target: no protocol above 1.2x chat completions' CPU per turn; worst {worst:.2f}x "
          f"({'met' if worst <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
