"""A hostile client against the scheduler API (issue 16, part 1): every malformed request is a 4xx naming the field
and the problem, never a 5xx, never database text, and nothing reaches Postgres or the work queue.

The in-process scheduler of test_scheduler_api (real NATS and Postgres) with its default limits.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from starlette.requests import Request

from rollout_ledger.services.scheduler.api.error_responses import on_unavailable
from rollout_ledger.services.scheduler.api.guard import check_body
from rollout_ledger.shared.db import batches, episodes, policy_versions
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import ENVS_BUCKET
from tests.integration.test_scheduler_api import Api, body, make_settings, register_env, running, work_count

SQL_WORDS = ("select ", "insert ", "update ", "psycopg", "sqlalchemy", "postgres", "violates", "traceback")


def deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = {"x": value}
    return value


def raw(obj_text: str) -> bytes:
    """A body written by hand (to hold what ``json.dumps`` would refuse or escape)."""
    return obj_text.encode("utf-8", "surrogatepass")


BASE = '"env": "echo", "group_size": 1'

# (what, method, path, body (dict: as JSON; bytes: as is; None: none), status, field, words in the message)
CASES: list[tuple[str, str, str, Any, int, str, str]] = [
    ("int beyond 64 bits in a task", "POST", "/v1/batches", body(tasks=[{"n": 2**70}]), 422, "tasks.0.n", "64-bit"),
    ("negative int beyond 64 bits in metadata", "POST", "/v1/batches", body(metadata={"a": [-(2**64)]}), 422,
     "metadata.a.0", "64-bit"),
    ("int beyond 64 bits as group_size", "POST", "/v1/batches", body(group_size=2**64), 422, "group_size", "64-bit"),
    ("group_size beyond int32", "POST", "/v1/batches", body(group_size=2**40), 422, "group_size",
     "less than or equal"),
    ("seed beyond 64 bits", "POST", "/v1/batches", body(sampling={"seed": 2**65}), 422, "sampling.seed", "64-bit"),
    ("max_tokens at int64 max", "POST", "/v1/batches", body(sampling={"max_tokens": 2**63 - 1}), 422,
     "sampling.max_tokens", "less than or equal"),
    ("episodes_per_version beyond int32", "POST", "/v1/batches", body(max_staleness=1, episodes_per_version=2**40),
     422, "episodes_per_version", "less than or equal"),
    ("a task nested 300 deep", "POST", "/v1/batches", body(tasks=[deep(300)]), 422, "tasks.0" + ".x" * 30,
     "nested deeper than 32"),
    ("metadata nested 40 deep", "POST", "/v1/batches", body(metadata=deep(40)), 422, "metadata" + ".x" * 31,
     "nested deeper"),
    ("a body nested 100000 deep", "POST", "/v1/batches", raw("[" * 100_000 + "]" * 100_000), 422, "body",
     "nested deeper"),
    ("lone surrogate in a task", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{"q": "a\\ud800b"}]}'), 422,
     "tasks.0.q", "lone UTF-16 surrogate (U+D800)"),
    ("lone low surrogate in a key", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{"\\udc00": 1}]}'), 422,
     "tasks.0", "an object key contains a lone UTF-16 surrogate"),
    ("lone surrogate in env", "POST", "/v1/batches", raw('{"env": "e\\udfff", "tasks": [{}]}'), 422, "env",
     "surrogate"),
    ("lone surrogate in metadata", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{}], "metadata": '
                                                              '{"k": ["\\ud83d"]}}'), 422, "metadata.k.0",
     "surrogate"),
    ("NUL in env", "POST", "/v1/batches", body(env="ech\x00o"), 422, "env", "NUL character"),
    ("NUL in a task", "POST", "/v1/batches", body(tasks=[{"q": "a\x00"}]), 422, "tasks.0.q", "NUL character"),
    ("NUL in a metadata key", "POST", "/v1/batches", body(metadata={"k\x00": 1}), 422, "metadata", "NUL character"),
    ("NUL in batch_id", "POST", "/v1/batches", body(batch_id="ab\x00cd"), 422, "batch_id", "NUL character"),
    ("NUL in a stop string", "POST", "/v1/batches", body(sampling={"stop": ["\x00"]}), 422, "sampling.stop.0",
     "NUL"),
    ("NaN temperature", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{}], "sampling": '
                                                   '{"temperature": NaN}}'), 422, "sampling.temperature",
     "NaN is not a JSON number"),
    ("Infinity in a task", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{"r": -Infinity}]}'), 422,
     "tasks.0.r", "-Infinity is not a JSON number"),
    ("1e400 in a task", "POST", "/v1/batches", raw('{' + BASE + ', "tasks": [{"r": 1e400}]}'), 422, "tasks.0.r",
     "infinity"),
    ("a string over the limit", "POST", "/v1/batches", body(tasks=[{"q": "x" * (256 * 1024 + 1)}]), 422,
     "tasks.0.q", "ROLLOUT_MAX_STRING_CHARS"),
    ("not UTF-8", "POST", "/v1/batches", b'{"env": "\xff\xfe", "tasks": [{}]}', 422, "body", "not UTF-8"),
    ("not JSON", "POST", "/v1/batches", b'{"env": "echo", "tasks": [{}]', 422, "body", "not JSON"),
    ("a JSON string as body", "POST", "/v1/batches", b'"hello"', 422, "body", "valid dictionary"),
    ("tasks not a list", "POST", "/v1/batches", body(tasks={"q": 1}), 422, "tasks", "valid list"),
    ("no tasks", "POST", "/v1/batches", body(tasks=[]), 422, "tasks", "at least 1"),
    ("a task not an object", "POST", "/v1/batches", body(tasks=[1]), 422, "tasks.0", "valid dictionary"),
    ("env too long", "POST", "/v1/batches", body(env="e" * 129), 422, "env", "at most 128"),
    ("max_turns zero", "POST", "/v1/batches", body(max_turns=0), 422, "max_turns", "greater than or equal to 1"),
    ("metadata not an object", "POST", "/v1/batches", body(metadata=[1]), 422, "metadata", "valid dictionary"),
    ("episodes_per_version without a bound", "POST", "/v1/batches", body(episodes_per_version=2), 400,
     "", "episodes_per_version: it bounds"),
    ("a boolean as max_staleness", "POST", "/v1/batches", body(max_staleness=False), 422, "max_staleness",
     "not a boolean"),
    ("a string as group_size", "POST", "/v1/batches", body(group_size="2"), 422, "group_size", "not a string"),
    ("a string as a version", "POST", "/v1/policy/versions", {"version": "1", "checkpoint": "/c"}, 422, "version",
     "not a string"),
    ("metadata over its limit", "POST", "/v1/batches", body(metadata={"blob": "x" * 200_000}), 413, "",
     "ROLLOUT_MAX_METADATA_BYTES"),
    ("a task over its limit", "POST", "/v1/batches", body(tasks=[{f"k{i}": "x" * 1000 for i in range(300)}]), 413,
     "", "ROLLOUT_MAX_TASK_BYTES"),
    ("too many episodes", "POST", "/v1/batches", body(tasks=[{}] * 101, group_size=100), 413, "",
     "ROLLOUT_MAX_BATCH_EPISODES"),
    ("%00 in a batch id", "GET", "/v1/batches/ab%00cd", None, 422, "batch_id", "should match pattern"),
    ("%00 in a cancelled batch id", "POST", "/v1/batches/ab%00cd/cancel", None, 422, "batch_id", "pattern"),
    ("a surrogate's bytes in a batch id", "GET", "/v1/batches/%ED%A0%80", None, 422, "batch_id", "pattern"),
    ("%00 in an episode id", "GET", "/v1/episodes/b.0.0%00", None, 422, "episode_id", "should match pattern"),
    ("%00 in a trajectory's episode id", "GET", "/v1/episodes/%00.1.2/trajectory", None, 422, "episode_id",
     "pattern"),
    ("an episode id of 300 characters", "GET", "/v1/episodes/" + "a" * 300, None, 422, "episode_id", "pattern"),
    ("a batch id of 65 characters", "GET", "/v1/batches/" + "a" * 65, None, 422, "batch_id", "pattern"),
    ("policy version beyond 64 bits", "POST", "/v1/policy/versions", {"version": 2**80, "checkpoint": "/c"}, 422,
     "version", "64-bit"),
    ("policy version beyond int32", "POST", "/v1/policy/versions", {"version": 2**40, "checkpoint": "/c"}, 422,
     "version", "less than or equal"),
    ("NUL in a checkpoint", "POST", "/v1/policy/versions", {"version": 1, "checkpoint": "/c\x00"}, 422,
     "checkpoint", "NUL"),
    ("NaN as a version", "POST", "/v1/policy/versions", raw('{"version": NaN, "checkpoint": "/c"}'), 422,
     "version", "NaN"),
    ("lone surrogate in notes", "POST", "/v1/policy/versions",
     raw('{"version": 1, "checkpoint": "/c", "notes": "\\udbff"}'), 422, "notes", "surrogate"),
    ("a bad swap mode", "POST", "/v1/policy/versions", {"version": 1, "checkpoint": "/c", "mode": "now"}, 422,
     "mode", "drain"),
]


@pytest.fixture
async def api(nats_url: str, database_url: str, nc: bus.NATS) -> AsyncIterator[Api]:
    async with running(make_settings(nats_url, database_url, max_batch_episodes=10_000), nc) as a:
        await register_env(a.js, "echo")
        yield a


async def _send(client: httpx.AsyncClient, method: str, path: str, payload: Any) -> httpx.Response:
    if payload is None:
        return await client.request(method, path)
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return await client.request(method, path, content=content, headers={"content-type": "application/json"})


def _no_internals(r: httpx.Response) -> None:
    text = r.text.lower()
    assert not any(word in text for word in SQL_WORDS), r.text


async def test_every_malformed_request_is_a_4xx_naming_the_field(api: Api) -> None:
    seen: list[tuple[str, int]] = []
    for what, method, path, payload, code, field, words in CASES:
        r = await _send(api.client, method, path, payload)
        seen.append((what, r.status_code))
        assert r.status_code == code, (what, r.status_code, r.text[:500])
        _no_internals(r)
        out = r.json()
        if code == 422:
            fields = [d["field"] for d in out["detail"]]
            assert field in fields, (what, fields)
            assert f"{field}: " in out["message"] and words in out["message"], (what, out["message"])
        else:
            assert words in out["detail"], (what, out)
    assert len(seen) == len(CASES) >= 45
    async with api.engine.connect() as conn:
        for table in (batches, episodes, policy_versions):
            assert (await conn.execute(select(func.count()).select_from(table))).scalar() == 0, table.name
    assert await work_count(api.js) == 0
    # the same request, well-formed, is accepted
    assert (await api.client.post("/v1/batches", json=body(tasks=[{"n": 2**63 - 1, "s": "é\u2028😀"}]))).status_code \
        == 201


async def test_a_body_over_the_limit_is_413_before_it_is_parsed(api: Api) -> None:
    tasks = ",".join(f'{{"q": {i}}}' for i in range(1_000_000))
    huge = f'{{"env": "echo", "tasks": [{tasks}]}}'.encode()
    assert len(huge) > 10 * 1024 * 1024
    r = await api.client.post("/v1/batches", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert "(Content-Length)" in r.json()["detail"] and "ROLLOUT_MAX_BODY_BYTES" in r.json()["detail"]

    chunks_read = 0

    async def stream() -> AsyncIterator[bytes]:  # no Content-Length: counted while it streams
        nonlocal chunks_read
        for _ in range(1000):
            chunks_read += 1
            yield b" " * (1024 * 1024)

    r = await api.client.post("/v1/batches", content=stream(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over 10485760 bytes" in r.json()["detail"]
    assert chunks_read <= 12  # it stopped reading at the limit
    async with api.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(batches))).scalar() == 0


async def test_openapi_declares_limits_413_and_a_registered_example_env(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    limits = schema["info"]["x-limits"]
    assert limits["max_body_bytes"] == 10 * 1024 * 1024 and limits["max_json_depth"] == 32
    for path, op in (("/v1/batches", "post"), ("/v1/batches/{batch_id}/cancel", "post"),
                     ("/v1/policy/versions", "post")):
        assert {"401", "403", "413", "422"} <= set(schema["paths"][path][op]["responses"]), path
    for path, item in schema["paths"].items():
        for op in item.values():
            assert op["security"] == [{"HTTPBearer": []}], path
    example = schema["components"]["schemas"]["BatchCreate"]["properties"]["env"]["examples"][0]
    from rollout_ledger.services.envs.builtins import builtin_registry

    assert example in builtin_registry().names()


async def test_listing_envs_leaves_no_consumer(api: Api) -> None:
    await register_env(api.js, "countdown")
    for _ in range(40):
        got = (await api.client.get("/v1/envs")).json()["envs"]
        assert [e["name"] for e in got] == ["countdown", "echo"]
    r = await api.client.post("/v1/batches", json=body(env="nope"))
    assert r.status_code == 400 and r.json()["detail"].endswith("known envs: countdown, echo")
    info = await api.js.stream_info(f"KV_{ENVS_BUCKET}")
    assert info.state.consumer_count == 0
    kv = await api.js.key_value(ENVS_BUCKET)
    await kv.delete("countdown")
    assert [e["name"] for e in (await api.client.get("/v1/envs")).json()["envs"]] == ["echo"]


async def test_a_database_failure_is_503_without_its_text() -> None:
    exc = StoreError('insert batch: value "x" violates check constraint; SELECT * FROM batches WHERE id = \'a\'')
    request = Request({"type": "http", "method": "POST", "path": "/v1/batches", "headers": [], "query_string": b""})
    r = await on_unavailable(request, exc)
    assert r.status_code == 503
    assert json.loads(bytes(r.body)) == {"detail": "the database is unavailable (retry later)"}


def test_the_guard_walks_iteratively_and_stops_at_ten_problems() -> None:
    many = json.dumps({"tasks": [{"n": 2**64 + i} for i in range(50)]}).encode()
    found = check_body(many, 32, 1000)
    assert len(found) == 10 and found[0].loc == ("tasks", 0, "n")
    assert check_body(b'{"a": [1, 2.5, true, null, "ok", {"b": -9223372036854775808}]}', 32, 1000) == []
    assert check_body(b'{"a": 9223372036854775808}', 32, 1000)[0].type == "int_out_of_range"
