"""The scheduler as a real process (`rollout serve scheduler`): serves, drains on SIGTERM, refuses old schemas."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
from sqlalchemy import func, select

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.migrations.runner import downgrade
from rollout_ledger.shared.db import batches, create_engine, episodes
from rollout_ledger.shared.events import dumps
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import ENVS_BUCKET, WORK_STREAM
from tests.helpers import AUTH, until


async def test_scheduler_process_serves_and_drains(stack: Stack, nc: bus.NATS) -> None:
    js = nc.jetstream()
    kv = await js.key_value(ENVS_BUCKET)
    await kv.put("echo", dumps({"name": "echo", "description": "", "multi_turn": False, "example_task": {},
                                "registered_by": "tests"}))
    proc = stack.start("scheduler", ROLLOUT_API_TOKEN="process-token-123456")
    auth = {"Authorization": "Bearer process-token-123456"}
    async with httpx.AsyncClient(base_url=proc.url, timeout=10) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.post("/v1/batches", json={"env": "echo", "tasks": [{}]})).status_code == 401
        r = await client.post("/v1/batches", json={"env": "echo", "tasks": [{"q": 1}, {"q": 2}], "group_size": 2,
                                                    "batch_id": "proc-1"}, headers=auth)
        assert r.status_code == 201, r.text
        assert r.json()["num_published"] == 4
        assert (await client.get("/v1/batches/proc-1")).status_code == 401
        got = (await client.get("/v1/batches/proc-1", headers=auth)).json()
        assert got["counts"]["requested"] == 4 and got["num_published"] == 4
        assert "rollout_batches_submitted_total 1.0" in (await client.get("/metrics")).text
    assert (await js.stream_info(WORK_STREAM)).state.messages == 4

    assert proc.stop() == 0
    lines = [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]
    submitted = [e for e in lines if e.get("event") == "batch.submitted"]
    assert submitted and submitted[0]["batch_id"] == "proc-1" and submitted[0]["service"] == "scheduler"
    assert any(e.get("event") == "scheduler.stopped" for e in lines)


async def test_scheduler_process_refuses_an_old_schema(stack: Stack, database_url: str) -> None:
    downgrade(database_url, "base")
    proc = stack.start("scheduler", wait=False)
    assert proc.proc is not None
    assert await asyncio.to_thread(proc.proc.wait, 30) == 1
    assert "rollout db upgrade" in proc.log_path.read_text()


async def test_scheduler_process_refuses_to_start_without_a_token(stack: Stack) -> None:
    proc = stack.start("scheduler", wait=False, ROLLOUT_API_TOKEN="")
    assert proc.proc is not None
    assert await asyncio.to_thread(proc.proc.wait, 30) == 2
    bad = [json.loads(line) for line in proc.log_path.read_text().splitlines()
           if line.startswith("{") and '"service.bad_settings"' in line]
    assert bad and bad[0]["service"] == "scheduler" and "ROLLOUT_API_TOKEN is not set" in bad[0]["error"], bad


@pytest.mark.parametrize("service", ["env-worker", "inference-worker", "recorder"])
async def test_every_service_refuses_a_bad_setting_naming_it_not_its_value(stack: Stack, service: str) -> None:
    """The services share one main (rollout_ledger/shared/kit/service.py): a setting that does not validate ends the
    process with exit code 2 and one log line naming the field, never the value given."""
    proc = stack.start(service, wait=False, ROLLOUT_NATS_CONNECT_TIMEOUT_S="secret-not-a-number")
    assert proc.proc is not None
    assert await asyncio.to_thread(proc.proc.wait, 30) == 2
    log = proc.log_path.read_text()
    bad = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"service.bad_settings"' in line]
    assert bad and bad[0]["service"] == service and "nats_connect_timeout_s" in bad[0]["error"], log
    assert "secret-not-a-number" not in log


async def test_sigterm_finishes_the_request_in_flight(stack: Stack, nc: bus.NATS, database_url: str) -> None:
    js = nc.jetstream()
    kv = await js.key_value(ENVS_BUCKET)
    await kv.put("echo", dumps({"name": "echo"}))
    proc = stack.start("scheduler")
    engine = create_engine(database_url)
    tasks = [{"i": i} for i in range(1500)]
    try:
        async with httpx.AsyncClient(base_url=proc.url, timeout=60, headers=AUTH) as client:
            post = asyncio.create_task(
                client.post("/v1/batches", json={"env": "echo", "tasks": tasks, "group_size": 2, "batch_id": "drain"})
            )

            async def committed() -> bool:
                async with engine.connect() as conn:
                    return (await conn.execute(select(batches.c.id).where(batches.c.id == "drain"))).first() is not None

            async def stored() -> bool:  # the batch is stored: its request is publishing (or done)
                if await committed():
                    return True
                assert not post.done(), "the POST never committed"
                return False

            await until(stored, 30, "the POST to commit its batch", interval_s=0.02)
            proc.signal(signal.SIGTERM)
            r = await post
        assert r.status_code == 201, r.text
        assert r.json()["num_published"] == 3000
        assert await asyncio.to_thread(proc.proc.wait, 30) == 0
        async with engine.connect() as conn:
            unpublished = (await conn.execute(
                select(func.count()).select_from(episodes).where(episodes.c.published_at.is_(None))
            )).scalar_one()
        assert unpublished == 0
        assert (await js.stream_info(WORK_STREAM)).state.messages == 3000
    finally:
        await engine.dispose()
