"""Chaos benchmark: episodes through the real services while every kind of process is killed with SIGKILL, NATS is
killed and restarted and Postgres is stopped; then what became of every episode and every turn.

Faults, one after another ``--gap-s`` apart while episodes run (a wave of episodes is submitted before each, so
load never runs dry): ``--kills`` rounds of SIGKILL to one env worker, one inference worker, the recorder and the
scheduler (each started again at once, same name and port), a NATS SIGKILL and restart (``--nats-down-s`` later)
and a Postgres stop for ``--pg-down-s``. Then it waits for every episode to be terminal and prints one JSON line:

- ``terminal``: episodes in a terminal status, by status; ``lost``: submitted episodes not terminal (or missing);
- ``duplicated``: rows stored twice (a second trajectory of an episode, a second kept step of a turn);
- ``regenerated_turns`` / ``regenerated_pct``: turns generated but in no trajectory (the work of attempts cut by a
  kill, inference tries repeated), over every turn generated;
- ``turns_reused``: recorded turns a later attempt carried over (resume); ``recorded_turns_generated_again``:
  recorded turns (with their step) that a later attempt generated again anyway; ``resumed``: attempts after the
  first by how they resumed;
- ``quiesce_s``: from the end of the last fault to the last episode terminal.

Exit status 1 when anything is lost or duplicated. Usage:

    python -m bench.chaos                    # make chaos: 2,000 episodes, each kill twice, Postgres down 30 s
    python -m bench.chaos --episodes 150 --kills 1 --pg-down-s 3   # the CI size (tests/integration/test_chaos.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.lifecycle import TERMINAL

KILL_ORDER = ("env-worker", "inference-worker", "recorder", "scheduler")
_IN_FLIGHT = {"env-worker": "rollout_work_items_held", "inference-worker": "rollout_inference_inflight"}
"""The gauge of work in hand, per service killed mid-work."""


def _metric(url: str, name: str) -> float:
    """A gauge of a service's /metrics (0 when it does not answer)."""
    try:
        body = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class ChaosConfig:
    """The size of a run and its faults."""

    episodes: int = 2000
    turns: int = 4
    kills: int = 2
    """Rounds of SIGKILL: each kills one process of every kind in ``KILL_ORDER``."""
    nats_down_s: float = 2.0
    pg_down_s: float = 30.0
    gap_s: float = 3.0
    """Pause between faults (episodes run meanwhile)."""
    fake_delay_s: float = 0.25
    """Seconds per turn in the fake engine."""
    concurrency: int = 4
    """Episodes in flight per env worker: what a kill of one cuts mid-way."""
    env_workers: int = 3
    inference_workers: int = 2
    quiesce_timeout_s: float = 600.0
    log_level: str = "WARNING"
    keep_logs: str = ""
    """A folder the services' logs are copied to before the stack's files are removed (empty: not kept)."""
    echo: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))


@dataclass
class ChaosResult:
    episodes: int
    terminal: int
    statuses: dict[str, int]
    lost: int
    duplicated: int
    turns: int
    regenerated_turns: int
    regenerated_pct: float
    regenerated_by_superseded_attempts: int
    regenerated_within_final_attempt: int
    attempts_after_first: int
    cut_by_kills: int
    rerun: dict[str, int]
    """Episodes that ran more than one attempt (the first 50) and their last attempt."""
    turns_reused: int
    """Recorded turns a later attempt carried over instead of generating them again (resume)."""
    recorded_turns_generated_again: int
    """Turns that had been recorded with their step and were generated again by a later attempt (a restart: the
    resume query unanswered, or a replay that diverged)."""
    resumed: dict[str, int]
    """Attempts after the first by how they resumed (``attempt_resumes.mode``)."""
    faults: list[str]
    fault_s: float
    quiesce_s: float
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0


class Chaos:
    """One run: the stack, the waves of episodes, the faults, the figures."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        env = {"ROLLOUT_FAKE_DELAY_S": str(cfg.fake_delay_s), "ROLLOUT_CONCURRENCY": str(cfg.concurrency),
               "ROLLOUT_ACK_WAIT_S": "5", "ROLLOUT_LOG_LEVEL": cfg.log_level,
               # a turn asked for while NATS restarts meets "no responders" until the inference workers are back:
               # tries enough to span a restart (each after a pause of up to 2 s)
               "ROLLOUT_INFERENCE_MAX_TRIES": "8", "ROLLOUT_INFERENCE_BACKOFF_MAX_S": "2",
               "ROLLOUT_INFERENCE_REQUEST_TIMEOUT_S": "30"}
        self.dev = DevStack(scheduler_port=None, env_workers=cfg.env_workers,
                            inference_workers=cfg.inference_workers, engine="fake", echo=cfg.echo, extra_env=env)
        self.batch_ids: list[str] = []
        self.faults: list[str] = []
        self._kill_round: dict[str, int] = {}
        self.cut_by_kills = 0

    # --- load ------------------------------------------------------------------------------------
    def submit(self, n: int, timeout_s: float = 120.0) -> None:
        """A batch of ``n`` episodes, retried until the scheduler takes it (it may be restarting)."""
        body = {"env": "fixed-turns", "tasks": [{"turns": self.cfg.turns}] * n, "group_size": 1,
                "max_turns": self.cfg.turns, "sampling": {"max_tokens": 8}}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = httpx.post(f"{self.dev.scheduler_url}/v1/batches", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {self.dev.api_token}"})
                if resp.status_code == 201:
                    self.batch_ids.append(str(resp.json()["batch_id"]))
                    return
                last = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler took no batch in {timeout_s}s: {last}")
            time.sleep(0.5)

    # --- faults ----------------------------------------------------------------------------------
    def kill(self, service: str) -> None:
        """SIGKILL one live process of ``service`` (a different one each round) and start it again."""
        stack = self.dev.stack
        assert stack is not None
        live = [p for p in stack.procs if p.service == service and p.alive]
        n = self._kill_round.get(service, 0)
        self._kill_round[service] = n + 1
        victim = live[n % len(live)]
        gauge = _IN_FLIGHT.get(service)
        if gauge is not None:  # kill it mid-work: wait (a while) until it runs something
            deadline = time.monotonic() + 15.0
            while _metric(victim.url, gauge) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            if service == "env-worker":
                self.cut_by_kills += int(_metric(victim.url, gauge))
        victim.kill()
        stack.procs.remove(victim)
        proc = stack.start(service, name=victim.name, port=victim.port if service == "scheduler" else None,
                           wait=False)
        proc.wait_ready(timeout_s=90)
        if service == "scheduler":
            self.dev.scheduler = proc
        self.faults.append(f"kill -9 {victim.name}")

    def nats_restart(self) -> None:
        nats = self.dev.infra.nats
        if nats is None:
            raise RuntimeError("the chaos run needs its private NATS (unset NATS_URL)")
        nats.kill()
        time.sleep(self.cfg.nats_down_s)
        nats.start()
        self.faults.append(f"NATS kill -9, restarted after {self.cfg.nats_down_s:g} s")

    def postgres_stop(self) -> None:
        pg = self.dev.infra.postgres
        if pg is None:
            raise RuntimeError("the chaos run needs its private Postgres (unset DATABASE_URL)")
        pg.stop()
        time.sleep(self.cfg.pg_down_s)
        pg.start()
        self.faults.append(f"Postgres stopped {self.cfg.pg_down_s:g} s")

    def plan(self) -> list[Callable[[], None]]:
        kills: list[Callable[[], None]] = [functools.partial(self.kill, s) for s in KILL_ORDER]
        steps = list(kills)
        steps += [self.nats_restart, self.postgres_stop]
        for _ in range(self.cfg.kills - 1):
            steps += kills
        return steps

    # --- figures ---------------------------------------------------------------------------------
    def _scalar(self, engine: Engine, query: str) -> int:
        with engine.connect() as conn:
            return int(conn.execute(text(query), {"b": self.batch_ids}).scalar() or 0)

    def terminal(self, engine: Engine) -> int:
        statuses = ",".join(f"'{s}'" for s in TERMINAL)
        return self._scalar(engine, "select count(*) from episodes where batch_id = any(:b) "
                                    f"and status in ({statuses})")

    def figures(self, engine: Engine) -> dict[str, Any]:
        q = self._scalar
        in_batches = "episode_id in (select id from episodes where batch_id = any(:b))"
        with engine.connect() as conn:
            statuses = {str(r[0]): int(r[1]) for r in conn.execute(
                text("select status, count(*) from episodes where batch_id = any(:b) group by status"),
                {"b": self.batch_ids})}
        duplicated = (q(engine, "select count(*) - count(distinct episode_id) from trajectories "
                                "where batch_id = any(:b)")
                      + q(engine, f"select coalesce(sum(n - 1), 0) from (select count(*) as n from steps where "
                                  f"not superseded and {in_batches} group by episode_id, turn_index) s"))
        turns = q(engine, f"select count(*) from turns where {in_batches}")
        kept = q(engine, f"select count(distinct turn_event_id) from steps where not superseded and {in_batches}")
        superseded = q(engine, f"select count(*) from turns where superseded and {in_batches}")
        with engine.connect() as conn:
            rerun = {str(r[0]): int(r[1]) for r in conn.execute(
                text("select id, attempt from episodes where batch_id = any(:b) and attempt > 1 order by id limit 50"),
                {"b": self.batch_ids})}
        reused = q(engine, f"select count(*) from steps where reused_from is not null and not superseded "
                           f"and {in_batches}")
        # a turn whose step was recorded, but which the trajectory's attempt neither kept nor carried over
        t_in_batches = in_batches.replace("episode_id", "t.episode_id")
        again = q(engine, f"select count(*) from turns t where t.superseded and {t_in_batches} "
                          "and exists (select 1 from steps s where s.turn_event_id = t.event_id)")
        with engine.connect() as conn:
            resumed = {str(r[0]): int(r[1]) for r in conn.execute(
                text("select mode, count(*) from attempt_resumes where batch_id = any(:b) group by mode"),
                {"b": self.batch_ids})}
        return {"rerun": rerun, "statuses": statuses, "turns_reused": reused, "recorded_again": again,
                "resumed": resumed, "duplicated": duplicated, "turns": turns,
                "regenerated_turns": turns - kept,
                "regenerated_by_superseded_attempts": superseded,
                "regenerated_within_final_attempt": turns - kept - superseded,
                "attempts_after_first": q(engine, "select coalesce(sum(attempt - 1), 0) from episodes "
                                                  "where batch_id = any(:b) and attempt > 1")}

    def run(self) -> ChaosResult:
        cfg = self.cfg
        t0 = time.monotonic()
        with self.dev:
            engine = create_engine(sync_url(self.dev.infra.database_url))
            try:
                steps = self.plan()
                waves = len(steps) + 1
                sizes = [cfg.episodes // waves + (1 if i < cfg.episodes % waves else 0) for i in range(waves)]
                fault_t0 = time.monotonic()
                for size, step in zip(sizes, steps, strict=False):
                    self.submit(size)
                    time.sleep(cfg.gap_s)
                    cfg.echo(f"fault {len(self.faults) + 1}/{len(steps)} ...")
                    step()
                    cfg.echo(f"  {self.faults[-1]}")
                self.submit(sizes[-1])
                faults_end = time.monotonic()
                deadline = faults_end + cfg.quiesce_timeout_s
                while (done := self.terminal(engine)) < cfg.episodes and time.monotonic() < deadline:
                    time.sleep(0.5)
                quiesce_s = time.monotonic() - faults_end
                time.sleep(2.0)  # the recorder's last rows of the last terminal events
                fig = self.figures(engine)
            finally:
                engine.dispose()
                if cfg.keep_logs:
                    shutil.copytree(self.dev.log_dir, cfg.keep_logs, dirs_exist_ok=True)
        turns = max(fig["turns"], 1)
        return ChaosResult(
            episodes=cfg.episodes, terminal=done, statuses=fig["statuses"], lost=cfg.episodes - done,
            duplicated=fig["duplicated"], turns=fig["turns"], regenerated_turns=fig["regenerated_turns"],
            regenerated_pct=round(100 * fig["regenerated_turns"] / turns, 3),
            regenerated_by_superseded_attempts=fig["regenerated_by_superseded_attempts"],
            regenerated_within_final_attempt=fig["regenerated_within_final_attempt"],
            attempts_after_first=fig["attempts_after_first"], cut_by_kills=self.cut_by_kills, rerun=fig["rerun"],
            turns_reused=fig["turns_reused"], recorded_turns_generated_again=fig["recorded_again"],
            resumed=fig["resumed"],
            faults=self.faults,
            fault_s=round(faults_end - fault_t0, 1), quiesce_s=round(quiesce_s, 1),
            wall_s=round(time.monotonic() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = ChaosConfig()
    for name in ("episodes", "turns", "kills", "concurrency", "env_workers", "inference_workers"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("nats_down_s", "pg_down_s", "gap_s", "fake_delay_s", "quiesce_timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--keep-logs", default="", help="copy the services' logs to this folder")
    parser.add_argument("--log-level", default=defaults.log_level)
    args = parser.parse_args(argv)
    cfg = ChaosConfig(**vars(args))
    result = Chaos(cfg).run()
    print(json.dumps({"run": "chaos", **asdict(result)}), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
