"""Policy versions as records (issue 15, part 1): POST /v1/policy/versions (idempotent on the version, versions only
increase, 4xx with a reason), the durable announcement in ``rl_policy``, GET /v1/policy (current version, worker
reports, episodes in flight per version), the mirror into ``policy_worker_states``, and the CLI."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select, update
from typer.testing import CliRunner

from rollout_ledger.cli.main import app as cli_app
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.scheduler import policy_registry
from rollout_ledger.shared.db import episodes, policy_versions, policy_worker_states, turns
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.policy_versions import PolicyAnnouncement, WorkerPolicyReport, WorkerPolicyState
from rollout_ledger.shared.subjects import POLICY_BUCKET, POLICY_KEY, POLICY_WORKERS_BUCKET
from tests.helpers import until
from tests.integration.test_scheduler_api import (
    TOKEN,
    Api,
    body,
    make_settings,
    register_env,
    running,
)

CKPT = "/checkpoints/run-7/step-100"


@pytest.fixture
async def api(nats_url: str, database_url: str, nc: bus.NATS) -> AsyncIterator[Api]:
    async with running(make_settings(nats_url, database_url), nc) as a:
        await register_env(a.js, "echo")
        yield a


async def current(js: bus.JetStreamContext) -> PolicyAnnouncement:
    entry = await (await js.key_value(POLICY_BUCKET)).get(POLICY_KEY)
    return PolicyAnnouncement.model_validate(orjson.loads(entry.value or b"{}"))


async def test_a_version_is_recorded_once_and_announced_durably(api: Api) -> None:
    first = await api.client.post("/v1/policy/versions", json={"version": 1, "checkpoint": CKPT, "notes": "step 100"})
    assert first.status_code == 201, first.text
    assert first.json()["created"] is True and first.json()["announced"] is True and first.json()["mode"] == "drain"
    announced = await current(api.js)
    assert (announced.version, announced.checkpoint, str(announced.mode)) == (1, CKPT, "drain")

    again = await api.client.post("/v1/policy/versions", json={"version": 1, "checkpoint": CKPT, "notes": "step 100"})
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["created_at"] == first.json()["created_at"]

    changed = await api.client.post("/v1/policy/versions", json={"version": 1, "checkpoint": "/elsewhere"})
    assert changed.status_code == 409
    assert "version 1 was announced already" in changed.json()["detail"] and "announce 2" in changed.json()["detail"]

    third = await api.client.post("/v1/policy/versions", json={"version": 3, "checkpoint": CKPT + "-b",
                                                               "mode": "abort"})
    assert third.status_code == 201
    lower = await api.client.post("/v1/policy/versions", json={"version": 2, "checkpoint": CKPT})
    assert lower.status_code == 409 and "versions only increase: the newest is 3" in lower.json()["detail"]
    assert (await current(api.js)).version == 3
    async with api.engine.connect() as conn:
        rows = (await conn.execute(select(policy_versions.c.version, policy_versions.c.mode)
                                   .order_by(policy_versions.c.version))).all()
    assert [tuple(r) for r in rows] == [(1, "drain"), (3, "abort")]


async def test_bad_requests_are_422_naming_the_field(api: Api) -> None:
    for bad, field in [({"version": -1, "checkpoint": CKPT}, "version"),
                       ({"version": 2**31, "checkpoint": CKPT}, "version"),
                       ({"version": 1, "checkpoint": ""}, "checkpoint"),
                       ({"version": 1}, "checkpoint"),
                       ({"version": 1, "checkpoint": CKPT, "mode": "swap"}, "mode"),
                       ({"version": 1, "checkpoint": CKPT, "chekpoint": "typo"}, "chekpoint")]:
        r = await api.client.post("/v1/policy/versions", json=bad)
        assert r.status_code == 422, (bad, r.text)
        assert field in r.json()["message"], (bad, r.json())


async def test_the_announcement_never_moves_backwards_and_a_retry_announces_again(api: Api) -> None:
    kv = await api.js.key_value(POLICY_BUCKET)
    assert (await api.client.post("/v1/policy/versions", json={"version": 5, "checkpoint": CKPT})).status_code == 201
    older = PolicyAnnouncement(version=4, checkpoint="/old")
    assert await policy_registry.announce(kv, older) is False, "a late, older announcement loses"
    assert (await current(api.js)).version == 5
    await kv.delete(POLICY_KEY)  # as if the first POST's announcement had never reached the bus
    retry = await api.client.post("/v1/policy/versions", json={"version": 5, "checkpoint": CKPT})
    assert retry.status_code == 200 and retry.json()["announced"] is True
    assert (await current(api.js)).version == 5


async def test_policy_shows_workers_and_episodes_in_flight_per_version(api: Api) -> None:
    empty = (await api.client.get("/v1/policy")).json()
    assert empty == {"current": None, "workers": [], "in_flight": {}}
    await api.client.post("/v1/policy/versions", json={"version": 2, "checkpoint": CKPT})
    ids = (await api.client.post("/v1/batches", json=body(batch_id="pv"))).json()["episode_ids"]
    now = datetime.now(UTC)
    async with api.engine.begin() as conn:
        await conn.execute(update(episodes).where(episodes.c.id.in_(ids[:3])).values(status="running", attempt=1))
        await conn.execute(turns.insert(), [
            {"event_id": f"{ep}:a1:t0:r1", "episode_id": ep, "attempt": 1, "turn_index": 0, "prompt_len": 4,
             "token_ids": [9], "logprobs": [-1.0], "finish_reason": "stop", "weight_version": version,
             "engine": "fake", "worker_id": "inf-1", "queue_ms": 1.0, "generate_ms": 2.0, "produced_at": now}
            for ep, version in ((ids[0], 1), (ids[1], 2))])
    workers_kv = await api.js.key_value(POLICY_WORKERS_BUCKET)
    report = WorkerPolicyReport(worker_id="inf-1", serving=1, version=2, state=WorkerPolicyState.LOADING,
                                engine="fake")
    await workers_kv.put("inf-1", orjson.dumps(report.model_dump(mode="json")))

    out = (await api.client.get("/v1/policy")).json()
    assert out["current"]["version"] == 2 and out["current"]["checkpoint"] == CKPT
    assert out["in_flight"] == {"1": 1, "2": 1, "none": 1}
    (worker,) = out["workers"]
    assert (worker["worker_id"], worker["serving"], worker["version"], worker["state"]) == ("inf-1", 1, 2, "loading")

    async def mirrored() -> bool:
        async with api.engine.connect() as conn:
            row = (await conn.execute(select(policy_worker_states.c.state).where(
                policy_worker_states.c.worker_id == "inf-1", policy_worker_states.c.version == 2))).first()
        return row is not None and row.state == "loading"

    await until(mirrored, what="the report mirrored into policy_worker_states")
    served = report.model_copy(update={"state": WorkerPolicyState.SERVING, "serving": 2,
                                       "time": datetime.now(UTC)})
    await workers_kv.put("inf-1", orjson.dumps(served.model_dump(mode="json")))

    async def serving() -> bool:
        async with api.engine.connect() as conn:
            row = (await conn.execute(select(policy_worker_states.c.state).where(
                policy_worker_states.c.worker_id == "inf-1", policy_worker_states.c.version == 2))).first()
        return row is not None and row.state == "serving"

    await until(serving, what="the newer report to replace the older one")
    # the bucket keeps one value per worker, so a watcher can miss the explicit "retired" report of version 2:
    # serving version 3 retires it all the same
    moved = WorkerPolicyReport(worker_id="inf-1", serving=3, version=3, state=WorkerPolicyState.SERVING,
                               engine="fake", time=datetime.now(UTC))
    await workers_kv.put("inf-1", orjson.dumps(moved.model_dump(mode="json")))

    async def retired() -> bool:
        async with api.engine.connect() as conn:
            rows = (await conn.execute(select(policy_worker_states.c.version, policy_worker_states.c.state).where(
                policy_worker_states.c.worker_id == "inf-1").order_by(policy_worker_states.c.version))).all()
        return [tuple(r) for r in rows] == [(2, "retired"), (3, "serving")]

    await until(retired, what="version 2 retired once version 3 serves")


async def test_announcing_needs_the_write_token_when_one_is_set(nats_url: str, database_url: str,
                                                               nc: bus.NATS) -> None:
    async with running(make_settings(nats_url, database_url, api_token=TOKEN), nc) as a, a.anonymous() as anon:
        r = await anon.post("/v1/policy/versions", json={"version": 1, "checkpoint": CKPT})
        assert r.status_code == 401
        ok = await anon.post("/v1/policy/versions", json={"version": 1, "checkpoint": CKPT},
                             headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 201


def test_cli_push_and_status(stack: Stack, model_dir: str, tmp_path: Path) -> None:
    url = stack.start("scheduler").url
    runner = CliRunner(env={"ROLLOUT_API_TOKEN": stack.api_token})
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    shutil.copy(Path(model_dir) / "config.json", ckpt / "config.json")
    refused = runner.invoke(cli_app, ["policy", "push", str(ckpt), "--version", "1", "--url", url])
    assert refused.exit_code == 2 and "safetensors" in refused.output
    (ckpt / "model.safetensors").write_bytes(b"")
    pushed = runner.invoke(cli_app, ["policy", "push", str(ckpt), "--version", "1", "--mode", "abort",
                                     "--url", url])
    assert pushed.exit_code == 0, pushed.output
    assert f"policy version 1 announced: {ckpt.resolve()} (mode abort)" in pushed.output
    again = runner.invoke(cli_app, ["policy", "push", str(ckpt), "--version", "1", "--mode", "abort", "--url", url])
    assert again.exit_code == 0 and "already announced" in again.output
    lower = runner.invoke(cli_app, ["policy", "push", str(ckpt), "--version", "0", "--url", url])
    assert lower.exit_code != 0 and "versions only increase" in str(lower.exception or lower.output)
    status = runner.invoke(cli_app, ["policy", "status", "--url", url], env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    assert "current version 1 (abort)" in status.output and "episodes in flight by version: none" in status.output
