"""`rollout demo` / `make demo`: the whole system on this machine, one demo run end to end, then a clean stop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.client import SchedulerClient
from rollout_ledger.services.devstack import DevStack
from rollout_ledger.services.exporter.export import export_batch

DEMO_BATCHES = (
    # env, max_turns, max_tokens, tasks(n)
    ("arithmetic", 1, 32),
    ("guess-number", 6, 16),
)

SUMMARY_SQL = """
select e.env,
       count(*)                                              as episodes,
       count(*) filter (where e.status = 'completed')        as completed,
       count(*) filter (where e.status = 'truncated')        as truncated,
       count(*) filter (where e.status = 'failed')           as failed,
       round(avg(e.reward)::numeric, 3)                      as mean_reward,
       coalesce(sum(t.num_turns), 0)                         as turns,
       coalesce(sum(t.num_sampled_tokens), 0)                as sampled_tokens,
       count(t.episode_id)                                   as trajectories
from episodes e left join trajectories t on t.episode_id = e.id
where e.batch_id = any(:batches)
group by e.env order by e.env
"""

EXAMPLE_SQL = (
    "select env, status, count(*), avg(reward) from episodes group by 1, 2;\n"
    "select episode_id, num_tokens, num_sampled_tokens, reward from trajectories order by reward desc limit 5;"
)


def run_demo(num_tasks: int = 8, group_size: int = 4, out: Path = Path("exports"), engine: str = "fake",
             console: Console | None = None) -> int:
    """Run the demo; 0 when every submitted episode has its trajectory in Postgres."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
    t0 = time.monotonic()
    hint = " (zero-cost, scripted; ROLLOUT_ENGINE=vllm runs the real model)" if engine == "fake" else ""
    console.print(f"[bold]Rollout Ledger demo[/bold] — engine: {engine}{hint}")
    with DevStack(scheduler_port=None, engine=engine, echo=console.print) as stack:
        console.print(f"services up in {time.monotonic() - t0:.1f}s\n{stack.describe().rsplit(chr(10), 1)[0]}")
        client = SchedulerClient(stack.scheduler_url)
        batch_ids: list[str] = []
        submitted = 0
        t_run = time.monotonic()
        for env, max_turns, max_tokens in DEMO_BATCHES:
            body = client.submit(env=env, tasks=[{"seed": i} for i in range(num_tasks)], group_size=group_size,
                                 max_turns=max_turns, sampling={"temperature": 1.0, "max_tokens": max_tokens})
            batch_ids.append(body["batch_id"])
            submitted += body["num_episodes"]
            console.print(f"submitted {body['num_episodes']} {env} episodes as batch {body['batch_id']}")
        for batch_id in batch_ids:
            client.follow(batch_id, console=console, timeout_s=600)
        wall = time.monotonic() - t_run
        rows, total_trajectories = _summary(stack.infra.database_url, batch_ids)
        _print_summary(console, rows, wall)
        out.mkdir(parents=True, exist_ok=True)
        for batch_id in batch_ids:
            result = export_batch(stack.infra.database_url, batch_id, out, "jsonl")
            console.print(f"exported {result.records} trajectories -> [bold]{result.path.resolve()}[/bold]")
        console.print("\nTry SQL against the store while `rollout up` runs (psql \"$DATABASE_URL\"):")
        console.print(EXAMPLE_SQL, markup=False)
    ok = total_trajectories == submitted
    verdict = "[green]ok[/green]" if ok else "[red]MISSING TRAJECTORIES[/red]"
    console.print(f"\n{total_trajectories}/{submitted} trajectories stored: {verdict}; "
                  f"demo took {time.monotonic() - t0:.1f}s, everything stopped.")
    return 0 if ok else 1


def _summary(database_url: str, batch_ids: list[str]) -> tuple[list[dict[str, Any]], int]:
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(text(SUMMARY_SQL), {"batches": batch_ids})]
            total = conn.execute(text("select count(*) from trajectories where batch_id = any(:b)"),
                                 {"b": batch_ids}).scalar_one()
    finally:
        engine.dispose()
    return rows, int(total)


def _print_summary(console: Console, rows: list[dict[str, Any]], wall_s: float) -> None:
    table = Table(title="demo summary")
    for col in ("env", "episodes", "completed", "truncated", "failed", "mean_reward", "turns", "sampled_tokens",
                "trajectories"):
        table.add_column(col, justify="left" if col == "env" else "right")
    tokens = 0
    for row in rows:
        tokens += int(row["sampled_tokens"])
        table.add_row(*(str(row[c]) for c in ("env", "episodes", "completed", "truncated", "failed", "mean_reward",
                                               "turns", "sampled_tokens", "trajectories")))
    console.print(table)
    console.print(f"generated {tokens} tokens in {wall_s:.1f}s ({tokens / max(wall_s, 1e-9):.0f} tok/s end to end)")
