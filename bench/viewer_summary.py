"""Viewer batch-summary cost: the reward histograms, failures and filter choices of one batch, counted in Postgres
(the viewer now: ``queries.batch_summary``, one grouped pass) and in Python (the baseline until 2026-11-26, kept
below as ``_baseline_summary``: every episode row of the batch fetched, then binned one at a time), side by side in
one run on batches of 10,000, 100,000 and 1,000,000 episodes.

Every round runs each way once, in turn; each way's fastest run counts, and both answers are checked equal before
any time is taken. Each way also reports the rows it brought back from Postgres. The episodes are synthetic: three
envs, a reward on most (a twentieth failed without one), one or two weight versions each, a small task JSON.

Usage (in ``make bench``; a private Postgres is started unless DATABASE_URL is set, where the batches
``bench-summary-*`` are replaced):

    python -m bench.viewer_summary                  # 10k, 100k and 1M episodes, 3 rounds
    python -m bench.viewer_summary --sizes 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from collections import Counter, defaultdict
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.client.source import libpq_url
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.services.scheduler.viewer import queries
from rollout_ledger.shared.db import create_engine, episodes
from rollout_ledger.shared.kit.settings import normalize_database_url

FILL = """
INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status, reward, weight_versions,
                      failure_class)
SELECT %(b)s || '-' || i, %(b)s, %(b)s || '-g' || (i / 8), i %% 8, i / 8, (ARRAY['math', 'tools', 'tau2'])[1 + i %% 3],
       jsonb_build_object('question', 'What is ' || i || ' + 30?', 'answer', (i + 30)::text),
       CASE WHEN i %% 20 = 0 THEN 'failed' ELSE 'completed' END,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE round(random()::numeric * 10) / 10 END,
       CASE WHEN i %% 7 = 0 THEN ARRAY[i * 4 / %(n)s, i * 4 / %(n)s + 1] ELSE ARRAY[i * 4 / %(n)s] END,
       CASE WHEN i %% 20 = 0 THEN 'env' END
FROM generate_series(0, %(n)s - 1) AS i
"""


def fill(database_url: str, batch_id: str, n: int) -> float:
    """Replace the batch ``batch_id`` with ``n`` synthetic episodes; returns the seconds it took."""
    started = time.perf_counter()
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute("DELETE FROM batches WHERE id = %s", (batch_id,))
        conn.execute("INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                     "request_hash) VALUES (%s, 'mixed', 8, 4, '{}', %s, %s, 'bench')", (batch_id, n // 8, n))
        conn.execute("SELECT setseed(0.19)")
        conn.execute(FILL, {"b": batch_id, "n": n})
        conn.execute("ANALYZE episodes")
    return time.perf_counter() - started


async def _baseline_summary(conn: AsyncConnection, batch_id: str) -> tuple[queries.BatchSummary, int]:
    """The viewer's summary until 2026-11-26: every episode row fetched, binned in Python."""
    rows = (await conn.execute(
        select(episodes.c.env, episodes.c.status, episodes.c.reward, episodes.c.weight_versions,
               episodes.c.failure_class).where(episodes.c.batch_id == batch_id))).all()
    rewarded = [(env, float(reward), queries.version_label(versions)) for env, _, reward, versions, _ in rows
                if reward is not None]
    edges = queries.bin_edges([r for _, r, _ in rewarded])
    grouped: dict[tuple[str, str], list[float]] = defaultdict(list)
    for env, reward, label in rewarded:
        grouped[(env, label)].append(reward)
    histograms = []
    for (env, label), values in sorted(grouped.items()):
        counts = [0] * (len(edges) - 1)
        for v in values:
            counts[queries.bin_of(edges, v)] += 1
        histograms.append(queries.Histogram(env, label, counts, len(values), sum(values) / len(values)))
    failures = Counter(fc or "unknown" for _, status, _, _, fc in rows if status == "failed")
    versions = sorted({int(v) for *_, vs, _ in rows for v in (vs or ())})
    return queries.BatchSummary(edges=edges, histograms=histograms, failures=dict(failures),
                                attempt_failures=await queries.attempt_failures_by_class(conn, batch_id),
                                envs=sorted({r[0] for r in rows}),
                                versions=versions, statuses=dict(Counter(r[1] for r in rows))), len(rows)


def _same(a: queries.BatchSummary, b: queries.BatchSummary) -> bool:
    """Equal, the means to 1e-9 (Postgres and Python add the rewards in different orders)."""
    def shape(s: queries.BatchSummary) -> Any:
        return (s.edges, [(h.env, h.version, h.counts, h.n) for h in s.histograms], s.failures, s.attempt_failures,
                s.envs, s.versions, s.statuses)
    return shape(a) == shape(b) and all(abs(x.mean - y.mean) < 1e-9 for x, y in zip(a.histograms, b.histograms,
                                                                                      strict=True))


async def measure(database_url: str, batch_id: str, rounds: int) -> dict[str, Any]:
    engine = create_engine(normalize_database_url(database_url))
    try:
        async with engine.connect() as conn:
            sql = await queries.batch_summary(conn, batch_id)
            python, rows = await _baseline_summary(conn, batch_id)
            if not _same(sql, python):
                raise SystemExit(f"the two summaries of {batch_id} differ:\n{sql}\n{python}")
            groups = len((await conn.execute(queries._SUMMARY_GROUPS, {
                "batch_id": batch_id, "low": sql.edges[0], "high": sql.edges[-1],
                "bins": len(sql.edges) - 1})).all())
            times: dict[str, list[float]] = {"python": [], "sql": []}
            for _ in range(rounds):
                for way in ("python", "sql"):
                    started = time.perf_counter()
                    if way == "python":
                        await _baseline_summary(conn, batch_id)
                    else:
                        await queries.batch_summary(conn, batch_id)
                    times[way].append(time.perf_counter() - started)
                await conn.rollback()
    finally:
        await engine.dispose()
    return {"times": times, "rows_python": rows, "rows_sql": groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="episodes per batch")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each way; the fastest counts (noisy machines)")
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
          f"psycopg {psycopg.__version__} ({psycopg.pq.__impl__})")
    with LocalInfra() as infra:
        upgrade(infra.database_url)
        with psycopg.connect(libpq_url(infra.database_url)) as conn:
            print(f"postgres: {conn.execute('SHOW server_version').fetchone()[0]}")  # type: ignore[index]
        print(f"{'episodes':>10} | {'python (baseline)':>18} | {'sql (viewer)':>13} | {'ratio':>6} | "
              f"{'rows back python/sql':>21} | rounds python/sql")
        for n in args.sizes:
            batch_id = f"bench-summary-{n}"
            fill(infra.database_url, batch_id, n)
            r = asyncio.run(measure(infra.database_url, batch_id, args.rounds))
            py, sq = min(r["times"]["python"]), min(r["times"]["sql"])
            rounds = " ".join(f"{p / s:.1f}" for p, s in zip(r["times"]["python"], r["times"]["sql"], strict=True))
            print(f"{n:>10,} | {py * 1000:>15,.0f} ms | {sq * 1000:>10,.0f} ms | {py / sq:>5.1f}x | "
                  f"{r['rows_python']:>10,} / {r['rows_sql']:<8,} | {rounds}", flush=True)


if __name__ == "__main__":
    main()
