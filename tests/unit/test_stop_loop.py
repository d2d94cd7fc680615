"""The one stop loop of every service (rollout_ledger/shared/kit/runtime.py): ``ticks`` runs a duty at once, then every
interval, and ends as soon as its ``Stop`` (a ``Shutdown`` or an ``asyncio.Event``) is set; ``sleep_or_stop`` is its
pause."""

from __future__ import annotations

import asyncio

import pytest

from rollout_ledger.shared.kit.runtime import Shutdown, Stop, sleep_or_stop, ticks


@pytest.mark.parametrize("kind", ["shutdown", "event"])
async def test_ticks_run_at_once_then_every_interval_until_stopped(kind: str) -> None:
    stop: Stop = Shutdown() if kind == "shutdown" else asyncio.Event()
    seen: list[int] = []
    async for tick in ticks(stop, 0.001):
        seen.append(tick)
        if tick == 4:
            (stop.event if isinstance(stop, Shutdown) else stop).set()
    assert seen == [0, 1, 2, 3, 4], "the body runs whole; the loop ends at the stop, with no tick after it"


async def test_a_stop_ends_the_pause_at_once_not_after_the_interval() -> None:
    stop = asyncio.Event()
    first = asyncio.Event()
    seen: list[int] = []

    async def loop() -> None:
        async for tick in ticks(stop, 3600.0):
            seen.append(tick)
            first.set()

    task = asyncio.create_task(loop())
    await first.wait()
    stop.set()
    await asyncio.wait_for(task, 5)  # an hour's interval: only the stop ends this wait
    assert seen == [0]


async def test_a_stopped_loop_never_runs_and_a_loop_not_at_once_waits_first() -> None:
    stop = asyncio.Event()
    stop.set()
    assert [t async for t in ticks(stop, 0.0)] == []
    assert [t async for t in ticks(stop, 0.0, at_once=False)] == []
    running = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, running.set)
    seen = [t async for t in ticks(running, 3600.0, at_once=False)]
    assert seen == [], "stopped during the first pause: the duty that ran at start is not run again"


async def test_sleep_or_stop_says_whether_it_was_stopped() -> None:
    shutdown = Shutdown()
    assert await sleep_or_stop(shutdown, 0.0) is False
    asyncio.get_running_loop().call_soon(shutdown.event.set)
    assert await sleep_or_stop(shutdown, 3600.0) is True
    assert await sleep_or_stop(shutdown, 3600.0) is True, "already set: returns at once"
