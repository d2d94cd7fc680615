"""Engine efficiency: the whole system versus the same requests straight into the same vLLM engine, and memory.

Issue-3 benchmarks (a) and (c), side by side in one run:

1. **System**: private NATS + Postgres, the scheduler, one env worker, the recorder and one inference worker on
   vLLM (the real model). One batch of multi-turn episodes (``fixed-turns``: every turn is answered by a user
   message, so each episode runs exactly ``--turns`` turns; each episode writes about its own topic) is
   submitted over REST; the clock runs from the POST
   to the moment every trajectory is stored in Postgres. The inference worker's process tree (the worker and
   vLLM's engine-core process) is sampled for memory while it runs.
2. **Engine alone**: a fresh Python process that imports vLLM and nothing of ours starts ``AsyncLLM`` with the
   inference worker's engine arguments (``engine_kwargs``, the same CPU defaults and warm-up) and replays the
   system's requests exactly: every episode's turn contexts (read back from the stored trajectories), the same
   sampling parameters, all episodes at once and each episode's turns one after another, and every
   turn forced to the length the system generated (``min_tokens = max_tokens = n``) so both do the same work.
   Its process tree is sampled the same way.

Reported: generated tokens/s of both and their ratio (target >= 0.95), and the inference worker's memory over
the bare engine's (RSS and PSS of the process trees, peak; target <= 200 MB).

    python -m bench.engine_efficiency                      # 32 episodes x 4 turns x 64 tokens
    python -m bench.engine_efficiency --episodes 8 --turns 2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
TOPICS = ("the sea", "mountains", "a city at night", "bread", "rain", "old books", "trains", "a garden",
          "winter", "music", "the moon", "a market", "bees", "a river", "clocks", "a lighthouse")


class TreeMemory:
    """Peak RSS and PSS (MiB) of a process and its children, sampled every ``interval_s`` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss = 0.0
        self.peak_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, float]:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0, 0.0
        rss = pss = 0.0
        for p in procs:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        return rss / 2**20, pss / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self.sample()
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, float]:
        return {"peak_rss_mib": round(self.peak_rss, 1), "peak_pss_mib": round(self.peak_pss, 1)}


# --- 1. the system ---------------------------------------------------------------------------------------------


def cpu_seconds_by_process() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process below this one, keyed by a short name."""
    out: dict[str, float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        name = p.name()
        if "serve" in cmd:
            name = cmd[cmd.index("serve") + 1] if cmd.index("serve") + 1 < len(cmd) else name
        out[f"{name}:{p.pid}"] = t.user + t.system
    return out


def run_system(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the batch through the whole system; return its figures and the requests to replay."""
    import httpx
    from sqlalchemy import create_engine, text

    from rollout_ledger.cli.stack.devstack import DevStack
    from rollout_ledger.migrations.runner import sync_url

    env = {"ROLLOUT_VLLM_MAX_MODEL_LEN": str(args.max_model_len), "ROLLOUT_MAX_MODEL_LEN": str(args.max_model_len)}
    with DevStack(scheduler_port=None, engine="vllm", echo=lambda m: print(m, file=sys.stderr),
                  extra_env=env) as stack:
        assert stack.stack is not None
        worker = next(p for p in stack.stack.procs if p.service == "inference-worker")
        assert worker.proc is not None
        http = httpx.Client(base_url=stack.scheduler_url, timeout=30,
                            headers={"Authorization": f"Bearer {stack.api_token}"})
        tasks = [{"turns": args.turns, "topic": TOPICS[i % len(TOPICS)]} for i in range(args.episodes)]
        body = {"env": "fixed-turns", "tasks": tasks, "group_size": 1, "max_turns": args.turns,
                "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens}}
        cpu_before = cpu_seconds_by_process()
        with TreeMemory(worker.proc.pid) as memory:
            submitted_at = time.time()
            resp = http.post("/v1/batches", json=body)
            resp.raise_for_status()
            batch_id = resp.json()["batch_id"]
            while not http.get(f"/v1/batches/{batch_id}").json()["done"]:
                time.sleep(1.0)  # polling costs scheduler and Postgres CPU that the engine would miss
        cpu_after = cpu_seconds_by_process()
        cpu: dict[str, float] = {}
        for key, after in cpu_after.items():
            name = key.split(":")[0]
            cpu[name] = round(cpu.get(name, 0.0) + after - cpu_before.get(key, 0.0), 2)
        engine = create_engine(sync_url(stack.infra.database_url))
        worker_log = worker.tail_log(60)
        keep = Path(tempfile.gettempdir()) / "engine_efficiency_inference_worker.log"
        keep.write_text(worker.log_path.read_text(errors="replace"))
        with engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(text(
                "select t.episode_id, t.status, t.token_ids, t.action_ranges, t.segments, t.num_sampled_tokens, "
                "e.failure_reason from trajectories t join episodes e on e.id = t.episode_id "
                "where t.batch_id = :b order by t.episode_id"), {"b": batch_id})]
            timing = conn.execute(text(
                "with t as (select t.episode_id, t.turn_index, t.produced_at, t.produced_at - make_interval("
                "secs => (t.generate_ms + t.queue_ms) / 1000.0) as began from turns t join episodes e "
                "on e.id = t.episode_id where e.batch_id = :b and not t.superseded) "
                "select extract(epoch from max(produced_at) - min(began)) as window_s, "
                "(select avg(extract(epoch from n.began - p.produced_at)) * 1000 from t p join t n on "
                "n.episode_id = p.episode_id and n.turn_index = p.turn_index + 1) as gap_ms, "
                "extract(epoch from min(began)) as first_began, extract(epoch from max(produced_at)) as last_done, "
                "(select extract(epoch from max(created_at)) from trajectories where batch_id = :b) as stored "
                "from t"), {"b": batch_id}).one()
            cached, prompt = conn.execute(text(
                "select coalesce(sum(t.cached_tokens), 0), sum(t.prompt_len) from turns t join episodes e "
                "on e.id = t.episode_id where e.batch_id = :b and not t.superseded"), {"b": batch_id}).one()
        engine.dispose()
    if len(rows) != args.episodes or any(r["status"] == "failed" for r in rows):
        print(f"inference worker log (tail; all of it in {keep}):\n{worker_log}", file=sys.stderr)
        raise SystemExit(f"the system run did not store {args.episodes} good trajectories: "
                         f"{[(r['episode_id'], r['status'], r['failure_reason']) for r in rows][:4]}")
    requests = []
    for r in rows:
        ids = list(r["token_ids"])
        starts = [int(s) for s, _ in r["segments"]]
        turns = []
        for a, b in r["action_ranges"]:
            seg = max(s for s in starts if s <= a)
            turns.append({"context": ids[seg:a], "generate": int(b) - int(a)})
        requests.append({"episode_id": r["episode_id"], "turns": turns})
    tokens = sum(int(r["num_sampled_tokens"]) for r in rows)
    # From the POST to the last trajectory stored (Postgres clock, same machine), not to the last poll.
    wall = float(timing.stored) - submitted_at
    done_at = float(timing.stored)
    return {
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "prefix_cache_hit": round(float(cached) / float(prompt), 3) if prompt else None,
        "engine_window_s": round(float(timing.window_s), 3),
        "tokens_per_s_in_engine_window": round(tokens / float(timing.window_s), 1),
        "before_first_turn_s": round(float(timing.first_began) - submitted_at, 3),
        "after_last_turn_s": round(done_at - float(timing.last_done), 3),
        "mean_gap_between_turns_ms": round(float(timing.gap_ms), 1),
        "cpu_seconds_by_process": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
        "inference_worker_memory": memory.report(),
    }, requests


# --- 2. the engine alone (a separate process: vLLM and nothing of ours) -------------------------------------------


def run_direct(args: argparse.Namespace, requests: list[dict[str, Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "requests.json"
        out = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"requests": requests, "model": args.model, "max_model_len": args.max_model_len,
                                    "temperature": args.temperature}))
        proc = subprocess.Popen([sys.executable, "-m", "bench.engine_efficiency", "--replay", str(spec),
                                 "--out", str(out)], cwd=HERE.parent, stdout=sys.stderr)
        with TreeMemory(proc.pid) as memory:
            code = proc.wait()
        if code != 0:
            raise SystemExit(f"the engine-alone replay failed with exit code {code}")
        result: dict[str, Any] = json.loads(out.read_text())
    result["engine_memory"] = memory.report()
    return result


def replay(spec_path: Path, out_path: Path) -> None:
    """In the child: start the engine as the inference worker does, replay the requests, write the figures."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from bench.engine_direct import engine_args_for, start_engine

    spec = json.loads(spec_path.read_text())
    engine_args = engine_args_for(spec["model"], vllm_max_model_len=spec["max_model_len"])

    async def run() -> dict[str, Any]:
        llm, start_s = await start_engine(engine_args)
        generated = 0

        async def episode(index: int, req: dict[str, Any]) -> None:
            nonlocal generated
            for t, turn in enumerate(req["turns"]):
                n = int(turn["generate"])
                params = vllm.SamplingParams(temperature=spec["temperature"], max_tokens=n,
                                             min_tokens=n, logprobs=1, detokenize=False,
                                             output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY)
                last = None
                async for out in llm.generate(TokensPrompt(prompt_token_ids=turn["context"]), params,
                                              f"{index}-{t}"):
                    last = out
                generated += len(last.outputs[0].token_ids) if last is not None else 0

        try:
            began = time.perf_counter()
            await asyncio.gather(*(episode(i, r) for i, r in enumerate(spec["requests"])))
            wall = time.perf_counter() - began
        finally:
            llm.shutdown()
        return {"engine": f"vllm {vllm.__version__} on {current_platform.device_type}",
                "engine_start_s": round(start_s, 2), "generated_tokens": generated, "wall_s": round(wall, 3),
                "tokens_per_s": round(generated / wall, 1)}

    out_path.write_text(json.dumps(asyncio.run(run())))


def main() -> None:
    from rollout_ledger.shared.kit.settings import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--replay", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay is not None:
        replay(args.replay, args.out)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    system, requests = run_system(args)
    direct = run_direct(args, requests)
    if direct["generated_tokens"] != system["generated_tokens"]:
        raise SystemExit(f"replay generated {direct['generated_tokens']} tokens, the system "
                         f"{system['generated_tokens']}: not the same work")
    worker = system["inference_worker_memory"]
    bare = direct["engine_memory"]
    print(json.dumps({
        "benchmark": "engine_efficiency",
        "workload": {"episodes": args.episodes, "turns": args.turns, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "env": "fixed-turns (a topic per episode)"},
        "system": system,
        "engine_alone": direct,
        "tokens_per_s_ratio": round(system["tokens_per_s"] / direct["tokens_per_s"], 3),
        "worker_memory_over_engine_mib": {
            "rss": round(worker["peak_rss_mib"] - bare["peak_rss_mib"], 1),
            "pss": round(worker["peak_pss_mib"] - bare["peak_pss_mib"], 1),
        },
    }, indent=2))


if __name__ == "__main__":
    main()
