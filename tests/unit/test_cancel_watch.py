"""The env worker's cancel watch on real NATS: the scheduler's entries cancel, garbage in the bucket does not."""

from __future__ import annotations

from datetime import UTC, datetime

from rollout_ledger.services.env_worker.cancellation import CancelWatch
from rollout_ledger.services.scheduler.env_registry import mark_cancelled
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import CANCEL_BUCKET
from tests.helpers import until


async def test_only_the_schedulers_entries_cancel(nc: bus.NATS) -> None:
    js = nc.jetstream()
    kv = await js.key_value(CANCEL_BUCKET)
    await kv.put("garbage", b"\xff\x00 not a time")
    await kv.put("empty", b"")
    await mark_cancelled(kv, "early", datetime.now(UTC))
    watch = CancelWatch()
    await watch.start(js)
    try:
        assert watch.cancelled == {"early"}
        await kv.put("late-garbage", b"{}")
        await mark_cancelled(kv, "late", datetime.now(UTC))
        await until(lambda: "late" in watch.cancelled, 5.0, "the watch to see the late cancel")
        assert watch.cancelled == {"early", "late"}
        assert not watch.is_cancelled("garbage") and not watch.is_cancelled("late-garbage")
    finally:
        await watch.stop()
