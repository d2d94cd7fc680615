"""Work lost per crash: 20-turn episodes while env workers are killed (SIGKILL) on a schedule, run twice side by
side on the same stack shape: ``restart`` (``ROLLOUT_RESUME=false``: every attempt after a crash starts at turn 0,
the behaviour before resume) and ``resume`` (the next attempt carries the recorded turns over).

Per run, from Postgres once every episode is terminal:

- ``recorded_at_crash``: turns the interrupted attempts had recorded with their steps (what could be kept);
- ``reused``: of those, the turns a later attempt carried over (``steps.reused_from``); ``reused_pct``;
- ``tokens_lost``: sampled ids of turns in no trajectory (generated, then thrown away), per crash;
- ``trajectory_s_lost``: the inference and env time of those turns and their steps (queue + generate + step ms),
  per crash (verl#7579's "trajectory-seconds lost per crash").

The fake engine (``--delay-s`` per turn) stands in for the model: what is measured is the work the ledger throws
away, not the engine. Target (issue 25): at least 95 % of recorded turns reused. Usage:

    python -m bench.resume                       # make bench: 48 episodes x 20 turns, 3 kills per run
    python -m bench.resume --episodes 8 --kills 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from bench.chaos import _metric
from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.lifecycle import TERMINAL


@dataclass
class ResumeBenchConfig:
    episodes: int = 48
    turns: int = 20
    kills: int = 3
    """Env worker kills per run, ``gap_s`` apart, each while the worker is mid-episode."""
    gap_s: float = 3.0
    delay_s: float = 0.25
    """Fake engine seconds per turn."""
    env_workers: int = 2
    concurrency: int = 8
    timeout_s: float = 600.0
    echo: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))


@dataclass
class RunFigures:
    mode: str
    crashes: int
    episodes_completed: int
    attempts_after_first: int
    recorded_at_crash: int
    reused: int
    reused_pct: float
    turns_generated: int
    tokens_generated: int
    tokens_lost: int
    tokens_lost_per_crash: float
    tokens_lost_per_interrupted: float
    trajectory_s_lost: float
    trajectory_s_lost_per_crash: float
    wall_s: float


def run_once(cfg: ResumeBenchConfig, resume: bool) -> RunFigures:
    mode = "resume" if resume else "restart"
    env = {"ROLLOUT_FAKE_DELAY_S": str(cfg.delay_s), "ROLLOUT_CONCURRENCY": str(cfg.concurrency),
           "ROLLOUT_ACK_WAIT_S": "3", "ROLLOUT_RESUME": "true" if resume else "false", "ROLLOUT_LOG_LEVEL": "WARNING"}
    t0 = time.monotonic()
    dev = DevStack(scheduler_port=None, env_workers=cfg.env_workers, inference_workers=1, engine="fake",
                   echo=cfg.echo, extra_env=env)
    with dev:
        stack = dev.stack
        assert stack is not None
        body = {"env": "fixed-turns", "tasks": [{"turns": cfg.turns}] * cfg.episodes, "group_size": 1,
                "max_turns": cfg.turns, "sampling": {"max_tokens": 16}}
        resp = httpx.post(f"{dev.scheduler_url}/v1/batches", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {dev.api_token}"})
        resp.raise_for_status()
        batch = str(resp.json()["batch_id"])
        crashes = 0
        for k in range(cfg.kills):
            time.sleep(cfg.gap_s)
            live = [p for p in stack.procs if p.service == "env-worker" and p.alive]
            victim = live[k % len(live)]
            deadline = time.monotonic() + 15.0
            while _metric(victim.url, "rollout_work_items_held") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            victim.kill()
            crashes += 1
            stack.procs.remove(victim)
            stack.start("env-worker", name=victim.name, wait=False).wait_ready(timeout_s=90)
            cfg.echo(f"{mode}: kill -9 {victim.name} ({crashes}/{cfg.kills})")
        engine = create_engine(sync_url(dev.infra.database_url))
        try:
            statuses = ",".join(f"'{s}'" for s in TERMINAL)

            def scalar(query: str) -> Any:
                with engine.connect() as conn:
                    return conn.execute(text(query), {"b": batch}).scalar()

            deadline = time.monotonic() + cfg.timeout_s
            while scalar(f"select count(*) from episodes where batch_id = :b and status in ({statuses})") \
                    < cfg.episodes and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(1.0)  # the recorder's last rows
            in_batch = "episode_id in (select id from episodes where batch_id = :b)"
            completed = int(scalar("select count(*) from episodes where batch_id = :b and status = 'completed'"))
            after_first = int(scalar("select coalesce(sum(attempt - 1), 0) from episodes where batch_id = :b"))
            # what the interrupted attempts had recorded: their steps (the kept attempt's own steps excluded)
            recorded = int(scalar(f"select count(*) from steps s where {in_batch} and s.attempt < (select e.attempt "
                                  "from episodes e where e.id = s.episode_id) and s.reused_from is null"))
            reused = int(scalar(f"select count(*) from steps where {in_batch} and reused_from is not null "
                                "and not superseded"))
            turns = int(scalar(f"select count(*) from turns where {in_batch}"))
            tokens = int(scalar(f"select coalesce(sum(cardinality(token_ids)), 0) from turns where {in_batch}"))
            lost = f"turns t where t.superseded and t.{in_batch}"
            tokens_lost = int(scalar(f"select coalesce(sum(cardinality(t.token_ids)), 0) from {lost}"))
            lost_s = float(scalar(f"select coalesce(sum(t.queue_ms + t.generate_ms), 0) / 1000.0 from {lost}") or 0)
            lost_s += float(scalar(f"select coalesce(sum(s.step_ms), 0) / 1000.0 from steps s where s.superseded "
                                   f"and s.reused_from is null and s.{in_batch} and not exists (select 1 from steps k "
                                   "where k.reused_from = s.event_id)") or 0)
        finally:
            engine.dispose()
    per = max(crashes, 1)
    return RunFigures(mode=mode, crashes=crashes, episodes_completed=completed, attempts_after_first=after_first,
                      recorded_at_crash=recorded, reused=reused,
                      reused_pct=round(100.0 * reused / recorded, 1) if recorded else 0.0, turns_generated=turns,
                      tokens_generated=tokens, tokens_lost=tokens_lost,
                      tokens_lost_per_crash=round(tokens_lost / per, 1),
                      tokens_lost_per_interrupted=round(tokens_lost / max(after_first, 1), 1),
                      trajectory_s_lost=round(lost_s, 2),
                      trajectory_s_lost_per_crash=round(lost_s / per, 2), wall_s=round(time.monotonic() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = ResumeBenchConfig()
    for name in ("episodes", "turns", "kills", "env_workers", "concurrency"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("gap_s", "delay_s", "timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    cfg = ResumeBenchConfig(**vars(parser.parse_args(argv)))
    runs = [run_once(cfg, resume=False), run_once(cfg, resume=True)]
    for r in runs:
        print(json.dumps({"run": "resume", **asdict(r)}), flush=True)
    print("\n| mode | crashes | episodes interrupted | recorded at crash | reused | tokens lost / crash | "
          "tokens lost / interrupted episode | trajectory-s lost / crash |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r.mode} | {r.crashes} | {r.attempts_after_first} | {r.recorded_at_crash} | {r.reused} "
              f"({r.reused_pct} %) | {r.tokens_lost_per_crash} | {r.tokens_lost_per_interrupted} | "
              f"{r.trajectory_s_lost_per_crash} |")
    resumed = runs[1]
    ok = resumed.episodes_completed == cfg.episodes and runs[0].episodes_completed == cfg.episodes
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
