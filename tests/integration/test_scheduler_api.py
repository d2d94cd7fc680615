"""The scheduler app in-process (httpx ASGI transport, lifespan run) against real NATS and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np
import pytest
from nats.js.api import ConsumerConfig
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from rollout_ledger.migrations.runner import downgrade
from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.app import create_app
from rollout_ledger.services.scheduler.planning import plan_episodes, request_hash
from rollout_ledger.services.scheduler.schemas import BatchCreate
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.shared.db import batches, create_engine, episodes, steps, trajectories, turns
from rollout_ledger.shared.errors import SchemaVersionError
from rollout_ledger.shared.events import EpisodeRequested, decode_as, dumps
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from rollout_ledger.shared.lifecycle import EpisodeStatus
from rollout_ledger.shared.subjects import (
    CANCEL_BUCKET,
    ENVS_BUCKET,
    WORK_ROUTES,
    WORK_STREAM,
    env_key,
    work_subject,
)
from tests.helpers import until

TOKEN = "test-token-0123456789"
READ_TOKEN = "test-read-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
"""Headers of a client with the write scope (``make_settings`` sets ``TOKEN`` as ROLLOUT_API_TOKEN)."""


@dataclass
class Api:
    """An in-process scheduler with its own view of the bus and the database."""

    client: httpx.AsyncClient
    """Sends the settings' ROLLOUT_API_TOKEN (scopes read and write)."""
    js: bus.JetStreamContext
    engine: AsyncEngine
    transport: httpx.ASGITransport
    """For a client of other credentials (``anonymous``)."""

    def anonymous(self, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
        """A client of the same app without the token (``headers``: other credentials)."""
        return httpx.AsyncClient(transport=self.transport, base_url="http://scheduler", headers=headers)


def make_settings(nats_url: str, database_url: str, **kw: Any) -> SchedulerSettings:
    base: dict[str, Any] = {"nats_url": nats_url, "database_url": database_url, "republish_interval_s": 60.0,
                            "nats_initial_wait_s": 5.0, "worker_id": "sched-test", "api_token": TOKEN,
                            "_env_file": None}
    base.update(kw)
    return SchedulerSettings(**base)


@contextlib.asynccontextmanager
async def running(settings: SchedulerSettings, nc: bus.NATS) -> AsyncIterator[Api]:
    app = create_app(settings)
    engine = create_engine(settings.database_url)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            token = settings.api_token.get_secret_value() if settings.api_token is not None else None
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with httpx.AsyncClient(transport=transport, base_url="http://scheduler", headers=headers) as client:
                yield Api(client, nc.jetstream(), engine, transport)
    finally:
        await engine.dispose()


async def register_env(js: bus.JetStreamContext, name: str) -> None:
    kv = await js.key_value(ENVS_BUCKET)
    await kv.put(name, dumps({"name": name, "description": f"{name} env", "multi_turn": False,
                              "example_task": {"q": "1+1"}, "registered_by": "tests"}))


@pytest.fixture
async def api(nats_url: str, database_url: str, nc: bus.NATS) -> AsyncIterator[Api]:
    async with running(make_settings(nats_url, database_url), nc) as a:
        await register_env(a.js, "echo")
        yield a


def body(**kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"env": "echo", "tasks": [{"q": "a"}, {"q": "b"}, {"q": "c"}], "group_size": 2,
                         "sampling": {"temperature": 0.7, "max_tokens": 16}, "max_turns": 2}
    b.update(kw)
    return b


async def work_count(js: bus.JetStreamContext) -> int:
    return int((await js.stream_info(WORK_STREAM)).state.messages)


async def work_items(js: bus.JetStreamContext, n: int, route: str | None = None) -> list[EpisodeRequested]:
    """Take ``n`` work items off the queue; each must be on its env's route (``route``: on that one)."""
    psub = await js.pull_subscribe(WORK_ROUTES, durable="sched-test", stream=WORK_STREAM,
                                   config=ConsumerConfig(ack_wait=30))
    msgs = await psub.fetch(n, timeout=5)
    out = []
    for m in msgs:
        ev = decode_as(m.data, EpisodeRequested)
        assert m.headers is not None and m.headers["Nats-Msg-Id"] == ev.event_id
        assert m.subject == work_subject(route or ev.env), "published on its env's route"
        out.append(ev)
    await psub.unsubscribe()
    return out


async def episode_rows(engine: AsyncEngine, batch_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(episodes).where(episodes.c.batch_id == batch_id).order_by(episodes.c.id))
        return [dict(r._mapping) for r in rows]


# --- POST /v1/batches -----------------------------------------------------------------------------


async def test_post_stores_batch_and_episodes_and_publishes_work_items(api: Api) -> None:
    r = await api.client.post("/v1/batches", json=body(metadata={"run": "r1"}))
    assert r.status_code == 201, r.text
    out = r.json()
    bid = out["batch_id"]
    assert len(bid) == 32 and out["created"] is True
    assert out["num_episodes"] == 6 and out["num_published"] == 6 and out["status_url"] == f"/v1/batches/{bid}"
    assert out["episode_ids"] == [f"{bid}.{t}.{g}" for t in range(3) for g in range(2)]

    async with api.engine.connect() as conn:
        batch = (await conn.execute(select(batches).where(batches.c.id == bid))).one()._mapping
    assert batch["num_tasks"] == 3 and batch["num_episodes"] == 6 and batch["metadata"] == {"run": "r1"}
    assert batch["request_hash"] == request_hash(BatchCreate.model_validate(body(metadata={"run": "r1"})))
    rows = await episode_rows(api.engine, bid)
    assert [r["id"] for r in rows] == sorted(out["episode_ids"])
    assert all(r["status"] == "requested" and r["published_at"] is not None for r in rows)
    assert rows[3]["group_id"] == f"{bid}.1" and rows[3]["task"] == {"q": "b"}

    assert await work_count(api.js) == 6
    items = await work_items(api.js, 6)
    assert sorted(ev.episode_id for ev in items) == sorted(out["episode_ids"])
    first = next(ev for ev in items if ev.episode_id == f"{bid}.2.1")
    assert first.event_id == f"{bid}.2.1:requested" and first.task == {"q": "c"}
    assert (first.group_id, first.group_index, first.group_size, first.max_turns) == (f"{bid}.2", 1, 2, 2)
    assert first.sampling.temperature == 0.7 and first.sampling.max_tokens == 16
    assert first.produced_by == "scheduler/sched-test"

    metrics = (await api.client.get("/metrics")).text
    assert "rollout_batches_submitted_total 1.0" in metrics
    assert "rollout_episodes_submitted_total 6.0" in metrics
    assert 'rollout_http_requests_total{method="POST",route="/v1/batches",status="201"} 1.0' in metrics
    assert 'rollout_http_request_duration_seconds_count{method="POST",route="/v1/batches"} 1.0' in metrics


async def test_post_is_idempotent_with_a_client_batch_id(api: Api) -> None:
    first = await api.client.post("/v1/batches", json=body(batch_id="run-42"))
    assert first.status_code == 201, first.text
    again = await api.client.post("/v1/batches", json=body(batch_id="run-42"))
    assert again.status_code == 200, again.text
    assert again.json()["created"] is False
    assert again.json()["episode_ids"] == first.json()["episode_ids"]
    assert again.json()["num_published"] == 6
    assert await work_count(api.js) == 6
    async with api.engine.connect() as conn:
        assert len((await conn.execute(select(batches.c.id))).all()) == 1
    assert len(await episode_rows(api.engine, "run-42")) == 6

    other = await api.client.post("/v1/batches", json=body(batch_id="run-42", group_size=3))
    assert other.status_code == 409
    assert "already exists with a different request" in other.json()["detail"]


async def test_concurrent_posts_with_one_batch_id_make_one_batch(api: Api) -> None:
    rs = await asyncio.gather(*(api.client.post("/v1/batches", json=body(batch_id="race")) for _ in range(4)))
    assert sorted(r.status_code for r in rs) == [200, 200, 200, 201]
    assert len(await episode_rows(api.engine, "race")) == 6
    assert await work_count(api.js) == 6


async def _store_unpublished(engine: AsyncEngine, req: BatchCreate, batch_id: str) -> list[str]:
    """What a scheduler that crashed between commit and publish leaves behind."""
    planned = plan_episodes(batch_id, req.env, req.tasks, req.group_size)
    row = {"id": batch_id, "env": req.env, "group_size": req.group_size, "max_turns": req.max_turns,
           "sampling": req.sampling.model_dump(mode="json"), "num_tasks": len(req.tasks),
           "num_episodes": len(planned), "request_hash": request_hash(req), "metadata": req.metadata}
    async with engine.begin() as conn:
        assert await batch_store.insert_batch(conn, row, planned) is not None
    return [p.id for p in planned]


async def test_repeated_post_publishes_what_a_crash_left_unpublished(api: Api) -> None:
    req = BatchCreate.model_validate(body(batch_id="crashed"))
    ids = await _store_unpublished(api.engine, req, "crashed")
    assert await work_count(api.js) == 0
    r = await api.client.post("/v1/batches", json=body(batch_id="crashed"))
    assert r.status_code == 200, r.text
    assert r.json()["num_published"] == 6
    assert await work_count(api.js) == 6
    assert sorted(ev.episode_id for ev in await work_items(api.js, 6)) == sorted(ids)


async def test_outbox_republishes_unpublished_episodes(nats_url: str, database_url: str, nc: bus.NATS) -> None:
    settings = make_settings(nats_url, database_url, republish_interval_s=0.1, republish_grace_s=0.0,
                             republish_limit=4)
    async with running(settings, nc) as a:
        req = BatchCreate.model_validate(body(env="not-even-registered"))
        ids = await _store_unpublished(a.engine, req, "outboxed")

        async def all_published() -> bool:
            rows = await episode_rows(a.engine, "outboxed")
            return all(r["published_at"] is not None for r in rows)

        await until(all_published, what="the outbox to publish 6 episodes")
        assert await work_count(a.js) == 6
        assert sorted(ev.episode_id for ev in await work_items(a.js, 6)) == sorted(ids)
        assert "rollout_outbox_republished_total 6.0" in (await a.client.get("/metrics")).text
        ready = await a.client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"nats": True, "postgres": True}


BAD_INPUTS: list[tuple[dict[str, Any], str, str]] = [
    ({"env": None}, "env", "Field required"),
    ({"tasks": []}, "tasks", "at least 1 item"),
    ({"group_size": 0}, "group_size", "greater than or equal to 1"),
    ({"max_turns": 0}, "max_turns", "greater than or equal to 1"),
    ({"tasks": "abc"}, "tasks", "valid list"),
    ({"tasks": [1, 2]}, "tasks.0", "valid dictionary"),
    ({"group_size": "many"}, "group_size", "valid integer"),
    ({"sampling": {"temperature": -1}}, "sampling.temperature", "greater than or equal to 0"),
    ({"sampling": {"temprature": 1}}, "sampling.temprature", "Extra inputs are not permitted"),
    ({"batch_id": "has space"}, "batch_id", "should match pattern"),
]


async def test_bad_input_is_422_naming_the_field(api: Api) -> None:
    for change, field, reason in BAD_INPUTS:
        b = body(**change)
        if change.get("env", "") is None:
            del b["env"]
        r = await api.client.post("/v1/batches", json=b)
        assert r.status_code == 422, (change, r.text)
        out = r.json()
        assert field in [d["field"] for d in out["detail"]], (change, out)
        assert f"{field}: " in out["message"] and reason in out["message"], (change, out)
    not_json = await api.client.post("/v1/batches", content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and "JSON" in not_json.json()["message"]
    assert await work_count(api.js) == 0


async def test_a_min_tokens_floor_over_max_tokens_is_a_400_naming_the_field(api: Api) -> None:
    r = await api.client.post("/v1/batches", json=body(sampling={"max_tokens": 16, "min_tokens": 17}))
    assert r.status_code == 400, r.text
    assert r.json()["detail"] == "sampling.min_tokens: 17 is over sampling.max_tokens 16: a turn ends at max_tokens"
    ok = await api.client.post("/v1/batches", json=body(sampling={"max_tokens": 16, "min_tokens": 16}))
    assert ok.status_code == 201, ok.text
    assert await work_count(api.js) == 6  # 3 tasks x 2: the refused one published nothing


async def test_unknown_env_lists_the_known_ones(api: Api) -> None:
    await register_env(api.js, "countdown")
    r = await api.client.post("/v1/batches", json=body(env="nope"))
    assert r.status_code == 400
    assert r.json()["detail"] == "unknown env 'nope'; known envs: countdown, echo"
    envs = (await api.client.get("/v1/envs")).json()["envs"]
    assert [e["name"] for e in envs] == ["countdown", "echo"]
    assert envs[1] == {"name": "echo", "description": "echo env", "multi_turn": False,
                       "example_task": {"q": "1+1"}, "registered_by": "tests", "route": "echo", "family": "",
                       "members": []}


async def test_a_family_is_listed_once_and_its_members_are_routed_by_it(api: Api) -> None:
    """A family's one advert (``<family>:*`` with its members, as env workers write it): GET /v1/envs lists it once;
    a batch of a member is accepted and its work items go to the family's route; a non-member is a 400."""
    kv = await api.js.key_value(ENVS_BUCKET)
    await kv.put(env_key("fam:*"), dumps({"name": "fam:*", "description": "a family", "route": "fam", "family": "fam",
                                          "members": ["fam:alpha", "fam:beta"], "registered_by": "tests"}))
    envs = (await api.client.get("/v1/envs")).json()["envs"]
    assert [e["name"] for e in envs] == ["echo", "fam:*"] and envs[1]["members"] == ["fam:alpha", "fam:beta"]
    r = await api.client.post("/v1/batches", json=body(env="fam:beta", group_size=1))
    assert r.status_code == 201, r.text
    batch_id = r.json()["batch_id"]
    # no live env worker has fam:beta: the batch shows its episodes wait, and fails none
    info = (await api.client.get(f"/v1/batches/{batch_id}")).json()
    assert info["waiting_for_env"] == {"fam:beta": 3} and info["counts"]["failed"] == 0
    items = await work_items(api.js, 3, route="fam")
    assert {ev.env for ev in items} == {"fam:beta"} and len(items) == 3
    r = await api.client.post("/v1/batches", json=body(env="fam:zeta"))
    assert r.status_code == 400 and "unknown env 'fam:zeta'" in r.json()["detail"]


async def test_oversized_batch_is_413_with_the_limit(nats_url: str, database_url: str, nc: bus.NATS) -> None:
    async with running(make_settings(nats_url, database_url, max_batch_episodes=5, max_task_bytes=1024), nc) as a:
        await register_env(a.js, "echo")
        r = await a.client.post("/v1/batches", json=body())
        assert r.status_code == 413
        assert "= 6 episodes; the limit is 5" in r.json()["detail"]
        r = await a.client.post("/v1/batches", json=body(tasks=[{"q": "x" * 2000}], group_size=1))
        assert r.status_code == 413 and "tasks[0] is" in r.json()["detail"]
        assert (await a.client.post("/v1/batches", json=body(group_size=1))).status_code == 201


async def test_bearer_tokens_guard_every_route_by_scope(nats_url: str, database_url: str, nc: bus.NATS) -> None:
    async with running(make_settings(nats_url, database_url, api_read_token=READ_TOKEN), nc) as a:
        await register_env(a.js, "echo")
        assert (await a.client.post("/v1/batches", json=body(batch_id="authz"))).status_code == 201
        routes = [("POST", "/v1/batches", body(batch_id="authz2")), ("POST", "/v1/batches/authz/cancel", None),
                  ("POST", "/v1/policy/versions", {"version": 1, "checkpoint": "/ckpt"}),
                  ("GET", "/v1/batches/authz", None), ("GET", "/v1/episodes/authz.0.0", None),
                  ("GET", "/v1/episodes/authz.0.0/trajectory", None), ("GET", "/v1/envs", None),
                  ("GET", "/v1/policy", None)]
        async with a.anonymous() as anon, a.anonymous({"Authorization": "Bearer nope-nope-nope"}) as wrong, \
                a.anonymous({"Authorization": f"Basic {TOKEN}"}) as basic, \
                a.anonymous({"Authorization": f"Bearer {READ_TOKEN}"}) as reader:
            for method, path, payload in routes:
                for client, what in ((anon, "missing"), (wrong, "invalid"), (basic, "missing")):
                    r = await client.request(method, path, json=payload)
                    assert r.status_code == 401, (method, path, what, r.text)
                    assert r.headers["www-authenticate"] == "Bearer" and r.json()["detail"].startswith(what)
                r = await reader.request(method, path, json=payload)
                if method == "POST":
                    assert r.status_code == 403, (path, r.text)
                    assert "needs 'write'" in r.json()["detail"]
                else:
                    assert r.status_code in (200, 404), (path, r.text)  # no trajectory yet: 404
            for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
                assert (await anon.get(open_path)).status_code == 200, open_path
        assert len(await episode_rows(a.engine, "authz2")) == 0
        async with a.engine.connect() as conn:
            assert (await conn.execute(select(batches.c.cancelled_at).where(batches.c.id == "authz"))).scalar() is None


async def test_metrics_behind_the_read_scope_when_configured(nats_url: str, database_url: str,
                                                              nc: bus.NATS) -> None:
    settings = make_settings(nats_url, database_url, api_read_token=READ_TOKEN, metrics_auth="read")
    async with running(settings, nc) as a, a.anonymous() as anon, \
            a.anonymous({"Authorization": f"Bearer {READ_TOKEN}"}) as reader:
        assert (await anon.get("/metrics")).status_code == 401
        assert (await anon.get("/healthz")).status_code == 200
        got = await reader.get("/metrics")
        assert got.status_code == 200 and "rollout_http_requests_total" in got.text


def test_settings_refuse_to_run_without_a_token_unless_auth_is_disabled(nats_url: str, database_url: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="ROLLOUT_API_TOKEN is not set"):
        make_settings(nats_url, database_url, api_token=None)
    with pytest.raises(ValidationError, match="its own secret"):
        make_settings(nats_url, database_url, api_read_token=TOKEN)
    assert make_settings(nats_url, database_url, api_token=None, api_auth="disabled").api_token is None


async def test_auth_disabled_serves_without_a_token(nats_url: str, database_url: str, nc: bus.NATS) -> None:
    async with running(make_settings(nats_url, database_url, api_token=None, api_auth="disabled"), nc) as a:
        await register_env(a.js, "echo")
        async with a.anonymous() as anon:
            assert (await anon.post("/v1/batches", json=body(batch_id="open"))).status_code == 201
            assert (await anon.get("/v1/batches/open")).status_code == 200


# --- GET /v1/batches/{id}, cancel ---------------------------------------------------------------


async def _set_status(engine: AsyncEngine, ep_id: str, status: str, reward: float | None = None) -> None:
    async with engine.begin() as conn:
        await conn.execute(update(episodes).where(episodes.c.id == ep_id).values(status=status, reward=reward))


def _trajectory_row(ep_id: str, batch_id: str, ids: list[int], prompt_len: int, ranges: list[list[int]],
                    reward: float) -> dict[str, Any]:
    mask = [0] * len(ids)
    for a, b in ranges:
        mask[a:b] = [1] * (b - a)
    return {"episode_id": ep_id, "episode_created_at": datetime.now(UTC), "batch_id": batch_id,
            "group_id": ep_id.rsplit(".", 1)[0], "env": "echo",
            "attempt": 1, "status": "completed", "reward": reward, "token_ids": ids, "loss_mask": mask,
            "logprobs": [-0.5 if m else 0.0 for m in mask], "weight_versions": [3 if m else -1 for m in mask],
            "action_ranges": ranges, "prompt_len": prompt_len, "num_tokens": len(ids),
            "num_sampled_tokens": sum(mask), "num_turns": len(ranges), "segments": [[0, len(ids)]]}


async def test_batch_counts_reward_and_done(api: Api) -> None:
    r = await api.client.post("/v1/batches", json=body(batch_id="counted"))
    ids = r.json()["episode_ids"]
    got = (await api.client.get("/v1/batches/counted")).json()
    assert got["counts"] == {str(s): (6 if s == EpisodeStatus.REQUESTED else 0) for s in EpisodeStatus}
    assert got["done"] is False and got["mean_reward"] is None and got["num_trajectories"] == 0
    assert got["num_published"] == 6 and got["sampling"]["temperature"] == 0.7 and got["cancelled_at"] is None

    await _set_status(api.engine, ids[0], "completed", 1.0)
    await _set_status(api.engine, ids[1], "truncated", 0.0)
    await _set_status(api.engine, ids[2], "failed", -5.0)  # failed: not in the mean
    await _set_status(api.engine, ids[3], "running")
    async with api.engine.begin() as conn:
        await conn.execute(trajectories.insert(), [_trajectory_row(ids[0], "counted", [1, 2, 3], 2, [[2, 3]], 1.0)])
    got = (await api.client.get("/v1/batches/counted")).json()
    assert got["counts"]["completed"] == 1 and got["counts"]["truncated"] == 1 and got["counts"]["failed"] == 1
    assert got["counts"]["running"] == 1 and got["counts"]["requested"] == 2 and got["counts"]["cancelled"] == 0
    assert got["mean_reward"] == pytest.approx(0.5) and got["num_trajectories"] == 1 and got["done"] is False

    for ep in ids[3:]:
        await _set_status(api.engine, ep, "aborted", 0.5)
    got = (await api.client.get("/v1/batches/counted")).json()
    assert got["done"] is True and got["mean_reward"] == pytest.approx(2.5 / 5)

    missing = await api.client.get("/v1/batches/nope")
    assert missing.status_code == 404 and missing.json()["detail"] == "unknown batch 'nope'"


async def test_cancel_moves_waiting_episodes_and_tells_env_workers(api: Api) -> None:
    ids = (await api.client.post("/v1/batches", json=body(batch_id="stopme"))).json()["episode_ids"]
    await _set_status(api.engine, ids[0], "running")
    await _set_status(api.engine, ids[1], "completed", 1.0)

    r = await api.client.post("/v1/batches/stopme/cancel")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["cancelled_now"] == 4
    assert out["counts"]["cancelled"] == 4 and out["counts"]["running"] == 1 and out["counts"]["completed"] == 1
    kv = await api.js.key_value(CANCEL_BUCKET)
    entry = await kv.get("stopme")
    assert entry.value is not None and datetime.fromisoformat(entry.value.decode()).tzinfo is not None

    again = (await api.client.post("/v1/batches/stopme/cancel")).json()
    assert again["cancelled_now"] == 0 and again["cancelled_at"] == out["cancelled_at"]
    got = (await api.client.get("/v1/batches/stopme")).json()
    assert got["cancelled_at"] is not None and got["done"] is False  # the running one ends via its worker
    assert (await api.client.post("/v1/batches/nope/cancel")).status_code == 404


# --- episodes ------------------------------------------------------------------------------------


async def test_episode_with_turns_and_steps_including_superseded(api: Api) -> None:
    ep = (await api.client.post("/v1/batches", json=body(batch_id="ep"))).json()["episode_ids"][0]
    now = datetime.now(UTC)
    turn = {"episode_id": ep, "turn_index": 0, "prompt_len": 4, "finish_reason": "stop", "weight_version": 1,
            "engine": "fake", "worker_id": "inf-1", "queue_ms": 1.0, "generate_ms": 2.0, "produced_at": now}
    async with api.engine.begin() as conn:
        await conn.execute(update(episodes).where(episodes.c.id == ep).values(
            status="running", attempt=2, prompt_token_ids=[5, 6, 7, 8], prompt_text="hi"))
        await conn.execute(turns.insert(), [
            {**turn, "event_id": f"{ep}:a1:t0:r1", "attempt": 1, "token_ids": [9], "logprobs": [-1.0],
             "superseded": True},
            {**turn, "event_id": f"{ep}:a2:t0:r1", "attempt": 2, "token_ids": [10, 11], "logprobs": [-0.25, -0.5],
             "superseded": False},
        ])
        await conn.execute(steps.insert(), [{
            "event_id": f"{ep}:a2:s0", "episode_id": ep, "attempt": 2, "turn_index": 0,
            "turn_event_id": f"{ep}:a2:t0:r1", "action": "x", "observation": "ok", "observation_token_ids": [12],
            "reward": 1.0, "terminated": True, "truncated": False, "info": {"k": 1}, "step_ms": 0.5,
            "produced_at": now}])
    r = await api.client.get(f"/v1/episodes/{ep}")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "running" and out["attempt"] == 2 and out["prompt_token_ids"] == [5, 6, 7, 8]
    assert out["task"] == {"q": "a"} and out["group_id"] == "ep.0"
    assert [(t["attempt"], t["superseded"], t["token_ids"]) for t in out["turns"]] == [(1, True, [9]),
                                                                                       (2, False, [10, 11])]
    assert out["turns"][1]["logprobs"] == [-0.25, -0.5]
    assert out["steps"][0]["observation_token_ids"] == [12] and out["steps"][0]["superseded"] is False
    assert out["steps"][0]["info"] == {"k": 1}
    missing = await api.client.get("/v1/episodes/nope.0.0")
    assert missing.status_code == 404 and "unknown episode" in missing.json()["detail"]


async def test_trajectory_decoded_by_span(nats_url: str, database_url: str, nc: bus.NATS, model_dir: str) -> None:
    tok = load_chat_tokenizer(model_dir)
    prompt = tok.render([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)
    pieces = [prompt, "Hi there!<|im_end|>", "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n",
              "Hi!<|im_end|>"]
    enc = [tok.encode(p).tolist() for p in pieces]
    ids = [i for e in enc for i in e]
    p, a1, o1 = len(enc[0]), len(enc[1]), len(enc[2])
    ranges = [[p, p + a1], [p + a1 + o1, len(ids)]]

    async with running(make_settings(nats_url, database_url, model=model_dir), nc) as a:
        await register_env(a.js, "echo")
        ep_ids = (await a.client.post("/v1/batches", json=body(batch_id="tr"))).json()["episode_ids"]
        ep = ep_ids[0]
        async with a.engine.begin() as conn:
            await conn.execute(trajectories.insert(), [_trajectory_row(ep, "tr", ids, p, ranges, 1.0)])
        r = await a.client.get(f"/v1/episodes/{ep}/trajectory")
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["token_ids"] == ids and out["action_ranges"] == ranges and out["reward"] == 1.0
        assert out["loss_mask"] == [1 if any(s <= i < e for s, e in ranges) else 0 for i in range(len(ids))]
        assert out["logprobs"][p] == -0.5 and out["status"] == "completed"
        assert out["text"] == "".join(pieces) and out["note"] is None
        assert [(s["kind"], s["turn_index"], s["text"]) for s in out["spans"]] == [
            ("prompt", None, pieces[0]), ("sampled", 0, pieces[1]), ("observation", 0, pieces[2]),
            ("sampled", 1, pieces[3])]

        none_yet = await a.client.get(f"/v1/episodes/{ep_ids[1]}/trajectory")
        assert none_yet.status_code == 404 and "has no trajectory yet (status requested)" in none_yet.json()["detail"]
        assert (await a.client.get("/v1/episodes/nope.1.1/trajectory")).status_code == 404

    async with running(make_settings(nats_url, database_url, model="/nonexistent/model"), nc) as a:
        out = (await a.client.get(f"/v1/episodes/{ep}/trajectory")).json()
        assert out["token_ids"] == ids and out["text"] is None
        assert all(s["text"] is None for s in out["spans"]) and "tokenizer.json" in out["note"]


# --- start-up, health -----------------------------------------------------------------------------


async def test_refuses_to_start_on_an_old_schema(nats_url: str, database_url: str, nc: bus.NATS) -> None:
    downgrade(database_url, "base")
    app = create_app(make_settings(nats_url, database_url))
    with pytest.raises(SchemaVersionError, match="rollout db upgrade"):
        async with app.router.lifespan_context(app):
            pass
    assert isinstance(app.state.scheduler.startup_error, SchemaVersionError)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://scheduler", headers=AUTH) as client:
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/v1/envs")).status_code == 503


async def test_ops_routes_and_openapi(api: Api) -> None:
    assert (await api.client.get("/healthz")).json()["alive"] is True
    ready = await api.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    schema = (await api.client.get("/openapi.json")).json()
    assert {"/v1/batches", "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", "/v1/episodes/{episode_id}",
            "/v1/episodes/{episode_id}/trajectory", "/v1/envs"} <= set(schema["paths"])
    assert (await api.client.get("/docs")).status_code == 200


async def test_large_batch_publishes_quickly(api: Api) -> None:
    tasks = [{"i": i} for i in range(1000)]
    started = time.monotonic()
    r = await api.client.post("/v1/batches", json=body(tasks=tasks, group_size=2))
    elapsed = time.monotonic() - started
    assert r.status_code == 201 and r.json()["num_published"] == 2000
    assert await work_count(api.js) == 2000
    assert elapsed < 15, f"2000 episodes took {elapsed:.1f}s"
    assert np.all([row["published_at"] is not None for row in await episode_rows(api.engine, r.json()["batch_id"])])
