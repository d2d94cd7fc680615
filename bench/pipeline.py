"""Pipeline benchmark: N episodes x T turns through every service with the fake engine, every event persisted.

Side by side in one run with its baseline (bench/baseline_openrlhf.py, the single-process design of OpenRLHF's
agent executor with the same zero-cost engine and tokenizer). Reports turns/s, the per-turn latency the system
adds (with a zero-cost engine all of a turn's cycle time is added latency), recorder lag, and RSS per service
(peak, and growth over a long soak run). Usage:

    python bench/pipeline.py                 # the figures in docs/benchmarks.md
    python bench/pipeline.py --quick         # a smaller run
    python -m bench.pipeline --baseline-only --turns 16,30   # the baseline alone at 16 and 30 turns per episode
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
from sqlalchemy import create_engine, text

from bench.stack_measure import all_pids, cpu_seconds, submit, wait_trajectories
from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url


@dataclass
class RssSampler:
    """Samples the RSS of every service process every ``interval_s``."""

    pids: dict[str, int]
    interval_s: float = 0.5
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        procs = {name: psutil.Process(pid) for name, pid in self.pids.items()}
        t0 = time.monotonic()
        while not self._stop.is_set():
            for name, proc in procs.items():
                with contextlib.suppress(psutil.Error):
                    self.series.setdefault(name, []).append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def deciles(self) -> dict[str, list[float]]:
        """RSS at 10%, 20%, ... 100% of the run, per process."""
        out = {}
        for name, s in self.series.items():
            end_t = s[-1][0]
            out[name] = [round(next(v for t, v in s if t >= end_t * k / 10), 1) for k in range(1, 11)]
        return out

    def peak(self) -> dict[str, float]:
        return {name: round(max(v for _, v in s), 1) for name, s in self.series.items()}

    def growth(self, warm_fraction: float = 0.1) -> dict[str, float]:
        """RSS at the end over RSS once ``warm_fraction`` of the run is done, in percent."""
        out = {}
        for name, s in self.series.items():
            end_t = s[-1][0]
            warm = next(v for t, v in s if t >= end_t * warm_fraction)
            tail = max(v for t, v in s if t >= end_t * 0.9)
            out[name] = round((tail / warm - 1) * 100, 1)
        return out


def run_pipeline(stack: DevStack, episodes: int, turns: int, max_tokens: int = 16) -> dict[str, Any]:
    engine = create_engine(sync_url(stack.infra.database_url))
    pids = all_pids(stack)
    cpu0 = cpu_seconds(pids)
    tasks = [{"turns": turns}] * episodes
    t0 = time.perf_counter()
    batch_id = submit(stack, {"env": "fixed-turns", "tasks": tasks, "group_size": 1, "max_turns": turns,
                              "sampling": {"max_tokens": max_tokens, "temperature": 1.0}})
    wait_trajectories(engine, batch_id, episodes, 0.2)
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(pids)
    with engine.connect() as conn:
        # cycle time of each turn after the first: step(t) - step(t-1) of the same attempt (all system overhead)
        lat = conn.execute(text("""
            select extract(epoch from s.produced_at - lag(s.produced_at) over w) * 1000 as ms
            from steps s join episodes e on e.id = s.episode_id
            where e.batch_id = :b and not s.superseded
            window w as (partition by s.episode_id, s.attempt order by s.turn_index)"""), {"b": batch_id}).all()
        lag = conn.execute(text("""
            select extract(epoch from t.recorded_at - t.produced_at) * 1000 from turns t
            join episodes e on e.id = t.episode_id where e.batch_id = :b"""), {"b": batch_id}).all()
        n_turns = conn.execute(text("select count(*) from turns t join episodes e on e.id = t.episode_id "
                                    "where e.batch_id = :b"), {"b": batch_id}).scalar_one()
    engine.dispose()
    cycle = np.array([r[0] for r in lat if r[0] is not None], dtype=float)
    lags = np.array([r[0] for r in lag], dtype=float)
    out: dict[str, Any] = {"episodes": episodes, "turns_per_episode": turns, "turns": int(n_turns),
                           "wall_s": round(wall, 2), "turns_per_s": round(n_turns / wall, 1)}
    if cycle.size:
        out["turn_cycle_ms_p50"] = round(float(np.percentile(cycle, 50)), 1)
        out["turn_cycle_ms_p99"] = round(float(np.percentile(cycle, 99)), 1)
    out["cpu_ms_per_turn"] = {k: round((cpu1[k] - cpu0[k]) * 1000 / max(n_turns, 1), 3) for k in pids}
    out["recorder_lag_ms_p50"] = round(float(np.percentile(lags, 50)), 1)
    out["recorder_lag_ms_p99"] = round(float(np.percentile(lags, 99)), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, default=500, help="episodes in flight per env worker")
    parser.add_argument("--soak-turns", type=int, default=100_000)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--soak-only", action="store_true")
    parser.add_argument("--baseline-only", action="store_true", help="no stack: the baseline alone")
    parser.add_argument("--turns", type=positive_ints, default=None,
                        help="turns per episode of each run, comma-separated (default 1,4,16,64; --quick 1,4,16)")
    args = parser.parse_args()
    total = 2000 if args.quick else 6000
    shapes = args.turns or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                  "platform": platform.platform()}}))
    env = {"ROLLOUT_CONCURRENCY": str(args.concurrency), "ROLLOUT_LOG_LEVEL": "WARNING",
           "ROLLOUT_MAX_INFLIGHT": "2048"}
    if not args.baseline_only:
        with DevStack(scheduler_port=None, extra_env=env, echo=lambda s: None) as stack:
            _run_stack(stack, args.soak_only, 20_000 if args.quick else args.soak_turns, args.concurrency, total,
                       shapes)
    if not args.skip_baseline:
        from bench.baseline_openrlhf import run as baseline
        from rollout_ledger.shared.kit.settings import default_model_dir

        for t in shapes:
            res = asyncio.run(baseline(str(default_model_dir()), max(1, total // t), t))
            print(json.dumps({"run": "baseline", **res}), flush=True)


def positive_ints(value: str) -> list[int]:
    """An argparse type: a comma-separated list of integers, each >= 1 (``--turns 16,30``)."""
    try:
        out = [int(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {value!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {value!r}")
    return out


def _run_stack(stack: DevStack, soak_only: bool, soak_turns: int, in_flight: int, total: int,
               shapes: list[int]) -> None:
    """The pipeline runs of each shape, then the soak with its RSS samples."""
    assert stack.stack is not None
    pids = {p.name: p.proc.pid for p in stack.stack.procs if p.proc is not None}
    run_pipeline(stack, 200, 2)  # warm-up
    for t in [] if soak_only else shapes:
        print(json.dumps({"run": "pipeline", **run_pipeline(stack, max(1, total // t), t)}), flush=True)
    sampler = RssSampler(pids).start()
    soak = run_pipeline(stack, soak_turns // 50, 50)
    sampler.stop()
    print(json.dumps({"run": "soak", **soak, "in_flight": in_flight, "rss_peak_mb": sampler.peak(),
                      "rss_growth_pct": sampler.growth(), "rss_deciles_mb": sampler.deciles()}), flush=True)


if __name__ == "__main__":
    main()
