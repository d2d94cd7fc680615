"""The env worker's pull loop: for each route, while slots are free (``routing.FairSlots``) and no policy version
is being drained (``policy_gate.py``), fetch that many work items from the route's consumer and start a task for
each, which the gate admits before it runs the item; the tasks in flight are what ``concurrency`` bounds and what
the drain waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg

from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.services.env_worker.routing import FairSlots
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.work_consumers import WorkConsumers
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import Shutdown, sleep_or_stop

log = get_logger(__name__)

Handler = Callable[[Msg], Coroutine[Any, Any, None]]
"""Runs one delivered work item to its end (``EpisodeRunner.handle``)."""


class PullLoop:
    """Pulls work items into tasks, at most ``settings.concurrency`` in flight, shared fairly among the routes."""

    def __init__(self, consumers: WorkConsumers, gate: EpisodeGate, settings: EnvWorkerSettings,
                 stopping: asyncio.Event) -> None:
        self.consumers = consumers
        self.gate = gate
        self.settings = settings
        self._stopping = stopping
        self.tasks: set[asyncio.Task[None]] = set()
        """The work items in flight, one task each."""
        self.slots = FairSlots(settings.concurrency, settings.fetch_batch, lambda: len(self.tasks))
        self._ping_s = settings.ack_wait_s / 3
        """In-progress pings for an item held at the gate: three per ack wait."""

    async def pull(self, route: str, handle: Handler, shutdown: Shutdown) -> None:
        """Pull the work items of one route (or the legacy subject) while slots are free, until ``shutdown``."""
        s = self.settings
        backoff = Backoff(0.1, 2.0, jitter=0.5)
        await self.consumers.bind(route, shutdown)
        while not shutdown.requested:
            if not self.gate.is_open:  # a policy version is being drained: take no new work item
                await _first(self.gate.wait_open(self._stopping), shutdown.wait())
                continue
            granted = self.slots.grant(route)
            if granted <= 0:
                changed = self.slots.changed()
                await _first(changed.wait(), shutdown.wait())
                continue
            try:
                msgs = await bus.fetch(self.consumers[route], granted, timeout=s.fetch_timeout_s)
            except BusError as exc:  # reconnecting, or the stream electing a leader (503): again after a pause
                self.slots.settle(route, granted, 0)
                pause = backoff.delay()
                log.warning("work.fetch_failed", route=route or "(legacy)", error=str(exc), retryable=exc.retryable,
                            pause_s=round(pause, 3))
                await sleep_or_stop(shutdown, pause)
                if not exc.retryable:  # e.g. the consumer is gone: declare it and bind a pull to it again
                    await self.consumers.rebind(route, shutdown)
                continue
            backoff.retries = 0
            for msg in msgs:
                if shutdown.requested:
                    with bus.best_effort("nak an item past the free slots"):
                        await msg.nak()
                    continue
                task = asyncio.create_task(self._admitted(handle, msg))
                self.tasks.add(task)
                task.add_done_callback(self._task_done)
            self.slots.settle(route, granted, len(msgs))
            if not msgs:
                await asyncio.sleep(0)  # let the routes woken by this settle take the slot before probing again

    async def _admitted(self, handle: Handler, msg: Msg) -> None:
        """Run one item once the gate admits it: at once, or after the policy version being drained in serves (a
        gate that closed during the fetch), the item kept in progress meanwhile; handed back when the worker
        stops first. The gate counts it as running until ``handle`` returns."""
        if self.gate.is_open:
            admitted = await self.gate.admit(self._stopping)
        else:
            async with bus.keep_in_progress(msg, self._ping_s):
                admitted = await self.gate.admit(self._stopping)
        if not admitted:
            with bus.best_effort("hand back an item held at the gate past the stop"):
                await msg.nak()
            return
        try:
            await handle(msg)
        finally:
            self.gate.finished()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.slots.notify()


async def _first(*aws: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of the coroutines completes; cancel the others."""
    tasks = [asyncio.create_task(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
