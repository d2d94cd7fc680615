"""`rollout demo` / `make demo`: the whole system on this machine, one demo run end to end, then a clean stop.
`rollout demo --rl` / `make demo-rl`: the same stack on vLLM, and the GRPO trainer example (examples/grpo/train.py)
learning from it for a few policy versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

from rollout_ledger.cli.client import SchedulerClient, viewer_link
from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.exporter.export import export_batch
from rollout_ledger.shared.kit.settings import default_model_dir


@dataclass(frozen=True)
class DemoBatch:
    """One demo batch: an environment, its tasks, and the turn and token budgets."""

    env: str
    share: float
    """Tasks per ``--num-tasks``."""
    max_turns: int
    max_tokens: int
    tasks: Callable[[int], list[dict[str, Any]]] = field(default=lambda n: [{"seed": i} for i in range(n)])
    """The first ``n`` tasks (default: ``{"seed": i}``)."""


RG_CONFIG: dict[str, Any] = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}
"""reasoning-gym's basic_arithmetic at its easiest: single-digit sums and differences."""

DEMO_BATCHES: tuple[DemoBatch, ...] = (
    DemoBatch("arithmetic", 1.0, 1, 32),
    DemoBatch("guess-number", 1.0, 6, 16),
    DemoBatch("retail-orders", 0.5, 6, 64),
    # tau2-bench retail: tau2's tasks, policy, tools and evaluator; its customer is tau2's user simulator on the
    # same inference worker (unrecorded requests), its messages observations (mask 0)
    DemoBatch("tau2:retail", 0.5, 3, 48, tasks=lambda n: [{"task_id": str(i)} for i in range(n)]),
    # reasoning-gym; 4 solved examples first teach a 135M model the <answer> format
    DemoBatch("rg:basic_arithmetic", 2.0, 1, 32,
              tasks=lambda n: [{"config": RG_CONFIG, "seed": 0, "index": i, "shots": 4} for i in range(n)]),
)
"""One batch per environment: single-turn, multi-turn, tool calling (Hermes ``<tool_call>``), tau2-bench retail
with its LLM-simulated user, and a reasoning-gym dataset."""

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


def demo_batches(num_tasks: int) -> list[tuple[DemoBatch, list[dict[str, Any]]]]:
    """Each demo batch with its tasks."""
    return [(b, b.tasks(max(1, round(num_tasks * b.share)))) for b in DEMO_BATCHES]


def run_demo(num_tasks: int = 4, group_size: int = 4, out: Path = Path("exports"), engine: str = "vllm",
             console: Console | None = None, stay: bool = False) -> int:
    """Run the demo; 0 when every submitted episode has its trajectory in Postgres. ``stay``: keep the stack up
    after the summary (for the viewer's links) until Ctrl-C."""
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
        client = SchedulerClient(stack.scheduler_url, stack.api_token)
        batch_ids: list[str] = []
        labels: list[str] = []
        submitted = 0
        t_run = time.monotonic()
        for batch, tasks in demo_batches(num_tasks):
            body = client.submit(env=batch.env, tasks=tasks, group_size=group_size, max_turns=batch.max_turns,
                                 sampling={"temperature": 1.0, "max_tokens": batch.max_tokens})
            batch_ids.append(body["batch_id"])
            labels.append(f"{batch.env:<19}")
            submitted += body["num_episodes"]
            console.print(f"submitted {body['num_episodes']:>3} {batch.env} episodes ({len(tasks)} tasks x "
                          f"group_size {group_size}, max_turns {batch.max_turns}) as batch {body['batch_id']}")
        client.follow_all(batch_ids, console=console, timeout_s=1800, labels=labels)
        wall = time.monotonic() - t_run
        reader_url = stack.infra.database_logins.get("exporter", stack.infra.database_url)  # the read-only login
        rows, total_trajectories = _summary(reader_url, batch_ids)
        _print_summary(console, rows, wall)
        out.mkdir(parents=True, exist_ok=True)
        for batch_id in batch_ids:
            result = export_batch(reader_url, batch_id, out, "jsonl")
            console.print(f"exported {result.records} trajectories -> [bold]{result.path.resolve()}[/bold]")
        console.print("\nTry SQL against the store while `make up` runs (psql \"$DATABASE_URL\"; "
                      "`rollout up` prints the URL):")
        console.print(EXAMPLE_SQL, markup=False, highlight=False)
        console.print("See the trajectories token by token in the viewer" + (
            ":" if stay else " (`rollout demo --stay` keeps the stack up to browse them):"))
        for batch_id in batch_ids:
            console.print(f"  {viewer_link(stack.scheduler_url, f'/batch/{batch_id}', stack.api_token)}",
                          markup=False, highlight=False, soft_wrap=True)
        if stay:
            console.print("the stack stays up for the viewer: Ctrl-C stops everything.")
            stack.wait_forever()
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


def _demo_console(console: Console | None) -> Console:
    if console is not None:
        return console
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _run_trainer(stack: DevStack, console: Console, script: Path, args: list[str],
                 metrics: Path) -> tuple[int, list[dict[str, Any]]]:
    """Run a trainer example against ``stack`` (its URLs, the model, the API token given), its output streamed to
    ``console``; its exit code and the JSON lines it wrote to ``metrics``."""
    model = os.environ.get("ROLLOUT_MODEL") or str(default_model_dir())
    cmd = [sys.executable, str(script), "--scheduler-url", stack.scheduler_url,
           "--database-url", stack.infra.database_url, "--model", model, *args, "--metrics-out", str(metrics)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "ROLLOUT_API_TOKEN": stack.api_token}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            console.print(line.rstrip(), markup=False, highlight=False, soft_wrap=True)
        code = proc.wait()
    results = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, results


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""The checkout's examples (not part of the installed package): the trainers the demos run."""
RL_TRAINER = EXAMPLES / "grpo" / "train.py"
"""The trainer ``rollout demo --rl`` runs."""
TRL_TRAINER = EXAMPLES / "trl" / "train.py"
"""The trainer ``rollout demo --trl`` runs."""


def _trainer_stack(stack: DevStack | None, engine: str, console: Console) -> AbstractContextManager[DevStack]:
    """``stack`` as it is (it keeps running after the trainer), or a new one on ``engine`` (float32 for vLLM: the
    trainer's recomputation and the engine then agree to ~1e-5), stopped after the trainer."""
    if stack is not None:
        return nullcontext(stack)
    extra_env = {"ROLLOUT_VLLM_DTYPE": os.environ.get("ROLLOUT_VLLM_DTYPE", "float32")}
    return DevStack(scheduler_port=None, engine=engine, echo=console.print, extra_env=extra_env)

_RL_COLUMNS = ("iteration", "version", "episodes", "mean_reward", "staleness", "gap_mean", "gap_max", "train_s",
               "serve_s")


def run_rl_demo(iterations: int = 6, num_tasks: int = 8, group_size: int = 4, console: Console | None = None,
                trainer_args: tuple[str, ...] = (),
                inspect: Callable[[DevStack, list[dict[str, Any]]], None] | None = None,
                stack: DevStack | None = None) -> int:
    """Start the stack on vLLM (or use ``stack``, running) and run ``iterations`` of the GRPO trainer against it,
    each on ``num_tasks`` x ``group_size`` episodes; 0 when every iteration ran. The trainer starts from the version
    the workers serve. ``inspect`` (tests) gets the stack and the iterations' metrics before a started stack stops."""
    console = _demo_console(console)
    if not RL_TRAINER.is_file():
        console.print(f"[red]the trainer example is not here ({RL_TRAINER}): run `rollout demo --rl` from a "
                      "checkout of the repository[/red]")
        return 2
    t0 = time.monotonic()
    console.print(f"[bold]Rollout Ledger closed-loop demo[/bold] — GRPO on SmolLM2-135M-Instruct, trainer and vLLM "
                  f"on the CPU: {iterations} iterations of {num_tasks} single-digit additions x {group_size} samples")
    code = 1
    with _trainer_stack(stack, "vllm", console) as running:
        console.print(f"services up in {time.monotonic() - t0:.1f}s\n{running.describe().rsplit(chr(10), 1)[0]}")
        t_train = time.monotonic()
        out = Path(tempfile.mkdtemp(prefix="grpo-", dir=running.infra.root))
        code, results = _run_trainer(running, console, RL_TRAINER, [
            "--out", str(out / "checkpoints"), "--iterations", str(iterations),
            "--num-tasks", str(num_tasks), "--group-size", str(group_size), *trainer_args], out / "metrics.jsonl")
        _print_rl_summary(console, results, time.monotonic() - t_train)
        if inspect is not None:
            inspect(running, results)
    ok = code == 0 and len(results) == iterations
    verdict = "[green]ok[/green]" if ok else f"[red]the trainer stopped (exit {code})[/red]"
    console.print(f"\n{len(results)}/{iterations} iterations: {verdict}; demo took {time.monotonic() - t0:.1f}s"
                  + (", everything stopped." if stack is None else "."))
    return 0 if ok else 1


_TRL_COLUMNS = ("step", "batch_id", "mean_reward", "sampled_tokens", "sampled_by", "published", "wait_s", "serve_s",
                "step_s")


def run_trl_demo(steps: int = 6, num_tasks: int = 8, group_size: int = 4, console: Console | None = None,
                 trainer_args: tuple[str, ...] = (), engine: str = "vllm",
                 inspect: Callable[[DevStack, list[dict[str, Any]]], None] | None = None,
                 stack: DevStack | None = None) -> int:
    """Start the stack on ``engine`` (or use ``stack``, running) and train SmolLM2 with the real TRL
    ``GRPOTrainer`` fed by the ledger (examples/trl/train.py, the client package's TRL adapter) for ``steps``
    optimizer steps; prints the reward per step; 0 when every step ran. ``inspect`` (tests) gets the stack and the
    steps before a started stack stops."""
    console = _demo_console(console)
    try:
        import trl  # noqa: F401
    except ImportError:
        console.print("[red]TRL is not installed: pip install 'rollout-ledger[trl]' (make install has it)[/red]")
        return 2
    if not TRL_TRAINER.is_file():
        console.print(f"[red]the TRL example is not here ({TRL_TRAINER}): run `rollout demo --trl` from a "
                      "checkout of the repository[/red]")
        return 2
    t0 = time.monotonic()
    console.print(f"[bold]Rollout Ledger + TRL[/bold] — TRL's GRPOTrainer trains SmolLM2-135M-Instruct on the CPU "
                  f"from the ledger: {steps} steps of {num_tasks} single-digit additions x {group_size} samples")
    code = 1
    results: list[dict[str, Any]] = []
    with _trainer_stack(stack, engine, console) as running:
        console.print(f"services up in {time.monotonic() - t0:.1f}s\n{running.describe().rsplit(chr(10), 1)[0]}")
        t_train = time.monotonic()
        out = Path(tempfile.mkdtemp(prefix="trl-", dir=running.infra.root))
        code, results = _run_trainer(running, console, TRL_TRAINER, [
            "--out", str(out), "--steps", str(steps), "--num-tasks", str(num_tasks),
            "--group-size", str(group_size), *trainer_args], out / "metrics.jsonl")
        table = Table(title="TRL on the ledger (reward per step)")
        for col in _TRL_COLUMNS:
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(*(_cell(r.get(c)) for c in _TRL_COLUMNS))
        console.print(table)
        console.print(f"{time.monotonic() - t_train:.0f}s of training (generate on the ledger, read through the "
                      "consumer cursor, TRL's step, save, publish, every worker serving)")
        if inspect is not None:
            inspect(running, results)
    ok = code == 0 and len(results) == steps
    verdict = "[green]ok[/green]" if ok else f"[red]the trainer stopped (exit {code})[/red]"
    console.print(f"\n{len(results)}/{steps} steps: {verdict}; demo took {time.monotonic() - t0:.1f}s"
                  + (", everything stopped." if stack is None else "."))
    return 0 if ok else 1


def _print_rl_summary(console: Console, results: list[dict[str, Any]], wall_s: float) -> None:
    table = Table(title="closed loop (the trainer's metrics)")
    for col in _RL_COLUMNS:
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(*(_cell(r[c]) for c in _RL_COLUMNS))
    console.print(table)
    if results:
        first, last = results[0], results[-1]
        console.print(f"policy v{first['version']} -> v{last['pushed_version']}; mean reward "
                      f"{first['mean_reward']:.3f} -> {last['mean_reward']:.3f}; {wall_s:.0f}s of training loop "
                      "(generate, read through the consumer cursor, train, save, push, every worker serving)")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1e}" if abs(value) < 1e-2 and value != 0 else f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)
