"""Tracing cost per turn: the same workload with tracing off and on, side by side in one run.

Two measurements:

1. ``micro``: in one process, the tracing work one turn adds in each service (env worker: the turn and env-step
   spans, trace headers on the request and the step event; inference worker: extract, the generation span, headers
   on the turn event; recorder: extract on both events and its share of one ``recorder.write`` span per episode per
   batch), with the real SDK, ``BatchSpanProcessor`` and OTLP/HTTP exporter into a local receiver. Process CPU
   (export thread included) per turn, tracing off vs on.
2. ``pipeline``: ``bench.pipeline``'s workload (``fixed-turns`` episodes through every service, the fake engine,
   every event in Postgres) on a fresh stack with tracing off, on (spans to a local OTLP receiver in this process,
   every episode traced) and on with 1% of episodes sampled, alternated ``--rounds`` times: turns/s, the per-turn
   cycle time and CPU ms per turn per process.

Usage: ``python -m bench.tracing_cost`` (in ``make bench``; the figures and the command go to docs/benchmarks.md),
``--quick`` for a smaller run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np

from rollout_ledger.cli.stack.otlp_sink import OtlpSink
from rollout_ledger.shared.kit.tracing import SpanKind, Tracing, traces_endpoint
from rollout_ledger.shared.subjects import MSG_ID_HEADER

EVENTS_PER_BATCH_PER_EPISODE = 2
"""Recorder: events of one episode in one fetched batch, at the least (a turn and its step): one ``recorder.write``
span per episode per batch is charged to every two events (the worst case; bigger batches share it wider)."""


def _turn(tracing: Tracing, t: int) -> None:
    """The tracing work of one turn in the three services that see it (no I/O: only what tracing adds)."""
    # env worker: inside the attempt's span, the turn span, its request headers, the env step span, the step event
    with tracing.span("turn", attributes={"rollout.turn_index": t, "rollout.prompt_tokens": 100,
                                          "gen_ai.request.max_tokens": 16}) as span:
        request_headers: dict[str, str] | None = tracing.inject({}) if tracing.enabled else None
        if span is not None:
            span.set_attributes({"rollout.inference_worker": "w", "gen_ai.usage.output_tokens": 16})
    with tracing.span("env.step", attributes={"rollout.turn_index": t}):
        pass
    step_headers = tracing.inject({MSG_ID_HEADER: f"ep:a1:s{t}"})
    # inference worker: the request's context, the generation span, the turn event's headers
    parent = tracing.extract(request_headers)
    if parent is not None:
        with tracing.span("generation", parent=parent, kind=SpanKind.SERVER, attributes={
                "rollout.request_id": "r", "rollout.episode_id": "ep", "rollout.turn_index": t,
                "rollout.worker_id": "w", "gen_ai.system": "fake", "gen_ai.request.max_tokens": 16,
                "gen_ai.usage.input_tokens": 100}):
            turn_headers = tracing.inject({MSG_ID_HEADER: f"ep:a1:t{t}:r1"})
    else:
        turn_headers = {MSG_ID_HEADER: f"ep:a1:t{t}:r1"}
    # recorder: both events' contexts, and one write span per episode and batch
    tracing.extract(turn_headers)
    recorder_parent = tracing.extract(step_headers)
    if recorder_parent is not None:
        tracing.record("recorder.write", parent=recorder_parent, start_ns=time.time_ns(), attributes={
            "rollout.episode_id": "ep", "rollout.events": 2, "rollout.event_types": ["step.completed"],
            "rollout.batch_size": 500, "messaging.delivery_count": 1, "rollout.ack": 2})


class SinkProcess:
    """An OTLP receiver in a process of its own (``python -m rollout_ledger.cli.stack.otlp_sink``), so that its
    decoding is not counted as the traced process's CPU."""

    def __enter__(self) -> SinkProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "rollout_ledger.cli.stack.otlp_sink"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()
        return self

    def spans(self) -> int:
        return int(httpx.get(f"{self.endpoint}/stats", timeout=10).json()["spans"])

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


MICRO_MODES: dict[str, float | None] = {"off": None, "on": 1.0, "on, 1% sampled": 0.01}
"""Tracing off; on with every episode traced; on with one episode in a hundred traced (``tracing_sample_ratio``)."""


def micro(turns: int, rounds: int = 2) -> dict[str, Any]:
    """CPU µs per turn of the tracing work in each mode (on: exported by the SDK's batch processor to a receiver in
    another process; its queue made large enough that no span is dropped, so every span's export is counted)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(turns * 8)
    episode_turns = 16
    n = (turns // episode_turns) * episode_turns
    out: dict[str, Any] = {"turns": n}
    with SinkProcess() as sink:
        for _ in range(rounds):
            for mode, ratio in MICRO_MODES.items():
                tracing = Tracing.off() if ratio is None else Tracing.with_exporter(
                    "bench", OTLPSpanExporter(endpoint=traces_endpoint(sink.endpoint)), sample_ratio=ratio)
                received = sink.spans()
                cpu0 = time.process_time()
                for ep in range(n // episode_turns):
                    with tracing.span("episode", attributes={"rollout.episode_id": f"ep{ep}"}):
                        tracing.inject({MSG_ID_HEADER: f"ep{ep}:a1:started"})
                        for t in range(episode_turns):
                            _turn(tracing, t)
                tracing.shutdown(timeout_s=120)  # the export of every span is part of the cost
                cpu_us = (time.process_time() - cpu0) / n * 1e6
                row = out.setdefault(mode, {})
                row["cpu_us_per_turn"] = round(min(row.get("cpu_us_per_turn", float("inf")), cpu_us), 2)
                row["spans_exported_per_turn"] = round((sink.spans() - received) / n, 2)
    del os.environ["OTEL_BSP_MAX_QUEUE_SIZE"]  # the services of the pipeline run keep the SDK's default
    return out


def pipeline(episodes: int, turns: int, rounds: int, concurrency: int) -> list[dict[str, Any]]:
    """The pipeline benchmark's workload on a fresh stack per mode, tracing off then on, ``rounds`` times."""
    from bench.pipeline import run_pipeline
    from rollout_ledger.cli.stack.devstack import DevStack

    rows: list[dict[str, Any]] = []
    # spans exported every 0.5 s (the SDK's default is 5 s): the export of what a run made falls inside its CPU window
    base = {"ROLLOUT_CONCURRENCY": str(concurrency), "ROLLOUT_LOG_LEVEL": "WARNING", "ROLLOUT_MAX_INFLIGHT": "2048",
            "OTEL_BSP_SCHEDULE_DELAY": "500"}
    with OtlpSink(max_spans=0) as sink:  # counts only
        for _ in range(rounds):
            for mode, ratio in MICRO_MODES.items():
                env = dict(base)
                env["ROLLOUT_TRACING_ENDPOINT"] = sink.endpoint if ratio is not None else ""
                env["ROLLOUT_TRACING_SAMPLE_RATIO"] = str(ratio or 1.0)
                with DevStack(scheduler_port=None, extra_env=env, echo=lambda s: None) as stack:
                    run_pipeline(stack, 100, 2)  # warm-up
                    before = sink.received
                    result = run_pipeline(stack, episodes, turns)
                    time.sleep(2.0)  # what the run made has been exported
                    spans = sink.received - before
                row = {"run": "pipeline", "tracing": mode, **result,
                       "spans_per_turn": round(spans / max(1, result["turns"]), 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each mode over the rounds (and its ratio to off)."""
    def median(mode: str, value: Any) -> float:
        return float(np.median([value(r) for r in rows if r["tracing"] == mode]))

    out: dict[str, Any] = {"run": "summary"}
    for key in ("turns_per_s", "turn_cycle_ms_p50", "turn_cycle_ms_p99"):
        off = median("off", lambda r, k=key: r[k])
        out[key] = {mode: {"value": round(median(mode, lambda r, k=key: r[k]), 1),
                           "vs_off": round(median(mode, lambda r, k=key: r[k]) / off, 3)} for mode in MICRO_MODES}
    out["cpu_ms_per_turn_all_processes"] = {
        mode: round(median(mode, lambda r: sum(r["cpu_ms_per_turn"].values())), 3) for mode in MICRO_MODES}
    out["cpu_ms_per_turn"] = {name: {
        mode: round(median(mode, lambda r, n=name: r["cpu_ms_per_turn"][n]), 3) for mode in MICRO_MODES}
        for name in rows[0]["cpu_ms_per_turn"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs of the pipeline run")
    parser.add_argument("--concurrency", type=int, default=500, help="episodes in flight per env worker")
    args = parser.parse_args()
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                  "platform": platform.platform()}}), flush=True)
    print(json.dumps({"run": "micro", **micro(4_000 if args.quick else 32_000)}), flush=True)
    episodes, turns = (125, 16) if args.quick else (500, 16)
    rows = pipeline(episodes, turns, 1 if args.quick else args.rounds, args.concurrency)
    print(json.dumps(summary(rows)), flush=True)


if __name__ == "__main__":
    main()
