"""Exporter benchmark: 100,000 stored trajectories exported from Postgres, against writing the same arrays
straight with pyarrow; peak memory of the export process.

Each path runs in its own process (so peak RSS is that path's own), with the CPU seconds it took in its own
process and in Postgres (steadier than wall time on a shared machine). The store is vacuumed after seeding (as
autovacuum leaves it); each path runs ``--repeat`` times in rounds beside its baseline (export, write, export,
write...), and the fastest run of each counts; the ratio of every round is printed too:

- ``export``: `rollout export`'s path (SQL selection with GRPO advantages, server-side cursor, array decoding,
  record mapping, Arrow conversion, Parquet writing), timed end to end;
- ``pyarrow-write``: the very table the export produced, already in memory, written with ``pq.write_table``
  (the cost of writing the arrays and nothing else; the target is export / this >= 0.5 in throughput);
- ``straight``: the same rows fetched with one plain query (psycopg, binary) and written with pyarrow without the
  exporter's layers: how much of the export is the database read;
- ``consumer``: a trainer's ``TrajectoryReader`` (a new consumer, slime samples) taking every trajectory in
  reads of 2,000 feed entries, each acknowledged: the exactly-once path, without a file.

Usage:

    python -m bench.export                      # 100,000 trajectories of 256 tokens, the figures in docs/benchmarks.md
    python -m bench.export --trajectories 10000 # a quicker run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.client.rows import PACKED, flat_ranges, mask_and_versions, spread, unpack
from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import CHUNK, libpq_url
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.services.exporter.export import export

PROMPT, TURNS, SAMPLED, OBS = 64, 4, 32, 16
LENGTH = PROMPT + TURNS * (SAMPLED + OBS)


def layout() -> tuple[list[int], list[float], list[int], list[list[int]]]:
    mask, ranges = [0] * PROMPT, []
    for _ in range(TURNS):
        ranges.append([len(mask), len(mask) + SAMPLED])
        mask += [1] * SAMPLED + [0] * OBS
    m = np.array(mask)
    lp = np.where(m == 1, -np.linspace(0.01, 3, LENGTH), 0.0).round(4).tolist()
    wv = np.where(m == 1, 5, -1).tolist()
    return mask, lp, wv, ranges


def seed(url: str, n: int, group: int = 8) -> float:
    """n trajectories of LENGTH tokens (64 distinct random token arrays), written server-side."""
    mask, lp, wv, ranges = layout()
    t0 = time.perf_counter()
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                     "request_hash) VALUES ('bench', 'bench', %s, %s, '{}', %s, %s, 'x')",
                     (group, TURNS, n // group, n))
        conn.execute(
            "INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status, attempt, "
            "reward, num_turns, weight_versions, prompt_text, started_at, finished_at) "
            "SELECT 'bench.' || (g / %(k)s) || '.' || (g %% %(k)s), 'bench', 'bench.' || (g / %(k)s), g %% %(k)s, "
            "g / %(k)s, 'bench', jsonb_build_object('seed', g / %(k)s), 'completed', 1, (g %% 3) / 2.0, %(turns)s, "
            "'{5}', 'a prompt of the benchmark', now(), now() FROM generate_series(0, %(n)s - 1) g",
            {"k": group, "n": n, "turns": TURNS})
        conn.execute(
            "WITH tmpl AS (SELECT k, tok, rl_pack_le(array_send(tok)) AS tok_le FROM (SELECT k, array(SELECT "
            "(random() * 49000)::int + k * 0 FROM generate_series(1, %(len)s)) AS tok FROM generate_series(0, 63) k) "
            "AS r), lp AS (SELECT %(lp)s::float4[] AS lp, "
            "rl_sampled_le(rl_pack_le(array_send(%(lp)s::float4[])), %(ranges)s::int4[]) AS lp_le) "
            "INSERT INTO trajectories (episode_id, episode_created_at, batch_id, group_id, env, attempt, status, "
            "reward, token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
            "num_sampled_tokens, num_turns, segments, token_ids_le, sampled_logprobs_le, action_versions) "
            "SELECT e.id, e.created_at, 'bench', e.group_id, 'bench', 1, 'completed', e.reward, t.tok, "
            "%(mask)s::int2[], lp.lp, %(wv)s::int4[], %(ranges)s::int4[], "
            "%(prompt)s, %(len)s, %(sampled)s, %(turns)s, ARRAY[ARRAY[0, %(len)s]], t.tok_le, lp.lp_le, "
            "array_fill(5, ARRAY[%(turns)s]) "
            "FROM episodes e JOIN tmpl t ON t.k = e.task_index %% 64 CROSS JOIN lp",
            {"len": LENGTH, "mask": mask, "lp": lp, "wv": wv, "ranges": ranges, "prompt": PROMPT,
             "sampled": TURNS * SAMPLED, "turns": TURNS})
    # settled as autovacuum would leave it (hint bits, visibility map, statistics), so that autovacuum does not
    # run over the fresh 100,000 rows in the middle of the measured runs (it did: 37 s of Postgres CPU in them)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - t0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds of this process so far (every thread; user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server_cpu_s(postmaster_pid: int | None) -> float:
    """CPU seconds of the Postgres backends that have exited (the postmaster's reaped children)."""
    if postmaster_pid is None:
        return float("nan")
    fields = Path(f"/proc/{postmaster_pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def child_export(url: str, out: Path, fmt: str, chunk: int) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), cpu_s()
    res = export(url, Selection(), out, fmt, chunk=chunk)
    return {"seconds": time.perf_counter() - t0, "cpu": cpu_s() - c0, "records": res.records,
            "bytes": out.stat().st_size, "peak_rss_mb": peak_rss_mb()}


def child_write(src: Path, out: Path) -> dict[str, Any]:
    table = pq.read_table(src)
    table = table.replace_schema_metadata(None)
    t0, c0 = time.perf_counter(), cpu_s()
    pq.write_table(table, out)
    return {"seconds": time.perf_counter() - t0, "cpu": cpu_s() - c0, "records": table.num_rows,
            "peak_rss_mb": peak_rss_mb()}


def child_straight(url: str, out: Path, chunk: int) -> dict[str, Any]:
    """The same arrays, one plain query, straight into pyarrow (no selection, records or advantages): the two
    packed arrays as read (the sampled logprobs laid on the action ranges), the other two rebuilt from the action
    ranges (as the export does)."""
    t0, c0 = time.perf_counter(), cpu_s()
    names = ("token_ids", "logprobs", "loss_mask", "weight_versions")
    schema = pa.schema([("episode_id", pa.string()), ("reward", pa.float64())]
                       + [(c, pa.list_(pa.float32() if c == "logprobs" else pa.int32())) for c in names])
    writer = pq.ParquetWriter(str(out), schema)
    count = 0
    with psycopg.connect(libpq_url(url)) as conn, conn.transaction(), \
            conn.cursor(name="straight", binary=True) as cur:
        cur.execute("SELECT episode_id, reward, token_ids_le, sampled_logprobs_le, action_ranges, action_versions "
                    "FROM trajectories")
        while rows := cur.fetchmany(chunk):
            tok, lengths = unpack([r[2] for r in rows], PACKED["token_ids"])
            sampled, _ = unpack([r[3] for r in rows], PACKED["logprobs"])
            lo, hi, vers = flat_ranges(lengths, [r[4] for r in rows], [r[5] for r in rows])
            total = int(lengths.sum())
            mask, wv = mask_and_versions(total, lo, hi, vers)
            lp = spread(total, lo, hi, sampled)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            cols: list[pa.Array] = [pa.array([r[0] for r in rows]), pa.array([r[1] for r in rows], pa.float64())]
            cols += [pa.ListArray.from_arrays(offsets, pa.array(a)) for a in (tok, lp, mask, wv)]
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
            count += len(rows)
    writer.close()
    return {"seconds": time.perf_counter() - t0, "cpu": cpu_s() - c0, "records": count, "peak_rss_mb": peak_rss_mb()}


def child_consumer(url: str, fmt: str, batch: int) -> dict[str, Any]:
    from rollout_ledger.client.reader import TrajectoryReader

    t0, c0 = time.perf_counter(), cpu_s()
    count = 0
    with TrajectoryReader(url, f"bench-{os.getpid()}", selection=Selection(), fmt=fmt, batch_size=batch) as reader:
        while (got := reader.next_batch()) is not None:
            count += got.table.num_rows
            got.ack()
    return {"seconds": time.perf_counter() - t0, "cpu": cpu_s() - c0, "records": count,
            "peak_rss_mb": peak_rss_mb()}


def run_once(postmaster_pid: int | None, *args: str) -> dict[str, Any]:
    """One run of one path in a fresh process, with the CPU seconds it took in its own process and in Postgres."""
    s0 = server_cpu_s(postmaster_pid)
    out = subprocess.run([sys.executable, "-m", "bench.export", "--child", *args], check=True,
                         capture_output=True, text=True)
    time.sleep(0.2)  # the backend exits after the client: let the postmaster reap it
    run = json.loads(out.stdout.strip().splitlines()[-1])
    return {**run, "server_cpu": server_cpu_s(postmaster_pid) - s0}


def run_rounds(repeat: int, postmaster_pid: int | None, paths: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """``repeat`` rounds of every path, one after the other within a round (a path and its baseline side by side:
    the machine's speed drifts between minutes, not between neighbouring runs). Each path's fastest run counts
    (peak RSS: the largest seen); ``all_seconds`` keeps every run, in round order."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, args in paths.items():
            runs[name].append(run_once(postmaster_pid, *args))
    out = {}
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"])
        out[name] = {**best, "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                     "all_seconds": [r["seconds"] for r in rs]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=CHUNK,
                    help="rows per chunk (default: the exporter's, ROLLOUT_EXPORT_CHUNK)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each path; the fastest counts (noisy machines)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "export":
            res = child_export(rest[0], Path(rest[1]), rest[2], args.chunk)
        elif kind == "write":
            res = child_write(Path(rest[0]), Path(rest[1]))
        elif kind == "consumer":
            res = child_consumer(rest[0], rest[1], int(rest[2]))
        else:
            res = child_straight(rest[0], Path(rest[1]), args.chunk)
        print(json.dumps(res))
        return
    n = args.trajectories
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}")
    with LocalInfra() as infra, tempfile.TemporaryDirectory(prefix="rl-bench-export-") as tmp:
        url = infra.database_url
        pid_file = infra.postgres.datadir / "postmaster.pid" if infra.postgres else None
        pm = int(pid_file.read_text().split()[0]) if pid_file and platform.system() == "Linux" else None
        upgrade(url)
        secs = seed(url, n)
        print(f"seeded {n:,} trajectories x {LENGTH} tokens in {secs:.1f}s")
        d = Path(tmp)
        results: dict[str, dict[str, Any]] = {}
        for fmt in ("parquet", "slime"):
            results.update(run_rounds(args.repeat, pm, {
                f"export {fmt}": ("export", url, str(d / f"{fmt}.parquet"), fmt),
                f"pyarrow-write {fmt}": ("write", str(d / f"{fmt}.parquet"), str(d / f"w-{fmt}.parquet"))}))
        results.update(run_rounds(args.repeat, pm, {
            "straight": ("straight", url, str(d / "straight.parquet")),
            "consumer slime": ("consumer", url, "slime", "2000")}))
        tokens = n * LENGTH
        print(f"{'path':<24}{'records':>10}{'seconds':>9}{'traj/s':>10}{'Mtok/s':>8}{'peak RSS MB':>13}"
              f"{'CPU s':>7}{'PG CPU s':>9}")
        for name, r in results.items():
            print(f"{name:<24}{r['records']:>10,}{r['seconds']:>9.2f}{n / r['seconds']:>10,.0f}"
                  f"{tokens / r['seconds'] / 1e6:>8.2f}{r['peak_rss_mb']:>13.0f}{r['cpu']:>7.2f}"
                  f"{r['server_cpu']:>9.2f}   runs: " + " ".join(f"{x:.2f}" for x in r["all_seconds"]))
        for fmt in ("parquet", "slime"):
            ratio = results[f"pyarrow-write {fmt}"]["seconds"] / results[f"export {fmt}"]["seconds"]
            rounds = [w / e for w, e in zip(results[f"pyarrow-write {fmt}"]["all_seconds"],
                                            results[f"export {fmt}"]["all_seconds"], strict=True)]
            print(f"throughput ratio export/pyarrow-write ({fmt}): {ratio:.2f} (target >= 0.5; fastest of each; "
                  "round by round: " + " ".join(f"{r:.2f}" for r in rounds) + ")")
        ratio = results["straight"]["seconds"] / results["export parquet"]["seconds"]
        print(f"throughput ratio export/straight (full record): {ratio:.2f}")
        print(f"peak RSS of the export: {max(results[f'export {f}']['peak_rss_mb'] for f in ('parquet', 'slime')):.0f}"
              " MB (target < 500)")


if __name__ == "__main__":
    main()
