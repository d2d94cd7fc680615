"""`rollout export --consumer NAME --follow` with ``ROLLOUT_HTTP_PORT`` set (as the Deployment runs it): /readyz once
the cursor is open, /metrics counting what was delivered, /healthz failing while a read hangs and recovering when
it ends, a clean exit on SIGTERM; without the variable it serves nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import psycopg

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.client.source import libpq_url
from tests.helpers import wait_for
from tests.integration.export_data import Traj, consumer_claimed, delivered, seed_batch


def metric(base: str, name: str) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    m = re.search(rf'^{name}\{{consumer="ops"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def start(database_url: str, out: Path, **env: str) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if k != "ROLLOUT_HTTP_PORT"}
    full.update(DATABASE_URL=database_url, ROLLOUT_EXPORT_POLL_S="0.05", ROLLOUT_LOG_FORMAT="json", **env)
    cmd = [sys.executable, "-m", "rollout_ledger.cli.main", "export", "--consumer", "ops", "--follow",
           "--format", "jsonl", "--out", str(out)]
    return subprocess.Popen(cmd, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_following_exporter_serves_health_and_metrics(database_url: str, tmp_path: Path) -> None:
    seed_batch(database_url, "h0", [[Traj(), Traj(), Traj()] for _ in range(2)])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(database_url, tmp_path / "out", ROLLOUT_HTTP_PORT=str(port), ROLLOUT_HTTP_HOST="127.0.0.1",
                 ROLLOUT_EXPORT_STALL_S="1.5")
    try:
        wait_for(lambda: status(f"{base}/readyz") == 200, 60, "/readyz 200")
        wait_for(lambda: metric(base, "rollout_export_records_total") == 6, 30, "6 records counted")
        seed_batch(database_url, "h1", [[Traj(), Traj()]])
        wait_for(lambda: metric(base, "rollout_export_records_total") == 8, 30, "8 records counted")
        assert metric(base, "rollout_export_deliveries_total") == 2
        assert (metric(base, "rollout_export_last_delivery_timestamp_seconds") or 0) > 0
        assert len(delivered(tmp_path / "out")) == 8
        health = httpx.get(f"{base}/healthz", timeout=5)
        assert health.status_code == 200 and health.json()["live"] == {"reading": True}

        # a read that hangs (the feed locked by another session) fails liveness after ROLLOUT_EXPORT_STALL_S
        with psycopg.connect(libpq_url(database_url)) as lock:
            lock.execute("LOCK TABLE trajectory_feed IN ACCESS EXCLUSIVE MODE")
            wait_for(lambda: status(f"{base}/healthz") == 503, 30, "/healthz 503 while the read hangs")
            assert httpx.get(f"{base}/healthz", timeout=5).json()["live"] == {"reading": False}
        wait_for(lambda: status(f"{base}/healthz") == 200, 30, "/healthz 200 once the read went through")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert status(f"{base}/healthz") is None  # the HTTP server stopped with the process
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_an_http_port_nothing_is_served(database_url: str, tmp_path: Path) -> None:
    # a laptop's `rollout export --follow` must not take port 8000 from a local `rollout up`
    seed_batch(database_url, "n0", [[Traj()]])
    proc = start(database_url, tmp_path / "out")
    try:
        wait_for(lambda: len(delivered(tmp_path / "out")) == 1, 60, "the trajectory delivered")
        wait_for(lambda: consumer_claimed(database_url, "ops"), 30, "the exporter holding the consumer")
        process = psutil.Process(proc.pid)
        sockets = process.net_connections("inet") if hasattr(process, "net_connections") else process.connections()
        assert [c for c in sockets if c.status == psutil.CONN_LISTEN] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
