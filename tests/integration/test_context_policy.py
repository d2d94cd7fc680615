"""A batch's context policy through the scheduler (in process, real NATS + Postgres): validated, stored with the
batch, carried on every work item, also when the outbox republishes them after a crash."""

from __future__ import annotations

from typing import Any

from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.planning import canonical_request, plan_episodes, request_hash
from rollout_ledger.services.scheduler.schemas import BatchCreate
from rollout_ledger.shared.events import ContextPolicy
from tests.integration.test_scheduler_api import Api, api, body, work_count, work_items

__all__ = ["api"]  # the in-process scheduler fixture

WINDOW = {"policy": "window", "window_turns": 3}


async def test_context_policy_is_stored_and_carried_on_work_items(api: Api) -> None:
    r = await api.client.post("/v1/batches", json=body(batch_id="windowed", context=WINDOW))
    assert r.status_code == 201, r.text
    got = (await api.client.get("/v1/batches/windowed")).json()
    assert got["context"] == WINDOW
    items = await work_items(api.js, 6)
    assert {ev.context for ev in items} == {ContextPolicy(policy="window", window_turns=3)}
    # a request without a context hashes as before context policies existed; with one, differently
    plain = BatchCreate.model_validate(body())
    assert b"context" not in canonical_request(plain)
    assert request_hash(plain) != request_hash(BatchCreate.model_validate(body(context=WINDOW)))


async def test_a_bad_context_policy_is_refused(api: Api) -> None:
    for bad in ({"policy": "window", "window_turns": 0}, {"policy": "sliding"}, {"policy": "full", "n": 1}):
        r = await api.client.post("/v1/batches", json=body(context=bad))
        assert r.status_code == 422, r.text
        assert "context" in r.text
    assert await work_count(api.js) == 0


async def test_republished_work_items_keep_the_context_policy(api: Api) -> None:
    req = BatchCreate.model_validate(body(batch_id="crashed-window", context=WINDOW))
    planned = plan_episodes("crashed-window", req.env, req.tasks, req.group_size)
    row: dict[str, Any] = {"id": "crashed-window", "env": req.env, "group_size": req.group_size,
                           "max_turns": req.max_turns, "sampling": req.sampling.model_dump(mode="json"),
                           "context": WINDOW, "num_tasks": len(req.tasks), "num_episodes": len(planned),
                           "request_hash": request_hash(req), "metadata": req.metadata}
    async with api.engine.begin() as conn:  # what a scheduler that crashed between commit and publish leaves
        assert await batch_store.insert_batch(conn, row, planned) is not None
    assert await work_count(api.js) == 0
    r = await api.client.post("/v1/batches", json=body(batch_id="crashed-window", context=WINDOW))
    assert r.status_code == 200 and r.json()["num_published"] == 6, r.text
    assert {ev.context for ev in await work_items(api.js, 6)} == {ContextPolicy(policy="window", window_turns=3)}
