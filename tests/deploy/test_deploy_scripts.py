"""The commands the manifests run, against real Postgres: the export-batches CronJob's script, the exporter
Deployment's `rollout export --consumer --follow` and the wait-schema init container."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, insert
from sqlalchemy.engine import make_url

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.migrations.runner import sync_url, wait_for_schema
from rollout_ledger.services import catalog
from rollout_ledger.shared import deploy
from rollout_ledger.shared.db import batches, episodes
from rollout_ledger.shared.errors import RolloutError
from tests.deploy.manifests import K8S
from tests.helpers import wait_for
from tests.integration.export_data import Traj, consumer_claimed, seed_batch

SCRIPT = K8S / "base" / "export_finished.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("export_finished", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_batch(database_url: str, batch_id: str, statuses: list[str]) -> None:
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            conn.execute(insert(batches).values(
                id=batch_id, env="arithmetic", group_size=len(statuses), max_turns=1, sampling={}, num_tasks=1,
                num_episodes=len(statuses), request_hash="0" * 64))
            conn.execute(insert(episodes), [
                {"id": f"{batch_id}.0.{i}", "batch_id": batch_id, "group_id": f"{batch_id}.0", "group_index": i,
                 "task_index": 0, "env": "arithmetic", "task": {"seed": 0}, "status": status}
                for i, status in enumerate(statuses)
            ])
    finally:
        engine.dispose()


def test_exporter_script_writes_each_finished_batch_once(database_url: str, tmp_path: Path) -> None:
    script = load_script()
    add_batch(database_url, "done", ["completed", "failed", "cancelled"])
    add_batch(database_url, "busy", ["completed", "running"])
    assert script.finished_batches(database_url) == ["done"]
    written = script.export_new(database_url, tmp_path, "jsonl")
    assert written == [tmp_path / "done.jsonl"]
    assert written[0].is_file()
    assert script.export_new(database_url, tmp_path, "jsonl") == [], "a batch already exported is skipped"


def test_exporter_script_refuses_bad_arguments() -> None:
    assert load_script().main(["export_finished.py", "/exports", "csv"]) == 2


async def test_wait_schema_returns_on_a_migrated_database(database_url: str) -> None:
    await wait_for_schema(database_url, timeout_s=10)


async def test_wait_schema_gives_up_after_its_timeout(database_url: str) -> None:
    missing = make_url(database_url).set(database="no_such_database").render_as_string(hide_password=False)
    with pytest.raises(RolloutError):
        await wait_for_schema(missing, timeout_s=0.5, interval_s=0.1)


def test_wait_schema_command_exit_codes(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from rollout_ledger.cli.main import app

    runner = CliRunner()
    monkeypatch.setenv("DATABASE_URL", database_url)
    assert runner.invoke(app, [*deploy.WAIT_SCHEMA_ARGS, "--timeout", "5"]).exit_code == 0
    missing = make_url(database_url).set(database="no_such_database").render_as_string(hide_password=False)
    monkeypatch.setenv("DATABASE_URL", missing)
    assert runner.invoke(app, [*deploy.WAIT_SCHEMA_ARGS, "--timeout", "0.3"]).exit_code == 1


async def test_streams_and_buckets_take_their_replicas_from_the_setting(
    nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_ledger.shared.kit import bus
    from rollout_ledger.shared.subjects import CANCEL_BUCKET, STREAMS

    monkeypatch.setenv("ROLLOUT_STREAM_REPLICAS", "1")
    assert bus.stream_replicas(None) == 1
    assert bus.stream_replicas(3) == 3
    js = nc.jetstream()
    await bus.ensure_topology(js)
    for spec in STREAMS:
        assert (await js.stream_info(spec.name)).config.num_replicas == 1
    assert (await js.stream_info(f"KV_{CANCEL_BUCKET}")).config.num_replicas == 1
    monkeypatch.setenv("ROLLOUT_STREAM_REPLICAS", "0")
    with pytest.raises(ValueError):
        bus.stream_replicas(None)


def test_exporter_deployment_command_one_reader_and_sigterm(database_url: str, tmp_path: Path) -> None:
    """The exporter Deployment's exact arguments: files land; a second replica exits 1 at once; SIGTERM exits 0."""
    workload = catalog.WORKLOADS["exporter"]
    args = list(workload.args)
    out = tmp_path / deploy.EXPORT_CONSUMER
    args[args.index("--out") + 1] = str(out)
    cmd = [sys.executable, "-m", "rollout_ledger.cli.main", *args]
    env = dict(os.environ, DATABASE_URL=database_url, ROLLOUT_EXPORT_POLL_S="0.05", ROLLOUT_LOG_FORMAT="json",
               ROLLOUT_HTTP_HOST="127.0.0.1")  # each pod has its own port 8000: here, a free port each
    port = free_port()
    seed_batch(database_url, "k8s", [[Traj(), Traj()]])
    first = subprocess.Popen(cmd, env={**env, "ROLLOUT_HTTP_PORT": str(port)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list(out.glob(f"{deploy.EXPORT_CONSUMER}.*.parquet"))) == 1, 60, "a delivery file")
        wait_for(lambda: consumer_claimed(database_url, deploy.EXPORT_CONSUMER), 30, "the consumer's lock")
        ready = httpx.get(f"http://127.0.0.1:{port}{deploy.READINESS_PATH}", timeout=5)
        assert ready.status_code == 200, ready.text
        second = subprocess.run(cmd, env={**env, "ROLLOUT_HTTP_PORT": str(free_port())}, capture_output=True,
                                text=True, timeout=60, check=False)
        assert second.returncode == 1
        assert f"consumer '{deploy.EXPORT_CONSUMER}' is being read by another process" in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert not list(out.glob("*.partial"))
