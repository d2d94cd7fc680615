"""Staleness bounded at admission (issue 15, part 3) on a real scheduler, NATS and Postgres; the inference workers
are stood in for by their reports in ``rl_policy_workers`` (what admission reads), the trainer by its pushes.

A bounded batch stores its episodes ``waiting`` with no work item; admission publishes whole groups while the gap
(announced - lowest serving) is within k and the run-ahead within (current - base + k + 1) x B; it holds them while
the workers lag a pushed version, and releases them when every worker serves it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from sqlalchemy import select

from rollout_ledger.shared.db import episodes
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.policy_versions import WorkerPolicyReport, WorkerPolicyState
from rollout_ledger.shared.subjects import POLICY_WORKERS_BUCKET
from tests.helpers import metric_in, until
from tests.integration.test_scheduler_api import Api, body, make_settings, register_env, running, work_count

CKPT = "/checkpoints/run/step"


@pytest.fixture
async def api(nats_url: str, database_url: str, nc: bus.NATS) -> AsyncIterator[Api]:
    async with running(make_settings(nats_url, database_url, admission_interval_s=0.2), nc) as a:
        await register_env(a.js, "echo")
        yield a


async def serve(api: Api, worker: str, version: int) -> None:
    """What an inference worker reports once it serves ``version``."""
    kv = await api.js.key_value(POLICY_WORKERS_BUCKET)
    report = WorkerPolicyReport(worker_id=worker, serving=version, version=version, state=WorkerPolicyState.SERVING,
                                engine="fake", time=datetime.now(UTC))
    await kv.put(worker, orjson.dumps(report.model_dump(mode="json")))


async def push(api: Api, version: int) -> None:
    r = await api.client.post("/v1/policy/versions", json={"version": version, "checkpoint": f"{CKPT}-{version}"})
    assert r.status_code == 201, r.text


async def batch(api: Api, batch_id: str) -> dict[str, Any]:
    r = await api.client.get(f"/v1/batches/{batch_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def statuses(api: Api, batch_id: str) -> dict[str, tuple[str, int | None, bool]]:
    async with api.engine.connect() as conn:
        rows = await conn.execute(select(episodes.c.id, episodes.c.status, episodes.c.admitted_version,
                                         episodes.c.published_at).where(episodes.c.batch_id == batch_id))
        return {r.id: (r.status, r.admitted_version, r.published_at is not None) for r in rows}


async def admission_passes(api: Api) -> float:
    """Admission passes the scheduler ran so far (``rollout_admission_passes_total``)."""
    return metric_in((await api.client.get("/metrics")).text, "rollout_admission_passes_total")


async def passes_after_now(api: Api, passes: int = 2) -> None:
    """Wait until admission has run ``passes`` more passes: the first may have begun before this call, every later
    one began after it and saw what the test did before (a pushed version, a cancel)."""
    done = await admission_passes(api) + passes

    async def ran() -> bool:
        return await admission_passes(api) >= done

    await until(ran, 10, f"{passes} more admission passes")


async def test_a_bounded_batch_starts_one_step_then_follows_the_trainer(api: Api) -> None:
    await serve(api, "inf-a", 0)
    await serve(api, "inf-b", 0)
    tasks = [{"q": str(i)} for i in range(6)]
    r = await api.client.post("/v1/batches", json=body(batch_id="onpolicy", tasks=tasks, group_size=2,
                                                         max_staleness=0, episodes_per_version=4))
    assert r.status_code == 201, r.text
    created = r.json()
    assert (created["num_published"], created["num_waiting"]) == (4, 8), "(0 - 0 + 0 + 1) x 4 start at once"
    assert await work_count(api.js) == 4
    eps = await statuses(api, "onpolicy")
    started = sorted(e for e, (s, _, _) in eps.items() if s == "requested")
    assert started == ["onpolicy.0.0", "onpolicy.0.1", "onpolicy.1.0", "onpolicy.1.1"], "whole groups, task order"
    assert all(eps[e][1] == 0 and eps[e][2] for e in started), "admitted under version 0, published"
    assert all(not p and v is None for s, v, p in eps.values() if s == "waiting"), "waiting: no work item"

    shown = await batch(api, "onpolicy")
    assert shown["counts"]["waiting"] == 8 and shown["counts"]["requested"] == 4
    assert shown["max_staleness"] == 0 and shown["episodes_per_version"] == 4
    adm = shown["admission"]
    assert (adm["base_version"], adm["current_version"], adm["serving_version"], adm["admitted"], adm["waiting"],
            adm["limit"]) == (0, 0, 0, 4, 8, 4)
    assert "run-ahead" in adm["held"]

    # the trainer pushes version 1; one worker still serves 0: the gap (1) exceeds k (0), nothing starts
    await push(api, 1)
    await serve(api, "inf-a", 1)
    held = (await batch(api, "onpolicy"))["admission"]
    assert held["current_version"] == 1 and held["serving_version"] == 0
    assert "1 behind the announced 1" in held["held"]
    assert await work_count(api.js) == 4

    # every worker serves 1: the next step's groups start, admitted under version 1
    await serve(api, "inf-b", 1)

    async def next_step() -> bool:
        return await work_count(api.js) == 8

    await until(next_step, what="the second step admitted once every worker serves version 1")
    eps = await statuses(api, "onpolicy")
    assert sorted(e for e, (s, v, _) in eps.items() if s == "requested" and v == 1) == [
        "onpolicy.2.0", "onpolicy.2.1", "onpolicy.3.0", "onpolicy.3.1"]
    after = await batch(api, "onpolicy")
    assert after["counts"]["waiting"] == 4 and after["admission"]["limit"] == 8

    # two more versions at once: the last step starts (limit 16 > 12 episodes), nothing is left waiting
    await push(api, 2)
    await serve(api, "inf-a", 2)
    await serve(api, "inf-b", 2)

    async def all_started() -> bool:
        return await work_count(api.js) == 12

    await until(all_started, what="the last step")
    final = await batch(api, "onpolicy")
    assert final["counts"]["waiting"] == 0 and final["admission"]["held"] is None


async def test_k_lets_generation_run_ahead_and_a_worker_lagging_more_than_k_holds_it(api: Api) -> None:
    await serve(api, "inf-a", 0)
    r = await api.client.post("/v1/batches", json=body(batch_id="ahead", tasks=[{"q": str(i)} for i in range(8)],
                                                         group_size=2, max_staleness=1, episodes_per_version=4))
    assert r.json()["num_published"] == 8, "k = 1: two steps ahead of the trainer"
    await push(api, 1)  # the worker one version behind: within k, and the limit moves to 3 steps

    async def third_step() -> bool:
        return await work_count(api.js) == 12

    await until(third_step, what="the third step while the worker is one version behind")
    await push(api, 2)  # the trainer is two versions ahead of the only worker: more than k
    shown = (await batch(api, "ahead"))["admission"]
    assert shown["limit"] == 16 and "2 behind the announced 2" in shown["held"]
    await passes_after_now(api)
    assert await work_count(api.js) == 12
    await serve(api, "inf-a", 1)  # one behind: within k

    async def rest() -> bool:
        return await work_count(api.js) == 16

    await until(rest, what="the rest once the worker is within k of the announced version")


async def test_without_a_run_ahead_bound_only_the_gap_holds(api: Api) -> None:
    await push(api, 3)
    await serve(api, "inf-a", 2)
    r = await api.client.post("/v1/batches", json=body(batch_id="gap", max_staleness=0))
    assert (r.json()["num_published"], r.json()["num_waiting"]) == (0, 6)
    shown = await batch(api, "gap")
    assert shown["admission"]["base_version"] == 3 and shown["admission"]["limit"] is None
    await serve(api, "inf-a", 3)

    async def started() -> bool:
        return await work_count(api.js) == 6

    await until(started, what="every episode once the worker serves the announced version")
    eps = await statuses(api, "gap")
    assert {v for _, v, _ in eps.values()} == {3}


async def test_cancel_ends_waiting_episodes(api: Api) -> None:
    r = await api.client.post("/v1/batches", json=body(batch_id="cx", max_staleness=0, episodes_per_version=2))
    assert r.json()["num_waiting"] == 4
    out = (await api.client.post("/v1/batches/cx/cancel")).json()
    assert out["cancelled_now"] == 6 and out["counts"]["cancelled"] == 6
    await push(api, 1)  # a version that would admit the next step, were the batch not cancelled
    await passes_after_now(api)
    assert await work_count(api.js) == 2
    assert {s for s, _, _ in (await statuses(api, "cx")).values()} == {"cancelled"}


async def test_the_deployment_default_bounds_batches_without_their_own(nats_url: str, database_url: str,
                                                                       nc: bus.NATS) -> None:
    settings = make_settings(nats_url, database_url, admission_interval_s=0.2, max_staleness=0)
    async with running(settings, nc) as a:
        await register_env(a.js, "echo")
        await push(a, 2)
        await serve(a, "inf-a", 1)
        r = await a.client.post("/v1/batches", json=body(batch_id="dflt"))
        assert r.status_code == 201 and r.json()["num_waiting"] == 6
        shown = await batch(a, "dflt")
        assert shown["max_staleness"] == 0, "the deployment's k is stored with the batch"
        own = await a.client.post("/v1/batches", json=body(batch_id="own", max_staleness=1))
        assert own.json()["num_published"] == 6, "a batch's own k wins"


async def test_bad_bounds_are_refused_with_the_reason(api: Api) -> None:
    # 422: what the schema states; 400: values that do not fit each other (JSON Schema cannot state that)
    for bad, code, words in [({"max_staleness": -1}, 422, "max_staleness"),
                             ({"episodes_per_version": 0}, 422, "episodes_per_version"),
                             ({"episodes_per_version": 4}, 400, "episodes_per_version: it bounds the run-ahead"),
                             ({"max_staleness": 0, "episodes_per_version": 3}, 400,
                              "episodes_per_version: 3 is not a multiple of group_size 2")]:
        r = await api.client.post("/v1/batches", json=body(**bad))
        assert r.status_code == code, (bad, r.text)
        assert words in r.text, (bad, r.text)


async def test_old_requests_keep_their_hash(api: Api) -> None:
    """A request without the new fields hashes as before they existed (a client retrying across an upgrade)."""
    r = await api.client.post("/v1/batches", json=body(batch_id="old"))
    again = await api.client.post("/v1/batches", json=body(batch_id="old", max_staleness=None,
                                                           episodes_per_version=None))
    assert again.status_code == 200 and again.json()["request_hash"] == r.json()["request_hash"]
    bounded = await api.client.post("/v1/batches", json=body(batch_id="old", max_staleness=0))
    assert bounded.status_code == 409, "another bound is another request"
