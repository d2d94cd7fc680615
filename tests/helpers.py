"""Small helpers for tests: wait on a condition with a deadline (sync or async), run SQL, read Prometheus counters,
the scheduler's test token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from sqlalchemy import create_engine, text

from rollout_ledger.migrations.runner import sync_url

T = TypeVar("T")

API_TOKEN = "tests-api-token-0123456789"
"""ROLLOUT_API_TOKEN of the schedulers the ``stack`` fixture starts (scopes read and write)."""
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
"""Headers of a client of those schedulers."""


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` and the last value after the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {last!r}")


async def until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``wait_for`` in a coroutine: await ``cond`` (a plain or an async function) until it returns something
    truthy; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await cond() if asyncio.iscoroutinefunction(cond) else cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


class Sql:
    """Synchronous SQL against a test database."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(sync_url(database_url))

    def rows(self, query: str, **params: Any) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(query), params)]

    def scalar(self, query: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(query), params).scalar()

    def execute(self, query: str, **params: Any) -> None:
        """One statement in a transaction of its own (the database owner's login: tests writing fixtures)."""
        with self.engine.begin() as conn:
            conn.execute(text(query), params)

    def close(self) -> None:
        self.engine.dispose()


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus metric's samples (matching ``labels``) from ``url``/metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total += float(value)
    return total
