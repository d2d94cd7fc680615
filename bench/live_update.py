"""Live policy updates against restarting: how long until the worker serves the new version, and how much
generation is lost meanwhile (issue 15's benchmark).

One inference worker (vLLM on the CPU with SmolLM2-135M by default; ``--engine fake`` for a quick run) under a
steady load: ``--streams`` concurrent requesters, each sending one turn request after another (a ~200-token prompt,
``--max-tokens`` new tokens, temperature 1) over core NATS, as env workers do, and sending it again at once when it
fails (no worker answers, or an error reply). Private NATS + Postgres and the scheduler (which announces versions)
run beside it. Then, one after another on the same worker and load:

- ``drain``: ``POST /v1/policy/versions`` (mode drain): the worker finishes the turns in flight, loads the new
  checkpoint into the running engine and serves it;
- ``abort``: the same in mode abort (turns in flight are cut and generated again on the new weights);
- ``restart``: what users do today: SIGTERM the worker and start a new one on the new checkpoint
  (``ROLLOUT_MODEL``, ``ROLLOUT_WEIGHT_VERSION``).

For each: **time to serving** (from the update's start to the first reply generated with the new version) and
**generation lost**: the tokens the steady rate (measured over the ``--steady`` seconds before) would have produced
from the update's start to ``--settle`` seconds after time to serving, minus the tokens generated in that window.
Target: a live update loses at most 1/5 of what a restart loses.

    python -m bench.live_update                     # vLLM on the CPU (3-5 minutes)
    python -m bench.live_update --engine fake       # the fake engine (seconds; checks the mechanics only)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.shared.events import InferenceRequested, SamplingParams, TurnGenerated, decode_as, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from rollout_ledger.shared.kit.settings import default_model_dir
from rollout_ledger.shared.subjects import ERROR_HEADER, INFER_ANY


@dataclass
class Load:
    """Steady requesters; every reply's (time, tokens, version) kept."""

    nc: bus.NATS
    prompt: np.ndarray
    max_tokens: int
    replies: list[tuple[float, int, int]] = field(default_factory=list)
    failures: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def stream(self, index: int) -> None:
        sampling = SamplingParams(temperature=1.0, max_tokens=self.max_tokens)
        n = 0
        while not self.stop.is_set():
            n += 1
            rid = f"bench.{index}.{n}:{uuid.uuid4().hex[:6]}"
            request = InferenceRequested(event_id=rid, request_id=rid, episode_id=f"bench.{index}.{n}",
                                         batch_id="bench", attempt=1, seq=1, produced_by="bench/live-update",
                                         turn_index=0, prompt_token_ids=self.prompt, sampling=sampling,
                                         max_tokens=self.max_tokens, reply_seq=1)
            try:
                msg = await self.nc.request(INFER_ANY, encode(request), timeout=120)
            except Exception:  # no responders (restarting), timeout: send it again, as an env worker would
                self.failures += 1
                await asyncio.sleep(0.05)
                continue
            if msg.headers and msg.headers.get(ERROR_HEADER):
                self.failures += 1
                await asyncio.sleep(0.05)
                continue
            turn = decode_as(msg.data, TurnGenerated)
            self.replies.append((time.monotonic(), int(turn.token_ids.shape[0]), turn.weight_version))

    def tokens(self, start: float, end: float) -> int:
        return sum(n for t, n, _ in self.replies if start <= t < end)

    def first_reply_of(self, version: int, after: float) -> float | None:
        return next((t for t, _, v in self.replies if v == version and t >= after), None)


def copy_checkpoint(model_dir: str, out: Path) -> Path:
    """A copy of the model directory (a trainer's checkpoint of unchanged shapes)."""
    shutil.copytree(model_dir, out)
    return out


async def measure(load: Load, way: str, version: int, start_update: object, steady_s: float,
                  settle_s: float, timeout_s: float) -> dict[str, object]:
    t_steady = time.monotonic()
    await asyncio.sleep(steady_s)
    began = time.monotonic()
    rate = load.tokens(t_steady, began) / (began - t_steady)
    failures_before = load.failures
    await start_update()  # type: ignore[operator]
    deadline = began + timeout_s
    served = None
    while served is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        served = load.first_reply_of(version, began)
    if served is None:
        raise RuntimeError(f"{way}: version {version} not served within {timeout_s}s")
    await asyncio.sleep(settle_s)
    end = served + settle_s
    produced = load.tokens(began, end)
    expected = rate * (end - began)
    return {"way": way, "version": version, "steady_tokens_per_s": round(rate, 1),
            "time_to_serving_s": round(served - began, 2), "window_s": round(end - began, 2),
            "tokens_expected": round(expected), "tokens_produced": produced,
            "tokens_lost": round(max(0.0, expected - produced)), "failed_requests": load.failures - failures_before}


async def run(args: argparse.Namespace) -> list[dict[str, object]]:
    model_dir = str(default_model_dir())
    tok = load_chat_tokenizer(model_dir)
    context = " ".join(f"Note {i}: the weather was mild and the market was busy." for i in range(14))
    prompt = tok.encode(tok.render([{"role": "system", "content": context},
                                    {"role": "user", "content": "Tell me a short story about a lighthouse."}],
                                   add_generation_prompt=True))
    work = Path(tempfile.mkdtemp(prefix="rl-live-update-"))
    infra = LocalInfra()
    infra.start()
    results: list[dict[str, object]] = []
    try:
        upgrade(infra.database_url)
        env = {"ROLLOUT_MODEL": model_dir, "ROLLOUT_LOG_LEVEL": "WARNING", "ROLLOUT_ENGINE": args.engine,
               "ROLLOUT_POLICY_REPORT_S": "2", "ROLLOUT_FAKE_TOKENS_PER_S": "400", "ROLLOUT_FAKE_LOAD_S": "2"}
        with Stack(infra.nats_url, infra.database_url, infra.root / "logs", env=env) as stack:
            url = stack.start("scheduler").url
            worker: ServiceProcess = stack.start("inference-worker", name="inf", wait=False)
            worker.wait_ready(timeout_s=600)
            nc = await bus.connect(infra.nats_url, name="bench-live-update")
            load = Load(nc, prompt, args.max_tokens)
            streams = [asyncio.create_task(load.stream(i)) for i in range(args.streams)]
            await asyncio.sleep(args.warmup)
            for version, mode in ((1, "drain"), (2, "abort")):
                ckpt = copy_checkpoint(model_dir, work / f"v{version}")

                async def announce(v: int = version, m: str = mode, c: Path = ckpt) -> None:
                    async with httpx.AsyncClient(timeout=30) as client:
                        r = await client.post(f"{url}/v1/policy/versions",
                                              json={"version": v, "checkpoint": str(c), "mode": m})
                    r.raise_for_status()

                results.append(await measure(load, mode, version, announce, args.steady, args.settle, 600))
                print(json.dumps(results[-1]), flush=True)
            ckpt = copy_checkpoint(model_dir, work / "v3")
            holder: dict[str, ServiceProcess] = {"worker": worker}

            async def restart() -> None:
                old = holder["worker"]
                await asyncio.to_thread(old.stop)
                holder["worker"] = stack.start("inference-worker", name="inf-restarted", wait=False,
                                               ROLLOUT_MODEL=str(ckpt), ROLLOUT_WEIGHT_VERSION="3")

            # the restarted worker must not load the announced versions: it starts on version 3, above them
            results.append(await measure(load, "restart", 3, restart, args.steady, args.settle, 900))
            print(json.dumps(results[-1]), flush=True)
            load.stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
            await nc.close()
    finally:
        infra.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    ap.add_argument("--streams", type=int, default=8, help="concurrent requesters")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first measurement")
    ap.add_argument("--steady", type=float, default=15.0, help="seconds the steady rate is measured over")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after time to serving in the window")
    args = ap.parse_args()
    results = asyncio.run(run(args))
    restart = next(r for r in results if r["way"] == "restart")
    lost_restart = max(1, int(restart["tokens_lost"]))  # type: ignore[call-overload]
    print(f"{'way':<8} {'to serving s':>12} {'window s':>9} {'tok/s steady':>12} {'lost tokens':>11} "
          f"{'lost / restart':>14} {'failed req':>10}")
    for r in results:
        lost = int(r["tokens_lost"])  # type: ignore[call-overload]
        print(f"{r['way']:<8} {r['time_to_serving_s']:>12} {r['window_s']:>9} {r['steady_tokens_per_s']:>12} "
              f"{lost:>11} {lost / lost_restart:>14.3f} {r['failed_requests']:>10}")
    print("target: a live update loses at most 1/5 of what a restart loses", file=sys.stderr)


if __name__ == "__main__":
    main()
