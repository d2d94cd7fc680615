"""The exporter on trajectories the real recorder wrote (real NATS, Postgres, services; fake engine): a consumer
following a batch while it runs gets every complete group exactly once, token-exact."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.selection import Selection
from rollout_ledger.services.exporter.follow import Follower
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_pipeline import start_all


def test_follow_a_running_batch(stack: Stack, database_url: str, model_dir: str, tmp_path: Path) -> None:
    url = start_all(stack)
    out = tmp_path / "slime"
    follower = Follower(database_url, "live", Selection(complete_groups=True), out, "slime", batch_size=5)
    stop = threading.Event()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(follower.run(True, stop, poll_s=0.05)), daemon=True)
    thread.start()
    sql = Sql(database_url)
    try:
        resp = httpx.post(f"{url}/v1/batches", headers=AUTH, json={
            "env": "guess-number", "tasks": [{"seed": i} for i in range(8)], "group_size": 3, "max_turns": 3,
            "sampling": {"temperature": 1.0, "max_tokens": 16}}, timeout=30)
        assert resp.status_code == 201, resp.text
        batch_id = resp.json()["batch_id"]
        wait_for(lambda: httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"], 90,
                 "the batch")
        stored = {r["episode_id"]: r for r in sql.rows(
            "SELECT episode_id, token_ids, loss_mask, logprobs, prompt_len, reward, status FROM trajectories "
            "WHERE batch_id = :b", b=batch_id)}
        assert len(stored) == 24
        wait_for(lambda: sql.scalar("SELECT delivered FROM export_cursors WHERE consumer = 'live'") == 24, 30,
                 "the consumer to catch up")
    finally:
        stop.set()
        thread.join(30)
        follower.close()
        sql.close()
    rows = [r for p in sorted(out.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted(r["episode_id"] for r in rows) == sorted(stored)  # each exactly once
    groups: dict[str, list[float]] = {}
    for r in rows:
        s = stored[r["episode_id"]]
        p = s["prompt_len"]
        assert r["tokens"] == list(s["token_ids"])
        assert r["response_length"] == len(s["token_ids"]) - p
        assert r["loss_mask"] == list(s["loss_mask"])[p:]
        assert np.array_equal(np.array(r["rollout_log_probs"], np.float32), np.array(s["logprobs"][p:], np.float32))
        assert r["reward"] == s["reward"]
        groups.setdefault(r["group_id"], []).append(r["advantage"])
    assert len(groups) == 8 and all(len(a) == 3 for a in groups.values())
    assert all(abs(sum(a)) < 1e-6 for a in groups.values())  # grpo advantages of a group sum to 0
