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
- ``quiesce_s``: from the end of the last fault to the last episode terminal;
- ``longest_stall_s``: the longest time, sampled every 100 ms, in which neither a turn was recorded nor an episode
  became terminal while submitted episodes were outstanding; ``stalls``: per fault, the longest such stall it
  caused (the fault began during it; else the stall began in the fault's time, before the next fault).

With ``--nats-cluster 3`` NATS is a three-node JetStream cluster (streams and buckets at 3 replicas) and the
faults are the cluster's instead: SIGKILL of the node leading the work stream (``RL_WORK``), restarted after
``--nats-down-s``; SIGKILL of another node (the events stream's leader when that is another), restarted likewise;
then a rolling restart of all three (SIGTERM each node, start it again, wait until every stream is current,
next). After each fault the run waits until every stream has a leader and current replicas.

Exit status 1 when anything is lost or duplicated. Usage:

    python -m bench.chaos                    # make chaos: 2,000 episodes, each kill twice, Postgres down 30 s
    python -m bench.chaos --episodes 150 --kills 1 --pg-down-s 3   # the CI size (tests/integration/test_chaos.py)
    python -m bench.chaos --nats-cluster 3 --episodes 400   # make chaos-cluster (CI size: test_chaos_cluster.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.cli.stack.servers import PrivateNatsCluster
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.lifecycle import TERMINAL
from rollout_ledger.shared.subjects import BUCKETS, EVENTS_STREAM, STREAMS, WORK_STREAM

SAMPLE_S = 0.1
"""How often the progress sampler counts recorded turns and terminal episodes."""
ALL_STREAMS = (*(spec.name for spec in STREAMS), *(f"KV_{bucket}" for bucket in BUCKETS))
"""Every stream of the contract, the KV buckets' included: what must be current again after a cluster fault."""

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
    nats_cluster: int = 1
    """1: one NATS server (the faults above); 3: a JetStream cluster and its faults (node kills, rolling restart)."""
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
    attempts_after_started: int
    """Attempts run after an earlier attempt of the same episode had recorded something (``attempt_resumes`` with
    ``from_attempt`` > 0); the rest of ``attempts_after_first`` followed deliveries that never started (a work item
    lost on its way to a worker with a NATS node: redelivered after the ack wait, nothing to resume or redo)."""
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
    longest_stall_s: float = 0.0
    """The longest time without a turn recorded or an episode terminal while episodes were outstanding."""
    stalls: dict[str, float] = field(default_factory=dict)
    """Fault -> the longest stall it caused (it began during the stall, or the stall began in its time)."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0


class ProgressSampler:
    """Counts recorded turns and terminal episodes every ``SAMPLE_S`` (a thread of its own) while the run goes on;
    ``stalls`` are the intervals in which neither grew while submitted episodes were outstanding."""

    def __init__(self, engine: Engine, submitted: Callable[[], int]) -> None:
        self.engine = engine
        self.submitted = submitted
        self.samples: list[tuple[float, int, int]] = []
        """(monotonic time, turns + terminal episodes, episodes outstanding)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-progress", daemon=True)

    def start(self) -> ProgressSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        statuses = ",".join(f"'{s}'" for s in TERMINAL)
        query = text("select (select count(*) from turns), "
                     f"(select count(*) from episodes where status in ({statuses}))")
        while not self._stop.is_set():
            try:
                with self.engine.connect() as conn:
                    while not self._stop.is_set():
                        submitted = self.submitted()
                        row = conn.execute(query).one()
                        conn.commit()  # a new snapshot for the next sample
                        self.samples.append((time.monotonic(), int(row[0]) + int(row[1]), submitted - int(row[1])))
                        self._stop.wait(SAMPLE_S)
            except DBAPIError:  # Postgres stopped or failed over (a fault of the run): sample again once it is back
                self._stop.wait(SAMPLE_S)

    def wait_progress(self, after: float, timeout_s: float) -> bool:
        """Wait until a sample after ``after`` (monotonic) shows progress over the one before it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            samples = self.samples[-int(timeout_s / SAMPLE_S) - 2:]
            if any(t > after and p != samples[i - 1][1] for i, (t, p, _) in enumerate(samples) if i > 0):
                return True
            time.sleep(SAMPLE_S)
        return False

    def dump(self, path: Path, t0: float) -> None:
        """The samples as CSV (seconds since ``t0``, progress, outstanding), to look a stall up in the logs."""
        with path.open("w") as f:
            f.write("t_s,progress,outstanding\n")
            for t, progress, outstanding in self.samples:
                f.write(f"{t - t0:.2f},{progress},{outstanding}\n")

    def stalls(self) -> list[tuple[float, float]]:
        """(start, end) of every interval without progress while episodes were outstanding, longest first."""
        return stalls_of(self.samples)


def stalls_of(samples: list[tuple[float, int, int]]) -> list[tuple[float, float]]:
    """(start, end) of every interval without progress while episodes were outstanding, longest first: from the
    sample of the last progress (or the first with work outstanding) to the next sample with progress, or to the last
    sample when none came. ``samples``: (time, progress count, episodes outstanding)."""
    out: list[tuple[float, float]] = []
    if not samples:
        return out
    since, last = samples[0][0], samples[0][1]
    for t, progress, outstanding in samples[1:]:
        if outstanding <= 0:
            since, last = t, progress  # nothing to do: no stall
        elif progress != last:
            out.append((since, t))
            since, last = t, progress
    t_end, _, outstanding = samples[-1]
    if outstanding > 0 and t_end > since:
        out.append((since, t_end))
    return sorted(out, key=lambda iv: iv[0] - iv[1])


def stalls_by_fault(stalls: list[tuple[float, float]], faults: list[str], starts: list[float]) -> dict[str, float]:
    """Fault -> the longest stall it caused: the first fault that began during a stall owns it (the stall began at
    the last progress before the fault); a stall no fault began during belongs to the fault in whose time it began
    (a stall before the first fault to none)."""
    per_fault = {fault: 0.0 for fault in faults}
    for a, b in stalls:
        during = [i for i, t in enumerate(starts) if a <= t < b]
        before = [i for i, t in enumerate(starts) if t <= a]
        owner = during[0] if during else before[-1] if before else None
        if owner is not None and owner < len(faults):
            per_fault[faults[owner]] = round(max(per_fault[faults[owner]], b - a), 2)
    return per_fault


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
                            inference_workers=cfg.inference_workers, engine="fake", echo=cfg.echo, extra_env=env,
                            nats_cluster=cfg.nats_cluster)
        self.batch_ids: list[str] = []
        self.submitted = 0
        self.faults: list[str] = []
        self.fault_starts: list[float] = []
        """When each fault of ``faults`` began (monotonic)."""
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
                    self.submitted += n
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
        self.fault_starts.append(time.monotonic())
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
        if isinstance(nats, PrivateNatsCluster):
            raise RuntimeError("nats_restart is the single server's fault: a cluster's are node_kill, rolling_restart")
        self.fault_starts.append(time.monotonic())
        nats.kill()
        time.sleep(self.cfg.nats_down_s)
        nats.start()
        self.faults.append(f"NATS kill -9, restarted after {self.cfg.nats_down_s:g} s")

    def postgres_stop(self) -> None:
        pg = self.dev.infra.postgres
        if pg is None:
            raise RuntimeError("the chaos run needs its private Postgres (unset DATABASE_URL)")
        self.fault_starts.append(time.monotonic())
        pg.stop()
        time.sleep(self.cfg.pg_down_s)
        pg.start()
        self.faults.append(f"Postgres stopped {self.cfg.pg_down_s:g} s")

    def cluster(self) -> PrivateNatsCluster:
        nats = self.dev.infra.nats
        if not isinstance(nats, PrivateNatsCluster):
            raise RuntimeError("a cluster fault needs the private NATS cluster (nats_cluster=3, NATS_URL unset)")
        return nats

    def node_kill(self, stream: str) -> None:
        """SIGKILL the node leading ``stream`` (another node than the last one killed when that one leads it), start
        it again after ``nats_down_s``, then wait until every stream is current."""
        cluster = self.cluster()
        deadline = time.monotonic() + 60.0
        while not (leader := cluster.leader_of(stream)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not leader:
            raise RuntimeError(f"no node leads {stream} within 60 s")
        victim, why = leader, f"leading {stream}"
        if self.faults and self.faults[-1].startswith(f"NATS node {leader} "):
            victim = next(cluster.node_name(i) for i in range(len(cluster.nodes)) if cluster.node_name(i) != leader)
            why = f"not the last one killed ({leader} leads {stream})"
        self.fault_starts.append(time.monotonic())
        cluster.kill(victim)
        time.sleep(self.cfg.nats_down_s)
        cluster.restart(victim)
        cluster.wait_current(ALL_STREAMS, timeout_s=120)
        self.faults.append(f"NATS node {victim} ({why}) kill -9, restarted after {self.cfg.nats_down_s:g} s")

    def rolling_restart(self) -> None:
        """SIGTERM each node in turn, start it again, wait until every stream is current, next (one fault each)."""
        cluster = self.cluster()
        for i in range(len(cluster.nodes)):
            name = cluster.node_name(i)
            self.fault_starts.append(time.monotonic())
            cluster.terminate(i)
            cluster.restart(i)
            cluster.wait_current(ALL_STREAMS, timeout_s=120)
            self.faults.append(f"NATS rolling restart: node {name} SIGTERM, started again, streams current")
            if i + 1 < len(cluster.nodes):
                self.cfg.echo(f"  {self.faults[-1]}")

    def plan(self) -> list[Callable[[], None]]:
        if self.cfg.nats_cluster > 1:
            return [functools.partial(self.node_kill, WORK_STREAM), functools.partial(self.node_kill, EVENTS_STREAM),
                    self.rolling_restart]
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
                                                  "where batch_id = any(:b) and attempt > 1"),
                "attempts_after_started": q(engine, "select count(*) from attempt_resumes where batch_id = any(:b) "
                                                    "and from_attempt > 0")}

    def run(self) -> ChaosResult:
        cfg = self.cfg
        t0 = time.monotonic()
        with self.dev:
            engine = create_engine(sync_url(self.dev.infra.database_url))
            sampler = ProgressSampler(engine, lambda: self.submitted).start()
            try:
                steps = self.plan()
                waves = len(steps) + 1
                sizes = [cfg.episodes // waves + (1 if i < cfg.episodes % waves else 0) for i in range(waves)]
                fault_t0 = time.monotonic()
                for size, step in zip(sizes, steps, strict=False):
                    self.submit(size)
                    time.sleep(cfg.gap_s)
                    if self.fault_starts and cfg.nats_cluster > 1:
                        # one fault's stall apart from the next: go on once the work moved again since the last
                        sampler.wait_progress(after=time.monotonic() - cfg.gap_s, timeout_s=120.0)
                    cfg.echo(f"fault {len(self.faults) + 1}/{len(steps)} ...")
                    step()
                    cfg.echo(f"  {self.faults[-1]}")
                self.submit(sizes[-1])
                faults_end = time.monotonic()
                deadline = faults_end + cfg.quiesce_timeout_s
                while (done := self.terminal(engine)) < cfg.episodes and time.monotonic() < deadline:
                    time.sleep(0.5)
                quiesce_s = time.monotonic() - faults_end
                sampler.stop()
                time.sleep(2.0)  # the recorder's last rows of the last terminal events
                fig = self.figures(engine)
            finally:
                sampler.stop()
                engine.dispose()
                if cfg.keep_logs:
                    shutil.copytree(self.dev.log_dir, cfg.keep_logs, dirs_exist_ok=True)
                    sampler.dump(Path(cfg.keep_logs) / "progress.csv", t0)
                    starts = [round(t - t0, 2) for t in self.fault_starts]
                    (Path(cfg.keep_logs) / "faults.json").write_text(json.dumps(
                        {"wall_clock_t0": time.time() - (time.monotonic() - t0), "faults": self.faults,
                         "starts_s": starts}))
        turns = max(fig["turns"], 1)
        stalls = sampler.stalls()
        per_fault = stalls_by_fault(stalls, self.faults, self.fault_starts)
        return ChaosResult(
            episodes=cfg.episodes, terminal=done, statuses=fig["statuses"], lost=cfg.episodes - done,
            duplicated=fig["duplicated"], turns=fig["turns"], regenerated_turns=fig["regenerated_turns"],
            regenerated_pct=round(100 * fig["regenerated_turns"] / turns, 3),
            regenerated_by_superseded_attempts=fig["regenerated_by_superseded_attempts"],
            regenerated_within_final_attempt=fig["regenerated_within_final_attempt"],
            attempts_after_first=fig["attempts_after_first"], attempts_after_started=fig["attempts_after_started"],
            cut_by_kills=self.cut_by_kills, rerun=fig["rerun"],
            turns_reused=fig["turns_reused"], recorded_turns_generated_again=fig["recorded_again"],
            resumed=fig["resumed"],
            faults=self.faults,
            fault_s=round(faults_end - fault_t0, 1), quiesce_s=round(quiesce_s, 1),
            wall_s=round(time.monotonic() - t0, 1),
            longest_stall_s=round(stalls[0][1] - stalls[0][0], 2) if stalls else 0.0, stalls=per_fault)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    defaults = ChaosConfig()
    for name in ("episodes", "turns", "kills", "concurrency", "env_workers", "inference_workers", "nats_cluster"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("nats_down_s", "pg_down_s", "gap_s", "fake_delay_s", "quiesce_timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--keep-logs", default="", help="copy the services' logs to this folder")
    parser.add_argument("--log-level", default=defaults.log_level)
    args = parser.parse_args(argv)
    cfg = ChaosConfig(**vars(args))
    if cfg.nats_cluster != 1 and cfg.nats_cluster < 3:
        parser.error(f"--nats-cluster is 1 or 3 or more, not {cfg.nats_cluster}")
    result = Chaos(cfg).run()
    print(json.dumps({"run": "chaos-cluster" if cfg.nats_cluster > 1 else "chaos", **asdict(result)}), flush=True)
    cfg.echo(f"longest stall {result.longest_stall_s:g} s; per fault: "
             + "; ".join(f"{fault}: {stall:g} s" for fault, stall in result.stalls.items()))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
