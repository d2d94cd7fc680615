"""Small helpers for tests: the one way to wait on a condition with a deadline (sync or async), run SQL, read
Prometheus counters, the scheduler's test token."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from sqlalchemy import create_engine, text

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.events import EventBase, encode
from rollout_ledger.shared.subjects import MSG_ID_HEADER, subject_of

T = TypeVar("T")

API_TOKEN = "tests-api-token-0123456789"
"""ROLLOUT_API_TOKEN of the schedulers the ``stack`` fixture starts (scopes read and write)."""
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
"""Headers of a client of those schedulers."""


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Poll ``cond`` until it returns something truthy and return that; fail with ``what`` and the last value once
    ``timeout_s`` has passed (``cond`` runs at least once, and once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = cond()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {last!r}")
        time.sleep(interval_s)


async def until(cond: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition",
                interval_s: float = 0.05) -> Any:
    """``wait_for`` in a coroutine: ``cond`` may be a plain function or return an awaitable (an async function, a
    lambda calling one), awaited each time; the event loop runs between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = cond()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval_s)


class FakeClock:
    """A clock (``Callable[[], float]``, like ``time.monotonic``) that moves only when the test moves it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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


def metric_in(exposition: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus metric's samples (matching ``labels``) in the text ``exposition`` of a /metrics page."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total += float(value)
    return total


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus metric's samples (matching ``labels``) from ``url``/metrics."""
    return metric_in(httpx.get(f"{url}/metrics", timeout=5).text, name, labels)


async def metric_async(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """``metric`` without blocking the event loop (a service served from the test's own loop)."""
    async with httpx.AsyncClient() as client:
        return metric_in((await client.get(f"{url}/metrics", timeout=5)).text, name, labels)


async def publish_event(js: Any, event: EventBase, route: str | None = None) -> None:
    """Put ``event`` on its stream as a test stands in for a service (the services publish through their producer,
    rollout_ledger/shared/kit/publisher.py): its subject (a work item's: its ``route``'s), ``Nats-Msg-Id`` its
    ``event_id``, awaiting the stream's ack."""
    await js.publish(subject_of(str(event.type), route), encode(event), timeout=10,
                     headers={MSG_ID_HEADER: str(event.event_id)})

