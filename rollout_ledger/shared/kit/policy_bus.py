"""The policy buckets as a process reads and writes them: the announced versions (``rl_policy``: the kept history
and a watch of ``current``), the reports of the inference workers (``rl_policy_workers``) and of the env workers
(``rl_policy_env``) mirrored in memory, and the process's own report. The one reader for every service that follows
policy versions (inference workers, env workers).

A report bucket's entries expire when not written again within the bucket's TTL (``BUCKET_TTL_S``), and an expiry
leaves no event a watch would see (before nats-server 2.11); so the mirror drops a key itself when it has seen no
new report under it for the TTL, and a worker that stops deletes its key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Generic, TypeVar

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import BaseModel

from rollout_ledger.shared.errors import BusError, SchemaError
from rollout_ledger.shared.kit.bus import best_effort, bus_errors
from rollout_ledger.shared.kit.bus import bucket as bus_bucket
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import sleep_or_stop
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.policy_versions import PolicyAnnouncement, read_value
from rollout_ledger.shared.subjects import BUCKET_TTL_S, POLICY_BUCKET, POLICY_KEY

log = get_logger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_REMOVED = frozenset({KV_DEL, KV_PURGE})

RECHECK_S = 0.5
"""A wait on reports looks again this often without a change (expiry and liveness leave no event)."""


def parse_announcement(value: bytes | None) -> PolicyAnnouncement | None:
    """The announcement in a ``rl_policy`` value; None (logged) for an empty or unreadable one."""
    try:
        return read_value(PolicyAnnouncement, value)
    except SchemaError as exc:
        log.warning("policy.bad_announcement", error=str(exc))
        return None


class PolicyBus:
    """The policy buckets of one process (opened on first use)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: dict[str, KeyValue] = {}

    async def bucket(self, name: str) -> KeyValue:
        kv = self._kv.get(name)
        if kv is None:
            kv = self._kv[name] = await bus_bucket(self.js, name)
        return kv

    async def announced(self) -> list[PolicyAnnouncement]:
        """The announcements ``rl_policy`` still holds (``BUCKET_HISTORY``), oldest first; the current one always.

        The current value is read directly: nats-py's ``history`` can end before the first entry reaches it (its
        watcher signals "no more" when the consumer has none pending and none was handled yet, while the entries
        are still on their way), and a worker starting on a busy machine then missed the announced version."""
        kv = await self.bucket(POLICY_BUCKET)
        try:
            latest = await kv.get(POLICY_KEY)
        except KeyNotFoundError:  # never announced, or deleted
            return []
        try:
            entries = list(await kv.history(POLICY_KEY))
        except (KeyNotFoundError, NoKeysError):
            entries = []
        if all(e.revision != latest.revision for e in entries):
            entries.append(latest)
        parsed = [parse_announcement(e.value) for e in entries if e.value]
        return sorted((a for a in parsed if a is not None), key=lambda a: a.version)

    async def current(self) -> PolicyAnnouncement | None:
        """The current announcement (the newest version announced), or None."""
        announced = await self.announced()
        return announced[-1] if announced else None

    async def follow(self, apply: Callable[[PolicyAnnouncement], Awaitable[None]], stopped: asyncio.Event) -> None:
        """Until ``stopped``: ``apply`` every announcement put into ``current`` (the current one first), one at a time;
        a lost watch (NATS restarting) is watched again, which replays the current value."""
        kv = await self.bucket(POLICY_BUCKET)
        while not stopped.is_set():
            try:
                watcher = await kv.watch(POLICY_KEY)
                try:
                    while not stopped.is_set():
                        try:
                            entry = await watcher.updates(timeout=1.0)
                        except TimeoutError:
                            continue
                        if entry is None or entry.value is None or entry.operation in _REMOVED:
                            continue
                        announcement = parse_announcement(entry.value)
                        if announcement is not None:
                            await apply(announcement)
                finally:
                    with best_effort("stop a policy watcher"):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost watch or a failed ``apply``: watch again (it replays the current value)
                log.warning("policy.watch_lost", bucket=POLICY_BUCKET, error=f"{type(exc).__name__}: {exc}")
                await sleep_or_stop(stopped, 1.0)

    async def put(self, bucket: str, key: str, report: BaseModel) -> bool:
        """Put this process's report; False (logged) when it could not (the next periodic report repairs it)."""
        try:
            with bus_errors(f"put a report into {bucket}"):
                kv = await self.bucket(bucket)
                await kv.put(key, orjson.dumps(report.model_dump(mode="json")))
        except BusError as exc:
            log.warning("policy.report_failed", bucket=bucket, error=str(exc))
            return False
        return True

    async def delete(self, bucket: str, key: str) -> None:
        """Remove this process's report (it stops: nobody should wait for it); best effort."""
        with best_effort("delete a report"):
            kv = await self.bucket(bucket)
            await kv.delete(key)

    def reports(self, bucket: str, model: type[_M]) -> ReportMirror[_M]:
        """A mirror of a report bucket (``start`` it)."""
        return ReportMirror(self, bucket, model, BUCKET_TTL_S.get(bucket))


class ReportMirror(Generic[_M]):
    """The latest report under each key of one bucket, kept in memory by a watch (see the module docstring)."""

    def __init__(self, bus: PolicyBus, bucket: str, model: type[_M], ttl_s: float | None) -> None:
        self.bus = bus
        self.bucket = bucket
        self.model = model
        self.ttl_s = ttl_s
        self._reports: dict[str, tuple[_M, float]] = {}
        """Key -> (report, monotonic time it was written, as far as this process can tell)."""
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change the watch sees."""
        self._listeners.append(listener)

    def live(self) -> dict[str, _M]:
        """Key -> report, for the keys written within the TTL and not deleted."""
        now = time.monotonic()
        return {key: report for key, (report, seen) in self._reports.items()
                if self.ttl_s is None or now - seen <= self.ttl_s}

    async def start(self, timeout_s: float = 10.0) -> None:
        """Watch the bucket; returns once the reports it held are loaded."""
        loaded = asyncio.Event()
        self._task = asyncio.create_task(self._watch(loaded), name=f"mirror-{self.bucket}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(loaded.wait(), timeout_s)
        if not loaded.is_set():
            log.warning("policy.reports_not_loaded", bucket=self.bucket, waited_s=timeout_s)

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            await cancel_and_wait(self._task, raise_errors=False)
            self._task = None

    async def wait_until(self, done: Callable[[dict[str, _M]], bool], timeout_s: float | None) -> bool:
        """Wait until ``done(live reports)``; False when ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not done(self.live()):
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RECHECK_S if left is None else min(RECHECK_S, left))
        return True

    def _apply(self, entry: KeyValue.Entry) -> None:
        if entry.operation in _REMOVED or not entry.value:
            self._reports.pop(entry.key, None)
        else:
            try:
                report = read_value(self.model, entry.value)
            except SchemaError as exc:
                log.warning("policy.bad_report", bucket=self.bucket, key=entry.key, error=str(exc))
                return
            if report is None:
                return
            self._reports[entry.key] = (report, time.monotonic() - _age_s(entry.created))
        self._changed.set()
        for listener in self._listeners:
            listener()

    async def _watch(self, loaded: asyncio.Event) -> None:
        while not self._stopped.is_set():
            try:
                kv = await self.bus.bucket(self.bucket)
                watcher = await kv.watchall()
                try:
                    while not self._stopped.is_set():
                        try:
                            entry = await watcher.updates(timeout=1.0)
                        except TimeoutError:
                            continue
                        if entry is None:
                            loaded.set()
                            continue
                        self._apply(entry)
                finally:
                    with best_effort("stop a policy watcher"):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost watch: watch again (it replays each key's latest report)
                log.warning("policy.watch_lost", bucket=self.bucket, error=f"{type(exc).__name__}: {exc}")
                await sleep_or_stop(self._stopped, 1.0)


def _age_s(created: object) -> float:
    """How long ago the server stored an entry (nats-py gives a datetime, typed as an int; 0 when unknown or in
    the future of this clock)."""
    if not isinstance(created, datetime):
        return 0.0
    return max(0.0, (datetime.now(UTC) - created).total_seconds())
