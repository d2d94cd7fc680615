"""The env worker's drain on SIGTERM: the episodes in flight get ``drain_timeout_s`` to finish; the rest are
cancelled, which hands their work items back (``episode_runner.py``)."""

from __future__ import annotations

import asyncio

from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tasks import cancel_and_wait

log = get_logger(__name__)


async def drain(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Let the episode ``tasks`` finish within ``timeout_s``; cancel (and so nak) the rest."""
    if not tasks:
        return
    log.info("env_worker.draining", in_flight=len(tasks), timeout_s=timeout_s)
    _, pending = await asyncio.wait(set(tasks), timeout=timeout_s)
    await cancel_and_wait(pending, raise_errors=False)
    log.info("env_worker.drained", handed_back=len(pending))
