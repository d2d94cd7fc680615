"""Stopping background tasks for certain: cancel them, and cancel again any that runs on.

A plain ``task.cancel(); await task`` can wait forever on Python 3.11. Its ``asyncio.wait_for`` (under every
nats-py request: a lease refresh, a KV put, a JetStream publish) returns the result of a future that completed in
the same loop iteration as the cancellation, and the cancellation is lost (gh-86296; 3.12 rewrote ``wait_for``).
A loop task cancelled while one of its requests was being answered then goes on looping, and whoever awaits it
waits for good. An env worker's episode hung that way after its end, its lease keeper still renewing, and held a
policy drain open (tests/integration/test_live_weights.py under a loaded CPU).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.5
"""How long a cancelled task may run on before it is cancelled again. Long enough for a task's own clean-up on
cancellation (an unsubscribe, a nak) to finish undisturbed, short against any wait a caller would notice."""


async def cancel_and_wait(tasks: asyncio.Future[Any] | Iterable[asyncio.Future[Any] | None] | None, *,
                          raise_errors: bool = True, recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` (one, or several; None is skipped) and return once every one has ended, cancelling again
    every ``recancel_s`` those still running. A task's ``CancelledError`` is dropped; the first other exception a
    task ended with is raised once all have ended, unless ``raise_errors`` is False. When the caller is cancelled
    meanwhile, its ``CancelledError`` goes through (the tasks stay cancelled)."""
    if tasks is None:
        return
    batch = [tasks] if isinstance(tasks, asyncio.Future) else [t for t in tasks if t is not None]
    running = [t for t in batch if not t.done()]
    while running:
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=recancel_s)
        running = [t for t in running if not t.done()]
    errors = [exc for t in batch if not t.cancelled() and (exc := t.exception()) is not None]
    if errors and raise_errors:
        raise errors[0]
