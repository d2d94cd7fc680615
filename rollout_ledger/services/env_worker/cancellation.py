"""Keeps the set of cancelled batch ids current from a watch on the ``rl_cancelled`` KV bucket.

Only the scheduler writes that bucket (NATS permissions), and it writes the cancellation time as the value: an
entry whose value is not such a time is not the scheduler's and is ignored (logged), so garbage in the bucket
cancels nothing."""

from __future__ import annotations

import asyncio
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from rollout_ledger.shared.kit.bus import best_effort, bucket
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.subjects import CANCEL_BUCKET

log = get_logger(__name__)

_REMOVED = frozenset({KV_DEL, KV_PURGE})


class CancelWatch:
    """``is_cancelled(batch_id)`` answered from memory; the watch loads existing keys before ``start`` returns."""

    def __init__(self) -> None:
        self.cancelled: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    def is_cancelled(self, batch_id: str) -> bool:
        return batch_id in self.cancelled

    async def start(self, js: JetStreamContext, timeout_s: float = 10.0) -> None:
        kv = await bucket(js, CANCEL_BUCKET)
        self._watcher = await kv.watchall()
        loaded = asyncio.Event()
        self._task = asyncio.create_task(self._consume(self._watcher, loaded))
        async with asyncio.timeout(timeout_s):
            await loaded.wait()

    async def _consume(self, watcher: KeyValue.KeyWatcher, loaded: asyncio.Event) -> None:
        async for entry in watcher:
            if entry is None:
                loaded.set()
                continue
            if entry.operation in _REMOVED:
                self.cancelled.discard(entry.key)
            elif not _is_cancellation_time(entry.value):
                log.warning("batch.cancel_entry_refused", batch_id=entry.key, value=repr((entry.value or b"")[:100]),
                            reason="not the scheduler's cancellation time")
            else:
                if entry.key not in self.cancelled:
                    log.info("batch.cancelled", batch_id=entry.key)
                self.cancelled.add(entry.key)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._watcher is not None:
            with best_effort("stop the cancel marks' watcher"):
                await self._watcher.stop()


def _is_cancellation_time(value: bytes | None) -> bool:
    """Whether a ``rl_cancelled`` value is what the scheduler writes (``mark_cancelled``: an ISO 8601 time)."""
    try:
        datetime.fromisoformat((value or b"").decode())
    except (UnicodeDecodeError, ValueError):
        return False
    return True
