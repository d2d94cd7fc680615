"""Partitioning benchmark: ``--turns`` turns (default 10 million, 200 sampled ids and logprobs each, a year of
history) inserted into the unpartitioned ``turns`` of migration 0015 and the monthly-partitioned one of 0016, then
the queries that read them, and dropping a month against deleting it.

Both tables live in one private Postgres (fsync off) at head: ``turns`` is 0016's partitioned table (monthly
partitions, its default partition), ``turns_flat`` is 0015's shape (primary key ``event_id``, the same episode index,
the same foreign key to ``episodes``). Rows are generated in SQL (``generate_series``; token ids and logprobs drawn
from a pool of 1,000 random 200-element arrays, so the bytes per row are a real turn's), in time order as the
recorder writes them, in chunks of ``--chunk`` rows per transaction, the two tables alternating chunk by chunk (so a
change of the machine's load hits both alike):

- (a) insert: rows per second into each (heap, primary key, episode index, foreign-key check, and for the
  partitioned one the routing);
- (b) queries, each run ``--repeat`` times on both (median and first run): one batch's kept turns for an export
  (what ``kept_turns`` reads: the turns of 1,000 episodes by ``episode_id``, summed in the server so that the
  time is the database's, not the client's parsing of 13 MB of arrays), the viewer's episode page (one
  episode's turns in order), and a count by ``weight_version`` over the last day (the dashboard's question);
- (c) retention: the oldest month written to Parquet as `rollout archive` writes a partition (zstd; bytes per turn
  on disk), then removed: ``DELETE`` from the flat table against ``DETACH`` + ``DROP`` of its partition (what
  `rollout archive` does after the files are verified).

Usage:

    python -m bench.partitions --turns 1000000     # a quicker run (~1 min)
    python -m bench.partitions                     # 10 M turns: the figures in docs/benchmarks.md (~45 GB in /tmp,
                                                   # ~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from rollout_ledger.cli.stack.servers import PrivatePostgres
from rollout_ledger.client.archived import open_location
from rollout_ledger.client.source import _batches, connect_arrow, libpq_url
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.services.exporter.archive import _write

TURNS_PER_EPISODE = 8
EPISODES_PER_BATCH = 1000
SAMPLED = 200
DAYS = 360
POOL = 1000


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def setup(conn: psycopg.Connection[Any], turns: int, ref: str) -> None:
    episodes = (turns + TURNS_PER_EPISODE - 1) // TURNS_PER_EPISODE
    batches = (episodes + EPISODES_PER_BATCH - 1) // EPISODES_PER_BATCH
    months = DAYS // 30 + 1
    conn.execute("SELECT rl_ensure_partitions(1, %s)", (months,))
    conn.execute("CREATE TABLE turns_flat (LIKE turns INCLUDING DEFAULTS INCLUDING COMMENTS)")
    conn.execute("ALTER TABLE turns_flat ADD PRIMARY KEY (event_id)")
    conn.execute("CREATE INDEX ix_turns_flat_episode ON turns_flat (episode_id, attempt, turn_index)")
    conn.execute("ALTER TABLE turns_flat ADD FOREIGN KEY (episode_id) REFERENCES episodes (id) ON DELETE CASCADE")
    conn.execute(
        "INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, request_hash, "
        "created_at) SELECT 'b' || b, 'bench', 8, 8, '{}', %s, %s, 'x', %s::timestamptz - make_interval(days => %s) "
        "+ make_interval(secs => b::float8 / %s * %s * 86400) FROM generate_series(0, %s - 1) b",
        (EPISODES_PER_BATCH // 8, EPISODES_PER_BATCH, ref, DAYS, batches, DAYS, batches))
    conn.execute(
        "INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status) "
        "SELECT 'b' || (e / %s) || '.' || (e %% %s / 8) || '.' || (e %% 8), 'b' || (e / %s), "
        "'b' || (e / %s) || '.' || (e %% %s / 8), e %% 8, e %% %s / 8, 'bench', '{}', 'completed' "
        "FROM generate_series(0, %s - 1) e",
        (EPISODES_PER_BATCH, EPISODES_PER_BATCH, EPISODES_PER_BATCH, EPISODES_PER_BATCH, EPISODES_PER_BATCH,
         EPISODES_PER_BATCH, episodes))
    conn.execute(
        "CREATE TABLE pool AS SELECT p, array(SELECT (random() * 150000)::int4 + p * 0 FROM generate_series(1, %s)) "
        "AS ids, array(SELECT (-random() * 5)::float4 + p * 0 FROM generate_series(1, %s)) AS lps "
        "FROM generate_series(0, %s - 1) p", (SAMPLED, SAMPLED, POOL))
    conn.execute("ALTER TABLE pool ADD PRIMARY KEY (p)")
    conn.execute("VACUUM ANALYZE episodes")


INSERT = """
INSERT INTO {table} (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, logprobs, finish_reason,
    weight_version, engine, worker_id, queue_ms, generate_ms, cached_tokens, produced_at)
SELECT 'b' || (i / {tpe} / {epb}) || '.' || (i / {tpe} %% {epb} / 8) || '.' || (i / {tpe} %% 8) || ':a1:t'
        || (i %% {tpe}) || ':r1',
    'b' || (i / {tpe} / {epb}) || '.' || (i / {tpe} %% {epb} / 8) || '.' || (i / {tpe} %% 8),
    1, i %% {tpe}, 512 + 256 * (i %% {tpe}), p.ids, p.lps, 'stop', (i::float8 / {n} * 120)::int4, 'vllm', 'inf-0',
    1.5, 900.0, 256, '{ref}'::timestamptz - make_interval(days => {days})
        + make_interval(secs => i::float8 / {n} * {days} * 86400)
FROM generate_series(%s, %s - 1) i JOIN pool p ON p.p = i %% {pool}
"""


def insert(conn: psycopg.Connection[Any], turns: int, chunk: int, ref: str) -> dict[str, Any]:
    seconds = {"turns_flat": 0.0, "turns": 0.0}
    for lo in range(0, turns, chunk):
        hi = min(turns, lo + chunk)
        for table in seconds:
            sql = INSERT.format(table=table, tpe=TURNS_PER_EPISODE, epb=EPISODES_PER_BATCH, n=turns, days=DAYS,
                                pool=POOL, ref=ref)
            t0 = time.perf_counter()
            with conn.transaction():
                conn.execute(sql, (lo, hi))
            seconds[table] += time.perf_counter() - t0
    for table in seconds:
        conn.execute(f"VACUUM ANALYZE {table}")
    return {table: {"seconds": round(s, 1), "rows_per_s": round(turns / s)} for table, s in seconds.items()}


def queries(turns: int, ref: str) -> dict[str, str]:
    episodes = turns // TURNS_PER_EPISODE
    mid_batch = f"b{episodes // EPISODES_PER_BATCH // 2}"
    return {
        "batch_kept_turns": (
            "SELECT count(*), sum(cardinality(token_ids)), sum(cardinality(logprobs)) FROM (SELECT t.episode_id, "
            "t.turn_index, t.token_ids, t.logprobs FROM {table} t "
            f"WHERE t.episode_id = ANY(ARRAY(SELECT id FROM episodes WHERE batch_id = '{mid_batch}')) "
            "AND t.attempt = 1 AND NOT t.superseded ORDER BY t.episode_id, t.turn_index) k"),
        "episode_page": (f"SELECT * FROM {{table}} WHERE episode_id = '{mid_batch}.7.3' "
                         "ORDER BY attempt, turn_index"),
        "versions_last_day": ("SELECT weight_version, count(*) FROM {table} "
                              f"WHERE produced_at > '{ref}'::timestamptz - interval '1 day' GROUP BY 1 ORDER BY 1"),
    }


def time_queries(conn: psycopg.Connection[Any], turns: int, repeat: int, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sql in queries(turns, ref).items():
        out[name] = {}
        rows = {}
        for table in ("turns_flat", "turns"):
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                got = conn.execute(sql.format(table=table)).fetchall()
                times.append(time.perf_counter() - t0)
            rows[table] = [tuple(r[:2]) for r in got]
            out[name][table] = {"first_ms": round(times[0] * 1000, 1),
                                "median_ms": round(statistics.median(times) * 1000, 1), "result_rows": len(got)}
        if not rows["turns"] or rows["turns"][0][0] in (0, None):
            raise SystemExit(f"{name}: found nothing: {rows}")
        out[name]["same_result"] = rows["turns_flat"] == rows["turns"]
    return out


def retention(conn: psycopg.Connection[Any], url: str, out: Path) -> dict[str, Any]:
    """The oldest month with rows: written to Parquet as `rollout archive` writes a partition (bytes per turn),
    then DELETE from the flat table against DETACH + DROP of the partition."""
    row = conn.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'turns'::regclass AND c.relname ~ '_p[0-9]{6}$' AND c.reltuples > 0 "
        "ORDER BY c.relname LIMIT 1").fetchone()
    if row is None:
        raise SystemExit("no partition with rows")
    name = str(row[0])
    lo, hi = (s.split("'")[1] for s in str(row[1]).split(" TO "))
    loc = open_location(f"file://{out}")
    t0 = time.perf_counter()
    with connect_arrow(url) as arrow, arrow.cursor() as cur:
        rows, _ = _write(loc, "turns.parquet", _batches(cur, f"SELECT * FROM rl_partitions.{name}"))
    parquet_s = time.perf_counter() - t0
    parquet_bytes = (out / "turns.parquet").stat().st_size
    t0 = time.perf_counter()
    with conn.transaction():
        deleted = conn.execute("DELETE FROM turns_flat WHERE produced_at >= %s AND produced_at < %s",
                               (lo, hi)).rowcount
    delete_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with conn.transaction():
        conn.execute(f"ALTER TABLE turns DETACH PARTITION rl_partitions.{name}")
        conn.execute(f"DROP TABLE rl_partitions.{name}")
    drop_s = time.perf_counter() - t0
    if rows != deleted:
        raise SystemExit(f"the month has {rows} rows in the partition, {deleted} in the flat table")
    return {"month": name, "rows": deleted, "parquet_s": round(parquet_s, 2),
            "parquet_bytes_per_turn": round(parquet_bytes / rows), "delete_s": round(delete_s, 2),
            "detach_drop_s": round(drop_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10_000_000)
    ap.add_argument("--chunk", type=int, default=100_000, help="rows per insert transaction")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each query")
    ap.add_argument("--root", type=Path, default=None, help="where the Postgres data goes (default: a temp dir)")
    args = ap.parse_args()
    if args.turns < TURNS_PER_EPISODE * EPISODES_PER_BATCH * 2 or args.chunk < 1 or args.repeat < 1:
        raise SystemExit(f"--turns must be at least {TURNS_PER_EPISODE * EPISODES_PER_BATCH * 2}, --chunk and "
                         "--repeat at least 1")
    ref = dt.datetime.now(dt.UTC).isoformat()  # "now" of every row and query: results do not drift with the clock
    with tempfile.TemporaryDirectory(prefix="rl-bench-partitions-", dir=args.root) as tmp:
        Path(tmp).chmod(0o711)  # the server may run as another user (initdb refuses root)
        pg = PrivatePostgres(Path(tmp) / "pg")
        pg.start()
        try:
            upgrade(pg.url)
            with psycopg.connect(libpq_url(pg.url), autocommit=True) as conn:
                t0 = time.perf_counter()
                setup(conn, args.turns, ref)
                setup_s = time.perf_counter() - t0
                ins = insert(conn, args.turns, args.chunk, ref)
                print(json.dumps({"insert": ins}), file=sys.stderr, flush=True)
                sizes = {t: int(conn.execute(
                    "SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree(%s::regclass)), "
                    "pg_total_relation_size(%s::regclass))", (t, t)).fetchone()[0])  # type: ignore[index]
                    for t in ("turns_flat", "turns")}
                q = time_queries(conn, args.turns, args.repeat, ref)
                ret = retention(conn, pg.url, Path(tmp))
        finally:
            pg.stop()
    print(json.dumps({
        "turns": args.turns, "sampled_ids_per_turn": SAMPLED, "days": DAYS, "chunk": args.chunk, "cpu": cpu_model(),
        "setup_s": round(setup_s, 1), "insert": ins,
        "bytes_per_turn": {t: round(s / args.turns) for t, s in sizes.items()},
        "queries": q, "retention": ret}, indent=1))


if __name__ == "__main__":
    main()
