"""`rollout demo` / `make demo`: the whole system on this machine, one demo run end to end, then a clean stop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

from rollout_ledger.cli.client import SchedulerClient
from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.exporter.export import export_batch

DEMO_BATCHES = (
    # env, tasks per `--num-tasks` (fraction), max_turns, max_tokens
    ("arithmetic", 1.0, 1, 32),
    ("guess-number", 1.0, 6, 16),
    ("retail-orders", 0.5, 6, 64),
)
"""One batch per environment: single-turn, multi-turn, and tool calling (Hermes ``<tool_call>``)."""

SUMMARY_SQL = """
with kept_turns as (
    select t.episode_id, t.prompt_len, coalesce(t.cached_tokens, 0) as cached
    from turns t join episodes e on e.id = t.episode_id
    where e.batch_id = any(:batches) and not t.superseded
)
select e.env,
       count(*)                                              as episodes,
       count(*) filter (where e.status = 'completed')        as completed,
       count(*) filter (where e.status = 'truncated')        as truncated,
       count(*) filter (where e.status = 'aborted')          as aborted,
       count(*) filter (where e.status = 'failed')           as failed,
       round(avg(e.reward)::numeric, 3)                      as mean_reward,
       coalesce(sum(t.num_turns), 0)                         as turns,
       coalesce(sum(t.num_sampled_tokens), 0)                as sampled_tokens,
       count(*) filter (where t.token_check = 'ok')          as token_exact,
       (select coalesce(sum(k.cached), 0) from kept_turns k join episodes e2 on e2.id = k.episode_id
         where e2.env = e.env)                               as cached_tokens,
       (select coalesce(sum(k.prompt_len), 0) from kept_turns k join episodes e2 on e2.id = k.episode_id
         where e2.env = e.env)                               as prompt_tokens
from episodes e left join trajectories t on t.episode_id = e.id
where e.batch_id = any(:batches)
group by e.env order by e.env
"""

EXAMPLE_SQL = """\
-- episodes by environment and status, with the mean reward
select env, status, count(*), round(avg(reward)::numeric, 3) as mean_reward from episodes group by 1, 2 order by 1, 2;
-- the sampled tokens of one trajectory and their logprobs, position by position
select i - 1 as pos, token_ids[i] as token, logprobs[i] as logprob
from trajectories, generate_subscripts(token_ids, 1) as i
where loss_mask[i] = 1 limit 10;
-- prefix-cache hits per turn index (session-sticky routing keeps them high on multi-turn episodes)
select turn_index, count(*), round(100.0 * sum(cached_tokens) / nullif(sum(prompt_len), 0), 1) as cache_hit_pct
from turns where not superseded group by 1 order by 1;"""

_COLUMNS = ("env", "episodes", "completed", "truncated", "aborted", "failed", "mean_reward", "turns",
            "sampled_tokens", "token_exact", "cache_hit")


def demo_batches(num_tasks: int) -> list[tuple[str, int, int, int]]:
    """(env, tasks, max_turns, max_tokens) of each demo batch."""
    return [(env, max(1, round(num_tasks * share)), turns, tokens) for env, share, turns, tokens in DEMO_BATCHES]


def run_demo(num_tasks: int = 4, group_size: int = 4, out: Path = Path("exports"), engine: str = "vllm",
             console: Console | None = None) -> int:
    """Run the demo; 0 when every submitted episode has its trajectory in Postgres."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
    t0 = time.monotonic()
    hint = (" (a zero-cost scripted fake; `make demo` runs the real model)" if engine == "fake"
            else " (SmolLM2-135M-Instruct on vLLM; the engine loads in 30-60 s on a CPU)")
    console.print(f"[bold]Rollout Ledger demo[/bold] — engine: {engine}{hint}")
    with DevStack(scheduler_port=None, engine=engine, echo=console.print) as stack:
        console.print(f"services up in {time.monotonic() - t0:.1f}s\n{stack.describe().rsplit(chr(10), 1)[0]}")
        client = SchedulerClient(stack.scheduler_url)
        batch_ids: list[str] = []
        labels: list[str] = []
        submitted = 0
        t_run = time.monotonic()
        for env, tasks, max_turns, max_tokens in demo_batches(num_tasks):
            body = client.submit(env=env, tasks=[{"seed": i} for i in range(tasks)], group_size=group_size,
                                 max_turns=max_turns, sampling={"temperature": 1.0, "max_tokens": max_tokens})
            batch_ids.append(body["batch_id"])
            labels.append(f"{env:<14}")
            submitted += body["num_episodes"]
            console.print(f"submitted {body['num_episodes']:>3} {env} episodes ({tasks} tasks x group_size "
                          f"{group_size}, max_turns {max_turns}) as batch {body['batch_id']}")
        client.follow_all(batch_ids, console=console, timeout_s=1800, labels=labels)
        wall = time.monotonic() - t_run
        rows, total_trajectories = _summary(stack.infra.database_url, batch_ids)
        _print_summary(console, rows, wall)
        out.mkdir(parents=True, exist_ok=True)
        for batch_id in batch_ids:
            result = export_batch(stack.infra.database_url, batch_id, out, "jsonl")
            console.print(f"exported {result.records} trajectories -> [bold]{result.path.resolve()}[/bold]")
        console.print("\nTry SQL against the store while `make up` runs (psql \"$DATABASE_URL\"; "
                      "`rollout up` prints the URL):")
        console.print(EXAMPLE_SQL, markup=False, highlight=False)
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
    table = Table(title="demo summary (from SQL)")
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col == "env" else "right")
    tokens = cached = prompt = 0
    for row in rows:
        tokens += int(row["sampled_tokens"])
        cached += int(row["cached_tokens"])
        prompt += int(row["prompt_tokens"])
        row["cache_hit"] = _pct(int(row["cached_tokens"]), int(row["prompt_tokens"]))
        table.add_row(*(str(row[c]) for c in _COLUMNS))
    console.print(table)
    console.print(f"generated {tokens} tokens in {wall_s:.1f}s ({tokens / max(wall_s, 1e-9):.0f} tok/s end to end); "
                  f"prefix cache hit rate {_pct(cached, prompt)} of prompt tokens; token_exact = trajectories whose "
                  "ids (the sampled ones, never re-tokenised) decode, with the template's closing text, to its "
                  "rendering of the conversation (README)")


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"
