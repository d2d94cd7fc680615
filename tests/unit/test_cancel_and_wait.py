"""``cancel_and_wait`` stops a loop task whose cancellation ``asyncio.wait_for`` lost (Python 3.11), which a plain
``task.cancel(); await task`` waits for forever."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rollout_ledger.shared.kit.tasks import cancel_and_wait


class _Requester:
    """A loop task like a lease keeper: each round, a request (``wait_for`` on a reply future, as nats-py does)."""

    def __init__(self) -> None:
        self.reply: asyncio.Future[int] | None = None
        self.rounds = 0
        self.asking = asyncio.Event()

    async def run(self) -> None:
        while True:
            self.reply = asyncio.get_running_loop().create_future()
            self.asking.set()
            await asyncio.wait_for(self.reply, 10.0)
            self.rounds += 1
            self.asking.clear()
            await asyncio.sleep(0.01)


async def _cancel_as_the_reply_comes(loop_task: asyncio.Task[None], requester: _Requester) -> None:
    await requester.asking.wait()
    assert requester.reply is not None
    requester.reply.set_result(1)  # the reply lands ...
    loop_task.cancel()  # ... in the same loop iteration as the cancellation


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for keeps the cancellation")
async def test_a_plain_cancel_is_lost_by_wait_for_on_this_python() -> None:
    """The fault the helper exists for, shown on the interpreter the services run on."""
    requester = _Requester()
    task = asyncio.create_task(requester.run())
    await _cancel_as_the_reply_comes(task, requester)
    done, _ = await asyncio.wait({task}, timeout=0.5)
    assert not done and requester.rounds == 1 and requester.asking.is_set(), "the cancellation was lost: it asks again"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_and_wait_stops_a_loop_whose_cancellation_was_lost() -> None:
    requester = _Requester()
    task = asyncio.create_task(requester.run())
    await _cancel_as_the_reply_comes(task, requester)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), 5.0)
    assert task.cancelled()


async def test_errors_are_raised_after_every_task_ended_unless_told_not_to() -> None:
    async def fails() -> None:
        raise ValueError("a bug in the loop")

    async def waits() -> None:
        await asyncio.sleep(60)

    failing, waiting = asyncio.create_task(fails()), asyncio.create_task(waits())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="a bug in the loop"):
        await cancel_and_wait([failing, None, waiting])
    assert waiting.cancelled()
    again = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(again, raise_errors=False)
    await cancel_and_wait(None)


async def test_the_callers_own_cancellation_goes_through() -> None:
    give_in = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                if give_in.is_set():
                    raise
                # refuses every cancellation until told otherwise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(task, recancel_s=0.05))
    await asyncio.sleep(0.2)
    assert not stopper.done(), "it goes on cancelling a task that runs on"
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert not task.done()
    give_in.set()
    await cancel_and_wait(task)
    assert task.cancelled()
