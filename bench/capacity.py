"""Capacity model of the ledger: measured per-turn and per-token costs of every part, and the sizing table they give.

Two halves, both here so the table in docs/deploy.md ("Capacity") is generated, never typed:

**Measure** (``python -m bench.capacity``): the whole system on one machine (``DevStack``: private NATS JetStream
and Postgres, every service process, the zero-cost fake engine) runs episodes of a realistic shape: ``--turns``
turns (30), a prompt of about ``--prompt-tokens`` tokens (5,000) and exactly ``--sampled-tokens`` sampled tokens a
turn (64; ``min_tokens`` = ``max_tokens``), so that the context each turn sends to inference is ~100x what it
samples, the field's input:output shape. Each configuration (``--replicas 1,2``: that many schedulers, env workers,
inference workers and recorders) gets its own fresh stack and one batch per scheduler; then:

- **CPU ms per turn of each service** (and of nats-server and Postgres): psutil user+system time of every process
  of a kind (children included), read when the recorder has stored 20% and 80% of the turns (``window``: a steady
  stretch, episodes start and finish all through it), over the turns recorded in between; and over the whole batch
  (the scheduler's work, storing the batch and publishing its items, is at submit: the model takes the larger);
- **bytes per token in NATS**, by stream: ``RL_EVENTS`` (a limits stream: every event stays for its max age) from
  the monitoring endpoint ``/jsz?streams=true`` before and after the batch; ``RL_WORK`` (a work queue: an item is
  deleted once acked, so the stream holds only what is queued or running) as the bytes its only publisher, the
  scheduler, sent (``/connz``); and the server's whole traffic (``/varz`` in + out bytes);
- **bytes per token in Postgres**: ``pg_table_size`` + ``pg_indexes_size`` of turns, steps, trajectories,
  trajectory_feed, episodes and batches (every partition) before and after, over the tokens stored
  (``trajectories.num_tokens``) and the sampled tokens;
- **the Postgres write rate**: WAL bytes (``pg_current_wal_lsn()``), transactions and rows written
  (``pg_stat_database``) over the window, per turn and per second. The private server runs with ``fsync=off``;
  ``full_page_writes`` is turned back on for the run (the production default) and the window starts with a
  ``CHECKPOINT``, so WAL counts the full-page image of every page the window changes first (the worst case of a
  checkpoint cycle as short as the window; ``wal_bytes_per_turn_whole_run`` has no forced checkpoint).

It prints one JSON line per configuration; ``--write FILE`` stores the run (the figures the tables use).

**Model** (``python -m bench.capacity --table``): ``sizing`` turns the figures of a run (default
``bench/capacity_figures.json``) into cores, replicas, NATS and Postgres volumes for a cluster of G GPUs at an
assumed rate per GPU. Every formula is in ``sizing``; ``Assumptions`` names every assumption, ``SCENARIOS`` the
two rates of docs/deploy.md. ``--update-docs`` rewrites the generated tables of docs/deploy.md and docs/benchmarks.md
(tests/unit/test_capacity_model.py fails while they differ).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from bench.pipeline import positive_ints
from bench.stack_measure import tree_cpu_s

FIGURES_FILE = Path(__file__).with_name("capacity_figures.json")
"""The measured run the table in docs/deploy.md is generated from (``--write`` replaces it)."""

SERVICES = ("scheduler", "env-worker", "inference-worker", "recorder")
"""The service kinds measured; a replica's process is named ``<kind>`` or ``<kind>-<n>``."""

SERVERS = ("nats-server", "postgres")

PG_TABLES = ("turns", "steps", "trajectories", "trajectory_feed", "episodes", "batches")
"""Where a turn's rows go (every partition of a partitioned table counts)."""

DAY_S = 86_400
YEAR_DAYS = 365


class CapacityError(RuntimeError):
    """A measurement could not be taken (the stack did not finish the batch, a server did not answer)."""


# ----------------------------------------------------------------------------------------------------- measurement


@dataclass
class Shape:
    """The episodes a run submits."""

    episodes: int = 600
    turns: int = 30
    prompt_tokens: int = 5000
    """About this many prompt tokens (the fixed-turns env's ``topic``, padded; the measured count is reported)."""
    sampled_tokens: int = 64
    """Sampled tokens per turn, exactly (``min_tokens`` = ``max_tokens``)."""
    in_flight: int = 200
    """Episodes in flight in all (split over the env workers)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")


def _topic(tokens: int) -> str:
    """A topic string of roughly ``tokens`` SmolLM2 tokens: random lowercase words (~3.6 tokens each), so the
    prompt's ids are as varied as text's and Postgres's TOAST compression gains on them no more than on text."""
    rng = random.Random(28)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(tokens * 5 // 18))


def _kind(name: str) -> str:
    """``env-worker-1`` -> ``env-worker``; ``scheduler`` -> ``scheduler``."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def _cpu_by_kind(pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pid in pids.items():
        out[_kind(name)] = out.get(_kind(name), 0.0) + tree_cpu_s(pid)
    return out


def _busy_s() -> float:
    """CPU seconds the whole machine spent busy (every process, ours or not) since boot."""
    import psutil

    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def _get_json(url: str) -> dict[str, Any]:
    try:
        resp = httpx.get(url, timeout=10)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise CapacityError(f"NATS monitoring endpoint {url} did not answer: {exc}") from exc
    body: dict[str, Any] = resp.json()
    return body


@dataclass
class NatsSnapshot:
    stream_bytes: dict[str, int]
    stream_msgs: dict[str, int]
    stream_last_seq: dict[str, int]
    in_bytes: int
    out_bytes: int
    user_in_bytes: dict[str, int]


def nats_snapshot(monitor: str) -> NatsSnapshot:
    """Stream state (``/jsz``), the server's traffic (``/varz``) and bytes published per user (``/connz``)."""
    jsz = _get_json(f"{monitor}/jsz?streams=true")
    streams: dict[str, dict[str, int]] = {}
    for account in jsz.get("account_details", []):
        for st in account.get("stream_detail", []):
            streams[st["name"]] = st["state"]
    varz = _get_json(f"{monitor}/varz")
    users: dict[str, int] = {}
    for conn in _get_json(f"{monitor}/connz?auth=true&limit=1024").get("connections", []):
        user = conn.get("authorized_user", "")
        users[user] = users.get(user, 0) + int(conn.get("in_bytes", 0))
    return NatsSnapshot({k: int(v["bytes"]) for k, v in streams.items()},
                        {k: int(v["messages"]) for k, v in streams.items()},
                        {k: int(v["last_seq"]) for k, v in streams.items()},
                        int(varz["in_bytes"]), int(varz["out_bytes"]), users)


@dataclass
class PgSnapshot:
    table_bytes: dict[str, int]
    index_bytes: dict[str, int]
    database_bytes: int
    wal_lsn: str
    xacts: int
    rows_written: int
    turns: int


def pg_snapshot(engine: Engine) -> PgSnapshot:
    with engine.connect() as conn:
        tables, indexes = {}, {}
        for t in PG_TABLES:
            # every partition of a partitioned table; pg_partition_tree lists nothing for a plain table
            row = conn.execute(text(
                "select coalesce(sum(pg_table_size(r.oid)), 0), coalesce(sum(pg_indexes_size(r.oid)), 0) "
                "from pg_class r where r.oid = cast(:t as regclass) and r.relkind = 'r' "
                "or r.oid in (select relid from pg_partition_tree(cast(:t as regclass)) where isleaf)"),
                {"t": t}).one()
            tables[t], indexes[t] = int(row[0]), int(row[1])
        stat = conn.execute(text(
            "select pg_database_size(current_database()), pg_current_wal_lsn()::text, xact_commit + xact_rollback, "
            "tup_inserted + tup_updated + tup_deleted from pg_stat_database where datname = current_database()"
        )).one()
        turns = conn.execute(text("select count(*) from turns")).scalar_one()
    return PgSnapshot(tables, indexes, int(stat[0]), str(stat[1]), int(stat[2]), int(stat[3]), int(turns))


def _wal_diff(engine: Engine, a: str, b: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("select pg_wal_lsn_diff(:b, :a)"), {"a": a, "b": b}).scalar_one())


def _wait_turns(engine: Engine, at_least: int, deadline: float, what: str) -> int:
    """Polls the recorder's turn count until it reaches ``at_least`` (CapacityError past ``deadline``); returns the
    transactions the polls took (subtracted from the window's count)."""
    polls = 0
    with engine.connect() as conn:
        while True:
            n = int(conn.execute(text("select count(*) from turns")).scalar_one())
            conn.commit()
            polls += 1
            if n >= at_least:
                return polls
            if time.monotonic() > deadline:
                raise CapacityError(f"{what}: {n} of {at_least} turns recorded before the deadline")
            time.sleep(0.1)


def _wait_trajectories(engine: Engine, batches: list[str], episodes: int, deadline: float) -> None:
    with engine.connect() as conn:
        while True:
            n = int(conn.execute(text("select count(*) from trajectories where batch_id = any(:b)"),
                                 {"b": batches}).scalar_one())
            conn.commit()
            if n >= episodes:
                return
            if time.monotonic() > deadline:
                raise CapacityError(f"{n} of {episodes} trajectories recorded before the deadline")
            time.sleep(0.2)


def _post_batch(url: str, token: str, episodes: int, shape: Shape, topic: str) -> str:
    resp = httpx.post(f"{url}/v1/batches", timeout=120, headers={"Authorization": f"Bearer {token}"},
                      json={"env": "fixed-turns", "tasks": [{"turns": shape.turns, "topic": topic}] * episodes,
                            "group_size": 1, "max_turns": shape.turns,
                            "sampling": {"max_tokens": shape.sampled_tokens, "min_tokens": shape.sampled_tokens,
                                         "temperature": 1.0}})
    if resp.status_code != 201 and resp.status_code != 200:
        raise CapacityError(f"POST /v1/batches answered {resp.status_code}: {resp.text[:500]}")
    batch_id: str = resp.json()["batch_id"]
    return batch_id


def measure(replicas: int, shape: Shape, window: tuple[float, float] = (0.2, 0.8), fake_delay_s: float = 0.002,
            timeout_s: float = 900.0) -> dict[str, Any]:
    """One fresh stack with ``replicas`` of every service; one batch per scheduler; the figures of the module doc."""
    from bench.stack_measure import all_pids
    from rollout_ledger.cli.stack.devstack import DevStack
    from rollout_ledger.migrations.runner import sync_url

    if not 0 <= window[0] < window[1] <= 1:
        raise ValueError(f"window is 0 <= start < end <= 1, got {window}")
    env = {"ROLLOUT_CONCURRENCY": str(max(1, shape.in_flight // replicas)), "ROLLOUT_LOG_LEVEL": "WARNING",
           "ROLLOUT_MAX_INFLIGHT": "2048", "ROLLOUT_FAKE_DELAY_S": str(fake_delay_s),
           "ROLLOUT_FAKE_DELAY_JITTER_S": str(2 * fake_delay_s)}  # context: DevStack's 8,192 (SmolLM2's own)
    topic = _topic(shape.prompt_tokens)
    with DevStack(scheduler_port=None, extra_env=env, echo=lambda s: None, env_workers=replicas,
                  inference_workers=replicas, recorders=replicas, schedulers=replicas) as stack:
        if stack.infra.nats is None or stack.infra.postgres is None:
            raise CapacityError("the capacity run needs the private NATS and Postgres (unset NATS_URL/DATABASE_URL)")
        monitor = f"http://127.0.0.1:{stack.infra.nats.monitor_port}"
        engine = create_engine(sync_url(stack.infra.database_url))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            # production WAL: full-page images after each checkpoint (the private server turns them off)
            conn.execute(text("alter system set full_page_writes = on"))
            conn.execute(text("select pg_reload_conf()"))
        pids = all_pids(stack)
        deadline = time.monotonic() + timeout_s
        warm = _post_batch(stack.scheduler_url, stack.api_token, 20, Shape(20, 2, shape.prompt_tokens,
                                                                           shape.sampled_tokens), topic)
        _wait_trajectories(engine, [warm], 20, deadline)
        time.sleep(1.0)  # let the warm-up's stats reach pg_stat_database (flushed at most every second)
        nats0, pg0 = nats_snapshot(monitor), pg_snapshot(engine)
        cpu_run0 = _cpu_by_kind(pids)
        t_submit = time.monotonic()
        per = [shape.episodes // len(stack.schedulers) + (1 if i < shape.episodes % len(stack.schedulers) else 0)
               for i in range(len(stack.schedulers))]
        batches = [_post_batch(s.url, stack.api_token, n, shape, topic) for s, n in zip(stack.schedulers, per,
                                                                                         strict=True) if n]
        total_turns = shape.episodes * shape.turns
        _wait_turns(engine, pg0.turns + int(total_turns * window[0]), deadline, "window start")
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("checkpoint"))  # the window's first change of every page writes a full-page image
        cpu_a, pg_a, t_a, busy_a = _cpu_by_kind(pids), pg_snapshot(engine), time.monotonic(), _busy_s()
        window_end = pg0.turns + int(total_turns * window[1])
        if pg_a.turns >= window_end:
            raise CapacityError(f"the window closed before it opened ({pg_a.turns - pg0.turns} of {total_turns} turns "
                                "recorded at its start): the run is too short for this machine; give it more episodes "
                                "or turns")
        polls = _wait_turns(engine, window_end, deadline, "window end") + 1
        cpu_b, pg_b, t_b, busy_b = _cpu_by_kind(pids), pg_snapshot(engine), time.monotonic(), _busy_s()
        _wait_trajectories(engine, batches, shape.episodes, deadline)
        wall = time.monotonic() - t_submit
        cpu_run1 = _cpu_by_kind(pids)
        time.sleep(1.0)
        nats1, pg1 = nats_snapshot(monitor), pg_snapshot(engine)
        with engine.connect() as conn:
            stored = conn.execute(text(
                "select count(*), sum(num_tokens), sum(num_sampled_tokens), sum(prompt_len), sum(num_turns), "
                "count(*) filter (where status <> 'completed') from trajectories where batch_id = any(:b)"),
                {"b": batches}).one()
            row_bytes = conn.execute(text(
                "select (select sum(pg_column_size(t.*)) from trajectories t where batch_id = any(:b)), "
                "(select sum(4 * (2 * cardinality(token_ids) + num_sampled_tokens) + 2 * cardinality(token_ids) + "
                "4 * cardinality(weight_versions)) from trajectories where batch_id = any(:b))"), {"b": batches}).one()
            turn_tokens = conn.execute(text(
                "select count(*), sum(t.prompt_len), sum(cardinality(t.token_ids)) from turns t "
                "join episodes e on e.id = t.episode_id where e.batch_id = any(:b)"), {"b": batches}).one()
        win_wal, run_wal = _wal_diff(engine, pg_a.wal_lsn, pg_b.wal_lsn), _wal_diff(engine, pg0.wal_lsn, pg1.wal_lsn)
        engine.dispose()
    n_traj, tokens, sampled, prompt, n_turns, not_completed = (int(v or 0) for v in stored)
    if n_traj != shape.episodes or n_turns != total_turns or not_completed:
        raise CapacityError(f"expected {shape.episodes} completed trajectories of {shape.turns} turns, got {n_traj} "
                            f"with {n_turns} turns ({not_completed} not completed): check the shape fits "
                            "ROLLOUT_MAX_MODEL_LEN")
    win_turns, win_s = pg_b.turns - pg_a.turns, t_b - t_a
    kinds = [*SERVICES, *SERVERS]
    pg_bytes = {t: (pg1.table_bytes[t] - pg0.table_bytes[t]) + (pg1.index_bytes[t] - pg0.index_bytes[t])
                for t in PG_TABLES}
    events = nats1.stream_bytes["RL_EVENTS"] - nats0.stream_bytes["RL_EVENTS"]
    work_bytes = nats1.user_in_bytes.get("scheduler", 0) - nats0.user_in_bytes.get("scheduler", 0)
    wire = (nats1.in_bytes - nats0.in_bytes) + (nats1.out_bytes - nats0.out_bytes)
    return {
        "replicas": replicas, "shape": asdict(shape), "fake_delay_s": fake_delay_s,
        "tokens": {"stored": tokens, "sampled": sampled, "prompt": prompt, "turns": n_turns,
                   "input_tokens_sent": int(turn_tokens[1] or 0),
                   "input_to_output": round(int(turn_tokens[1] or 0) / max(1, int(turn_tokens[2] or 0)), 1),
                   "stored_per_turn": round(tokens / n_turns, 1), "sampled_per_turn": round(sampled / n_turns, 1)},
        "window": {"turns": win_turns, "s": round(win_s, 2), "turns_per_s": round(win_turns / win_s, 1)},
        "whole_run": {"wall_s": round(wall, 2), "turns_per_s": round(n_turns / wall, 1)},
        "cores_busy": {"stack": round(sum(cpu_b.get(k, 0.0) - cpu_a.get(k, 0.0) for k in kinds) / win_s, 2),
                       "machine": round((busy_b - busy_a) / win_s, 2), "of": os.cpu_count()},
        "cpu_ms_per_turn": {k: round((cpu_b.get(k, 0.0) - cpu_a.get(k, 0.0)) * 1000 / win_turns, 4) for k in kinds},
        "cpu_ms_per_turn_whole_run": {k: round((cpu_run1.get(k, 0.0) - cpu_run0.get(k, 0.0)) * 1000 / n_turns, 4)
                                      for k in kinds},
        "nats": {
            "events_bytes": events, "events_msgs": nats1.stream_msgs["RL_EVENTS"] - nats0.stream_msgs["RL_EVENTS"],
            "events_bytes_per_turn": round(events / n_turns, 1),
            "events_bytes_per_stored_token": round(events / tokens, 3),
            "events_bytes_per_sampled_token": round(events / sampled, 3),
            "work_items": nats1.stream_last_seq["RL_WORK"] - nats0.stream_last_seq["RL_WORK"],
            "work_bytes_published": work_bytes,
            "work_bytes_per_episode": round(work_bytes / shape.episodes, 1),
            "work_bytes_per_turn": round(work_bytes / n_turns, 1),
            "work_bytes_per_stored_token": round(work_bytes / tokens, 3),
            "wire_bytes_per_turn": round(wire / n_turns, 1),
            "wire_bytes_per_stored_token": round(wire / tokens, 3),
        },
        "postgres": {
            "bytes_by_table": pg_bytes,
            "table_bytes_before_after": {t: [pg0.table_bytes[t], pg1.table_bytes[t]] for t in PG_TABLES},
            "index_bytes_by_table": {t: pg1.index_bytes[t] - pg0.index_bytes[t] for t in PG_TABLES},
            "bytes_per_turn": round(sum(pg_bytes.values()) / n_turns, 1),
            "bytes_per_turn_by_table": {t: round(b / n_turns, 1) for t, b in pg_bytes.items()},
            "bytes_per_stored_token": round(sum(pg_bytes.values()) / tokens, 3),
            "bytes_per_sampled_token": round(sum(pg_bytes.values()) / sampled, 3),
            "trajectory_row_bytes": int(row_bytes[0] or 0),
            "trajectory_array_bytes_uncompressed": int(row_bytes[1] or 0),
            "database_bytes_per_turn": round((pg1.database_bytes - pg0.database_bytes) / n_turns, 1),
            "wal_bytes_per_turn": round(win_wal / win_turns, 1),
            "wal_bytes_per_turn_whole_run": round(run_wal / n_turns, 1),
            "wal_bytes_per_s": round(win_wal / win_s),
            "xacts_per_turn": round((pg_b.xacts - pg_a.xacts - polls) / win_turns, 4),
            "xacts_per_s": round((pg_b.xacts - pg_a.xacts - polls) / win_s, 1),
            "rows_per_turn": round((pg_b.rows_written - pg_a.rows_written) / win_turns, 3),
            "rows_per_s": round((pg_b.rows_written - pg_a.rows_written) / win_s, 1),
        },
    }


def machine() -> dict[str, Any]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        model = "?"
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version()}


# ----------------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Figures:
    """The measured per-turn costs the model scales (one configuration of a run: ``Figures.from_run``)."""

    cpu_ms_per_turn: dict[str, float]
    """CPU ms per turn by kind (the services, nats-server and postgres): the larger of the window's and the whole
    run's (the scheduler's work, storing a batch and publishing its items, happens at submit, before the window)."""
    events_bytes_per_turn: float
    """RL_EVENTS stream bytes per turn (held for the stream's max age)."""
    work_bytes_per_episode: float
    """Bytes of one RL_WORK item as published."""
    wire_bytes_per_turn: float
    """NATS traffic in + out per turn (events, acks, inference requests and replies, work items)."""
    pg_bytes_per_turn: float
    """Postgres table + index bytes per turn (turns, steps, trajectories, feed, episodes, batches)."""
    wal_bytes_per_turn: float
    """The larger of the window's (which starts with a checkpoint) and the whole run's."""
    xacts_per_turn: float
    """Postgres transactions per turn (the recorder's batches grow with load: an upper bound at higher rates)."""
    rows_per_turn: float
    """Rows inserted, updated or deleted per turn (``pg_stat_database``: TOAST chunks included)."""
    turns_per_episode: int
    stored_tokens_per_turn: float
    """New tokens a turn adds to its trajectory (sampled, observation and template ids, the prompt's share)."""
    sampled_tokens_per_turn: float

    @classmethod
    def from_run(cls, run: dict[str, Any]) -> Figures:
        whole = run["cpu_ms_per_turn_whole_run"]
        return cls(cpu_ms_per_turn={k: max(v, whole[k]) for k, v in run["cpu_ms_per_turn"].items()},
                   events_bytes_per_turn=run["nats"]["events_bytes_per_turn"],
                   work_bytes_per_episode=run["nats"]["work_bytes_per_episode"],
                   wire_bytes_per_turn=run["nats"]["wire_bytes_per_turn"],
                   pg_bytes_per_turn=run["postgres"]["bytes_per_turn"],
                   wal_bytes_per_turn=max(run["postgres"]["wal_bytes_per_turn"],
                                          run["postgres"]["wal_bytes_per_turn_whole_run"]),
                   xacts_per_turn=run["postgres"]["xacts_per_turn"],
                   rows_per_turn=run["postgres"]["rows_per_turn"],
                   turns_per_episode=run["shape"]["turns"],
                   stored_tokens_per_turn=run["tokens"]["stored_per_turn"],
                   sampled_tokens_per_turn=run["tokens"]["sampled_per_turn"])


@dataclass(frozen=True)
class Assumptions:
    """What the table assumes beyond the measured figures (each one printed under the table)."""

    turns_per_gpu_s: float = 0.125
    """Turns per second per GPU of the cluster (generation and training together)."""
    turn_cycle_s: float = 2.0
    """Seconds from one turn's request to the next (decode + env step): sessions = turns/s x this (Little's law)."""
    core_utilization: float = 0.5
    """Fraction of a core a service may use on average (headroom for bursts, replays after an outage, failover)."""
    cores_per_replica: float = 1.0
    """A service replica is one asyncio process: it uses at most one core."""
    min_replicas: int = 2
    """Every service runs at least two replicas (one may be lost)."""
    events_max_age_days: float = 7.0
    """RL_EVENTS keeps every event this long (rollout_ledger/shared/subjects.py, ``max_age_s``)."""
    stream_replicas: int = 3
    """JetStream replicas of each stream in a NATS cluster (storage and disk writes multiply by it)."""
    queued_episodes_per_session: float = 1.0
    """RL_WORK holds the running episodes' items plus about this many queued per session."""


SCENARIOS: dict[str, Assumptions] = {
    "frontier": Assumptions(turns_per_gpu_s=0.125, turn_cycle_s=2.0),
    "fast-policy": Assumptions(turns_per_gpu_s=20.0, turn_cycle_s=2.0),
}
"""The tables of docs/deploy.md. ``frontier``: the issue's largest published agentic setups, ~1,000 concurrent
sessions on 4,096 GPUs (a large policy; the GPUs also train): 4,096 x 0.125 turns/s x 2 s = 1,024 sessions, 44M turns
a day. ``fast-policy``: the ledger's worst case, a small dense policy (~8B on H100s) generating ~1,300 sampled
tokens/s per GPU averaged over the RL step, 64-token turns: 20 turns/s per GPU, 160x the load per GPU."""


@dataclass(frozen=True)
class Row:
    """One cluster size of the sizing table; every field is computed in ``sizing``."""

    gpus: int
    turns_per_s: float
    sessions: float
    episodes_per_day: float
    cores: dict[str, float]
    replicas: dict[str, int]
    nats_events_gb_per_day: float
    nats_events_storage_gb: float
    nats_work_storage_mb: float
    nats_wire_mb_s: float
    pg_wal_mb_s: float
    pg_wal_gb_per_day: float
    pg_xacts_per_s: float
    pg_rows_per_s: float
    pg_gb_per_day: float
    pg_tb_per_year: float


def sizing(fig: Figures, gpus: int, a: Assumptions) -> Row:
    """The formulas of the table (T = turns/s = gpus x turns_per_gpu_s):

    cores(kind) = T x cpu_ms_per_turn(kind) / 1000 / core_utilization;
    replicas(service) = max(min_replicas, ceil(cores / cores_per_replica)) (not for nats-server, postgres);
    sessions = T x turn_cycle_s; episodes/day = T x 86,400 / turns_per_episode;
    NATS events GB/day = T x events_bytes_per_turn x 86,400 / 1e9; storage = that x max_age_days x stream_replicas;
    RL_WORK storage = sessions x (1 + queued_episodes_per_session) x work_bytes_per_episode x stream_replicas;
    NATS wire MB/s = T x wire_bytes_per_turn / 1e6 (client traffic, without cluster replication);
    WAL MB/s = T x wal_bytes_per_turn / 1e6; WAL GB/day = x 86,400 / 1e3;
    xacts/s = T x xacts_per_turn; rows/s = T x rows_per_turn;
    Postgres GB/day = T x pg_bytes_per_turn x 86,400 / 1e9; TB/year = GB/day x 365 / 1e3 (hot, no archiving).
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    t = gpus * a.turns_per_gpu_s
    sessions = t * a.turn_cycle_s
    cores = {k: t * ms / 1000 / a.core_utilization for k, ms in fig.cpu_ms_per_turn.items()}
    replicas = {k: max(a.min_replicas, math.ceil(c / a.cores_per_replica - 1e-9))
                for k, c in cores.items() if k in SERVICES}
    events_gb_day = t * fig.events_bytes_per_turn * DAY_S / 1e9
    wal_mb_s = t * fig.wal_bytes_per_turn / 1e6
    pg_gb_day = t * fig.pg_bytes_per_turn * DAY_S / 1e9
    return Row(
        gpus=gpus, turns_per_s=t, sessions=sessions, episodes_per_day=t * DAY_S / fig.turns_per_episode,
        cores=cores, replicas=replicas,
        nats_events_gb_per_day=events_gb_day,
        nats_events_storage_gb=events_gb_day * a.events_max_age_days * a.stream_replicas,
        nats_work_storage_mb=sessions * (1 + a.queued_episodes_per_session) * fig.work_bytes_per_episode
        * a.stream_replicas / 1e6,
        nats_wire_mb_s=t * fig.wire_bytes_per_turn / 1e6,
        pg_wal_mb_s=wal_mb_s, pg_wal_gb_per_day=wal_mb_s * DAY_S / 1e3,
        pg_xacts_per_s=t * fig.xacts_per_turn, pg_rows_per_s=t * fig.rows_per_turn,
        pg_gb_per_day=pg_gb_day, pg_tb_per_year=pg_gb_day * YEAR_DAYS / 1e3,
    )


def _n(x: float) -> str:
    """A table number: three significant figures, thousands separated (millions as ``M``), ``<0.01`` below."""
    if x == 0:
        return "0"
    if abs(x) < 0.01:
        return "<0.01"
    if abs(x) >= 1e6:
        return f"{x / 1e6:,.3g} M" if abs(x) < 1e9 else f"{x / 1e6:,.0f} M"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def _c(x: float) -> str:
    """Cores: two decimals (``<0.01`` below), three significant figures from 10."""
    return "<0.01" if x < 0.005 else f"{x:.2f}" if x < 10 else _n(x)


def render_table(fig: Figures, a: Assumptions, gpus: tuple[int, ...] = (64, 512, 4096)) -> str:
    """The markdown table of docs/deploy.md ("Capacity"): one column per cluster size."""
    rows = [sizing(fig, g, a) for g in gpus]
    lines = ["| | " + " | ".join(f"{g:,} GPUs" for g in gpus) + " |", "|---|" + "---|" * len(gpus)]

    def line(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    line("turns/s (GPUs x turns/s per GPU)", [_n(r.turns_per_s) for r in rows])
    line("concurrent sessions (turns/s x turn cycle)", [_n(r.sessions) for r in rows])
    line(f"episodes/day ({fig.turns_per_episode} turns each)", [_n(r.episodes_per_day) for r in rows])
    for k in SERVICES:
        line(f"{k}: cores / replicas", [f"{_c(r.cores[k])} / {r.replicas[k]}" for r in rows])
    for k in SERVERS:
        line(f"{k}: cores", [_c(r.cores[k]) for r in rows])
    line("NATS RL_EVENTS ingest, GB/day", [_n(r.nats_events_gb_per_day) for r in rows])
    line(f"NATS RL_EVENTS storage, GB per day of max_age ({a.stream_replicas} replicas)",
         [_n(r.nats_events_gb_per_day * a.stream_replicas) for r in rows])
    line(f"NATS RL_EVENTS storage, GB at max_age {a.events_max_age_days:g} days (the default)",
         [_n(r.nats_events_storage_gb) for r in rows])
    line("NATS RL_WORK storage, MB", [_n(r.nats_work_storage_mb) for r in rows])
    line("NATS client traffic, MB/s", [_n(r.nats_wire_mb_s) for r in rows])
    line("Postgres WAL, MB/s", [_n(r.pg_wal_mb_s) for r in rows])
    line("Postgres WAL, GB/day", [_n(r.pg_wal_gb_per_day) for r in rows])
    line("Postgres transactions/s", [_n(r.pg_xacts_per_s) for r in rows])
    line("Postgres rows written/s", [_n(r.pg_rows_per_s) for r in rows])
    line("Postgres hot storage, GB/day", [_n(r.pg_gb_per_day) for r in rows])
    line("Postgres hot storage, TB/year (no archiving)", [_n(r.pg_tb_per_year) for r in rows])
    return "\n".join(lines)


def render_measured(runs: list[dict[str, Any]]) -> str:
    """The measured figures of a run file, one column per configuration (replicas of each service)."""
    head = "| per turn | " + " | ".join(f"{r['replicas']} of each service" for r in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]

    def line(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    line("turns/s in the window (2 cores shared by everything)", [_n(r["window"]["turns_per_s"]) for r in runs])
    line("cores busy: the stack / the whole machine",
         [f"{r['cores_busy']['stack']:.2f} / {r['cores_busy']['machine']:.2f}" for r in runs])
    for k in (*SERVICES, *SERVERS):
        line(f"CPU ms: {k} (whole run)",
             [f"{r['cpu_ms_per_turn'][k]:.3f} ({r['cpu_ms_per_turn_whole_run'][k]:.3f})" for r in runs])
    line("CPU ms: all (whole run)", [f"{sum(r['cpu_ms_per_turn'].values()):.3f} "
                                     f"({sum(r['cpu_ms_per_turn_whole_run'].values()):.3f})" for r in runs])
    line("tokens stored / sampled / sent to inference (context)",
         [f"{r['tokens']['stored_per_turn']:g} / {r['tokens']['sampled_per_turn']:g} / "
          f"{r['tokens']['input_tokens_sent'] / r['tokens']['turns']:,.0f}" for r in runs])
    line("NATS RL_EVENTS, bytes (per stored token)",
         [f"{r['nats']['events_bytes_per_turn']:,.0f} ({r['nats']['events_bytes_per_stored_token']:.1f})"
          for r in runs])
    line("NATS RL_WORK, bytes (per episode)",
         [f"{r['nats']['work_bytes_per_turn']:,.0f} ({r['nats']['work_bytes_per_episode']:,.0f})" for r in runs])
    line("NATS client traffic in + out, bytes (per stored token)",
         [f"{r['nats']['wire_bytes_per_turn']:,.0f} ({r['nats']['wire_bytes_per_stored_token']:.0f})" for r in runs])
    for t in PG_TABLES:
        line(f"Postgres {t}, bytes (with indexes)", [f"{r['postgres']['bytes_per_turn_by_table'][t]:,.0f}"
                                                    for r in runs])
    line("Postgres all, bytes (per stored token)",
         [f"{r['postgres']['bytes_per_turn']:,.0f} ({r['postgres']['bytes_per_stored_token']:.1f})" for r in runs])
    line("Postgres WAL, bytes (whole run, no forced checkpoint)",
         [f"{r['postgres']['wal_bytes_per_turn']:,.0f} ({r['postgres']['wal_bytes_per_turn_whole_run']:,.0f})"
          for r in runs])
    line("Postgres transactions / rows written",
         [f"{r['postgres']['xacts_per_turn']:.3f} / {r['postgres']['rows_per_turn']:.2f}" for r in runs])
    line("Postgres per second: WAL MB / transactions / rows",
         [f"{r['postgres']['wal_bytes_per_s'] / 1e6:.2f} / {r['postgres']['xacts_per_s']:,.0f} / "
          f"{r['postgres']['rows_per_s']:,.0f}" for r in runs])
    return "\n".join(lines)


def render_assumptions(fig: Figures, a: Assumptions) -> str:
    cpu = ", ".join(f"{k} {v:.3f}" for k, v in fig.cpu_ms_per_turn.items())
    return "\n".join([
        f"- Rate: {a.turns_per_gpu_s:g} turns/s per GPU; turn cycle {a.turn_cycle_s:g} s (sessions = turns/s x "
        "cycle).",
        f"- Measured per turn ({fig.stored_tokens_per_turn:g} stored tokens, {fig.sampled_tokens_per_turn:g} "
        f"sampled): CPU ms {cpu}; RL_EVENTS {fig.events_bytes_per_turn:,.0f} B; NATS traffic "
        f"{fig.wire_bytes_per_turn:,.0f} B; RL_WORK item {fig.work_bytes_per_episode:,.0f} B per episode; "
        f"Postgres {fig.pg_bytes_per_turn:,.0f} B hot, WAL {fig.wal_bytes_per_turn:,.0f} B, "
        f"{fig.xacts_per_turn:.4f} transactions, {fig.rows_per_turn:.2f} rows.",
        f"- Cores at {a.core_utilization:.0%} average use; replicas = max({a.min_replicas}, cores / "
        f"{a.cores_per_replica:g} core per process, rounded up).",
    ])


# ------------------------------------------------------------------------------------------------------------ main


def load_runs(path: Path) -> list[dict[str, Any]]:
    """The configurations measured by the run in ``path`` (a ``--write`` file)."""
    try:
        runs: list[dict[str, Any]] = json.loads(path.read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CapacityError(f"cannot read the capacity figures {path}: {exc!r}") from exc
    return runs


def load_figures(path: Path, replicas: int = 1) -> Figures:
    """The figures of the run in ``path`` (a ``--write`` file) for the configuration with ``replicas``."""
    for run in load_runs(path):
        if run.get("replicas") == replicas:
            return Figures.from_run(run)
    raise CapacityError(f"{path} has no run with {replicas} replica(s): run `python -m bench.capacity --write {path}`")


DOCS = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md",
        Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md")
"""The pages whose ``<!-- capacity:NAME -->`` blocks are generated (tests/unit/test_capacity_model.py checks them)."""


def generated_blocks(path: Path) -> dict[str, str]:
    """Every generated table of the capacity pages by block name, from the run in ``path``."""
    fig = load_figures(path)
    return {"measured": render_measured(load_runs(path)),
            **{name: render_table(fig, a) for name, a in SCENARIOS.items()}}


def update_docs(path: Path) -> list[str]:
    """Rewrites the generated blocks of ``DOCS`` from the run in ``path`` (nothing else on the pages); returns the
    blocks it found."""
    blocks, found = generated_blocks(path), []
    for page in DOCS:
        doc = page.read_text()
        for name, table in blocks.items():
            pattern = re.compile(rf"(<!-- capacity:{re.escape(name)} -->\n).*?(\n<!-- /capacity:{re.escape(name)} -->)",
                                 re.S)
            m = pattern.search(doc)
            if m is not None:
                doc = doc[:m.start()] + m.group(1) + table + m.group(2) + doc[m.end():]
                found.append(f"{page.name}:{name}")
        page.write_text(doc)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--table", action="store_true", help="print the sizing table from --figures; measure nothing")
    parser.add_argument("--figures", type=Path, default=FIGURES_FILE)
    parser.add_argument("--write", type=Path, default=None, help="store the run here (the table's figures)")
    parser.add_argument("--update-docs", action="store_true",
                        help="rewrite the generated tables of docs/deploy.md and docs/benchmarks.md from --figures")
    parser.add_argument("--replicas", type=positive_ints, default=[1, 2])
    parser.add_argument("--episodes", type=int, default=Shape.episodes)
    parser.add_argument("--turns", type=int, default=Shape.turns)
    parser.add_argument("--prompt-tokens", type=int, default=Shape.prompt_tokens)
    parser.add_argument("--sampled-tokens", type=int, default=Shape.sampled_tokens)
    parser.add_argument("--in-flight", type=int, default=Shape.in_flight)
    parser.add_argument("--turns-per-gpu-s", type=float, default=None,
                        help="with --table: one table at this rate instead of the scenarios of docs/deploy.md")
    args = parser.parse_args()
    if args.update_docs:
        print("updated: " + ", ".join(update_docs(args.figures)))
        return
    if args.table:
        fig = load_figures(args.figures)
        if args.turns_per_gpu_s is None:
            print(f"<!-- capacity:measured -->\n{render_measured(load_runs(args.figures))}\n"
                  "<!-- /capacity:measured -->\n")
        scenarios = SCENARIOS if args.turns_per_gpu_s is None else {
            "custom": Assumptions(turns_per_gpu_s=args.turns_per_gpu_s)}
        for name, a in scenarios.items():
            print(f"<!-- capacity:{name} -->\n{render_table(fig, a)}\n<!-- /capacity:{name} -->\n")
            print(render_assumptions(fig, a) + "\n")
        return
    try:
        shape = Shape(args.episodes, args.turns, args.prompt_tokens, args.sampled_tokens, args.in_flight)
    except ValueError as exc:
        parser.error(str(exc))
    info = machine()
    print(json.dumps({"machine": info}), flush=True)
    runs = []
    for n in args.replicas:
        run = measure(n, shape)
        runs.append(run)
        print(json.dumps({"run": "capacity", **run}), flush=True)
    if args.write is not None:
        args.write.write_text(json.dumps({"command": "python -m bench.capacity " + " ".join(
            sys.argv[1:]), "machine": info, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    try:
        main()
    except CapacityError as exc:
        sys.exit(f"capacity: {exc}")
