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
- ``keep``: the same in mode keep (turns in flight are cut, keep the ids they had sampled and continue after them on
  the new weights: nothing sampled is thrown away);
- ``restart``: what users do today: SIGTERM the worker and start a new one on the new checkpoint
  (``ROLLOUT_MODEL``, ``ROLLOUT_WEIGHT_VERSION``).

For each: **time to serving** (from the update's start to the first reply generated with the new version) and
**generation lost**: the tokens the steady rate (measured over the ``--steady`` seconds before) would have produced
from the update's start to ``--settle`` seconds after time to serving, minus the tokens generated in that window.
Target: a live update loses at most 1/5 of what a restart loses. Each live update also reports, from the
worker's ``rollout_swap_tokens_total``, the sampled ids it **discarded** (cut and generated again: ``abort``) and
those it **kept** across the swap (``keep``); target (issue 25): ``keep`` discards nothing and aborts no turn.

``--workload episodes`` drives the worker with multi-turn episodes instead: an env worker (``--streams`` episodes at
once) runs ``fixed-turns`` episodes of ``--turns`` turns from batches the scheduler keeps feeding, and the tokens
are counted from the ``turn.generated`` events on the bus. A ``drain`` update is then an episode-level drain (the
env worker starts no new episode until the new version serves; the worker swaps once the running episodes ended),
so its cost includes the engine's idle time while the last episodes finish; each way also reports the episodes
whose turns span two versions (none for ``drain``) and the seconds the env worker held episodes back.

    python -m bench.live_update                     # vLLM on the CPU (3-5 minutes)
    python -m bench.live_update --engine fake       # the fake engine (seconds; checks the mechanics only)
    python -m bench.live_update --workload episodes # multi-turn episodes through an env worker
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
from rollout_ledger.shared.subjects import ERROR_HEADER, INFER_ANY, WORK_STREAM, event_subject


@dataclass
class Observed:
    """Every generated turn's (time, tokens, version), and the versions each episode's turns carry."""

    replies: list[tuple[float, int, int]] = field(default_factory=list)
    failures: int = 0
    episodes: dict[str, set[int]] = field(default_factory=dict)
    last_turn: dict[str, float] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, episode_id: str, tokens: int, version: int) -> None:
        now = time.monotonic()
        self.replies.append((now, tokens, version))
        self.episodes.setdefault(episode_id, set()).add(version)
        self.last_turn[episode_id] = now

    def tokens(self, start: float, end: float) -> int:
        return sum(n for t, n, _ in self.replies if start <= t < end)

    def first_reply_of(self, version: int, after: float) -> float | None:
        return next((t for t, _, v in self.replies if v == version and t >= after), None)

    def mixed_since(self, start: float) -> int:
        """Episodes with a turn after ``start`` whose turns carry more than one version."""
        return sum(1 for e, vs in self.episodes.items() if len(vs) > 1 and self.last_turn[e] >= start)


@dataclass
class Load(Observed):
    """Steady requesters (the turns workload)."""

    nc: bus.NATS | None = None
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    max_tokens: int = 32

    async def stream(self, index: int) -> None:
        assert self.nc is not None
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
            self.record(turn.episode_id, int(turn.token_ids.shape[0]), turn.weight_version)


@dataclass
class Episodes(Observed):
    """The episodes workload: the turns the inference worker publishes for the env worker's episodes, observed on
    the bus; batches submitted whenever the work queue runs low."""

    url: str = ""
    turns: int = 6
    max_tokens: int = 32
    low_water: int = 16
    env_url: str = ""
    api_headers: dict[str, str] | None = None
    """The scheduler's bearer token header."""

    async def observe(self, nc: bus.NATS) -> None:
        async def on_turn(msg: bus.Msg) -> None:
            turn = decode_as(msg.data, TurnGenerated)
            self.record(turn.episode_id, int(turn.token_ids.shape[0]), turn.weight_version)

        await nc.subscribe(event_subject("turn.generated"), cb=on_turn)

    async def feed(self, js: bus.JetStreamContext) -> None:
        async with httpx.AsyncClient(timeout=30, headers=self.api_headers) as client:
            while not self.stop.is_set():
                if (await js.stream_info(WORK_STREAM)).state.messages < self.low_water:
                    r = await client.post(f"{self.url}/v1/batches", json={
                        "env": "fixed-turns", "tasks": [{"turns": self.turns}] * 64, "group_size": 1,
                        "max_turns": self.turns, "sampling": {"temperature": 1.0, "max_tokens": self.max_tokens}})
                    r.raise_for_status()
                await asyncio.sleep(0.5)

    def env_metric(self, name: str) -> float:
        """A counter or sum of the env worker (0 when it cannot be read)."""
        try:
            text = httpx.get(f"{self.env_url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0.0
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith(name) and line.split("{", 1)[0].split(" ", 1)[0] == name)


def worker_metric(url: str, name: str, fate: str) -> float:
    """A labelled counter of the inference worker (0 when it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(f'{name}{{fate="{fate}"}}'))


def copy_checkpoint(model_dir: str, out: Path) -> Path:
    """A copy of the model directory (a trainer's checkpoint of unchanged shapes)."""
    shutil.copytree(model_dir, out)
    return out


async def measure(load: Observed, way: str, version: int, start_update: object, steady_s: float,
                  settle_s: float, timeout_s: float) -> dict[str, object]:
    t_steady = time.monotonic()
    await asyncio.sleep(steady_s)
    began = time.monotonic()
    rate = load.tokens(t_steady, began) / (began - t_steady)
    failures_before = load.failures
    env = load if isinstance(load, Episodes) else None
    retries_before = env.env_metric("rollout_inference_retries_total") if env is not None else 0.0
    paused_before = env.env_metric("rollout_policy_pause_seconds_sum") if env is not None else 0.0
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
    result: dict[str, object] = {
        "way": way, "version": version, "steady_tokens_per_s": round(rate, 1),
        "time_to_serving_s": round(served - began, 2), "window_s": round(end - began, 2),
        "tokens_expected": round(expected), "tokens_produced": produced,
        "tokens_lost": round(max(0.0, expected - produced)), "failed_requests": load.failures - failures_before}
    if env is not None:
        result["failed_requests"] = round(env.env_metric("rollout_inference_retries_total") - retries_before)
        result["mixed_episodes"] = env.mixed_since(began)
        result["env_paused_s"] = round(env.env_metric("rollout_policy_pause_seconds_sum") - paused_before, 2)
    return result


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
            load: Observed
            if args.workload == "episodes":
                # a restart makes every turn fail until the new worker answers: the env worker keeps trying
                # (else its episodes would fail and the batches drain through meanwhile)
                env_worker = stack.start("env-worker", name="env", ROLLOUT_CONCURRENCY=str(args.streams),
                                         ROLLOUT_INFERENCE_MAX_TRIES="1000", ROLLOUT_INFERENCE_BACKOFF_MAX_S="0.5",
                                         ROLLOUT_INFERENCE_REQUEST_TIMEOUT_S="600")
                episodes = Episodes(url=url, turns=args.turns, max_tokens=args.max_tokens,
                                    low_water=2 * args.streams, env_url=env_worker.url,
                                    api_headers=stack.api_headers)
                await episodes.observe(nc)
                streams = [asyncio.create_task(episodes.feed(nc.jetstream()))]
                load = episodes
            else:
                turns_load = Load(nc=nc, prompt=np.asarray(prompt, dtype=np.int32), max_tokens=args.max_tokens)
                streams = [asyncio.create_task(turns_load.stream(i)) for i in range(args.streams)]
                load = turns_load
            await asyncio.sleep(args.warmup)
            for version, mode in ((1, "drain"), (2, "abort"), (3, "keep")):
                ckpt = copy_checkpoint(model_dir, work / f"v{version}")

                async def announce(v: int = version, m: str = mode, c: Path = ckpt) -> None:
                    async with httpx.AsyncClient(timeout=30, headers=stack.api_headers) as client:
                        r = await client.post(f"{url}/v1/policy/versions",
                                              json={"version": v, "checkpoint": str(c), "mode": m})
                    r.raise_for_status()

                before = {fate: worker_metric(worker.url, "rollout_swap_tokens_total", fate)
                          for fate in ("lost", "kept")}
                results.append(await measure(load, mode, version, announce, args.steady, args.settle, 600))
                results[-1]["tokens_discarded"] = round(
                    worker_metric(worker.url, "rollout_swap_tokens_total", "lost") - before["lost"])
                results[-1]["tokens_kept_across"] = round(
                    worker_metric(worker.url, "rollout_swap_tokens_total", "kept") - before["kept"])
                print(json.dumps(results[-1]), flush=True)
            ckpt = copy_checkpoint(model_dir, work / "v4")
            holder: dict[str, ServiceProcess] = {"worker": worker}

            async def restart() -> None:
                old = holder["worker"]
                await asyncio.to_thread(old.stop)
                holder["worker"] = stack.start("inference-worker", name="inf-restarted", wait=False,
                                               ROLLOUT_MODEL=str(ckpt), ROLLOUT_WEIGHT_VERSION="4")

            # the restarted worker must not load the announced versions: it starts on version 4, above them
            results.append(await measure(load, "restart", 4, restart, args.steady, args.settle, 900))
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
    ap.add_argument("--workload", choices=("turns", "episodes"), default="turns",
                    help="single turns from requesters, or multi-turn episodes through an env worker")
    ap.add_argument("--turns", type=int, default=6, help="episodes workload: turns per episode")
    ap.add_argument("--streams", type=int, default=8, help="concurrent requesters (episodes at once)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first measurement")
    ap.add_argument("--steady", type=float, default=15.0, help="seconds the steady rate is measured over")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after time to serving in the window")
    args = ap.parse_args()
    results = asyncio.run(run(args))
    restart = next(r for r in results if r["way"] == "restart")
    lost_restart = max(1, int(restart["tokens_lost"]))  # type: ignore[call-overload]
    episodes = args.workload == "episodes"
    print(f"{'way':<8} {'to serving s':>12} {'window s':>9} {'tok/s steady':>12} {'lost tokens':>11} "
          f"{'lost / restart':>14} {'failed req':>10} {'discarded':>9} {'kept across':>11}"
          + (f" {'mixed ep':>8} {'env paused s':>12}" if episodes else ""))
    for r in results:
        lost = int(r["tokens_lost"])  # type: ignore[call-overload]
        print(f"{r['way']:<8} {r['time_to_serving_s']:>12} {r['window_s']:>9} {r['steady_tokens_per_s']:>12} "
              f"{lost:>11} {lost / lost_restart:>14.3f} {r['failed_requests']:>10} "
              f"{r.get('tokens_discarded', '-'):>9} {r.get('tokens_kept_across', '-'):>11}"
              + (f" {r['mixed_episodes']:>8} {r['env_paused_s']:>12}" if episodes else ""))
    print("target: a live update loses at most 1/5 of what a restart loses", file=sys.stderr)


if __name__ == "__main__":
    main()
