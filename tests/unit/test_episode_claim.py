"""The env worker's claim of a delivered work item (``EpisodeRunner._claim``), on fakes of the lease bucket and of the
message (named as fakes; the real bucket is tested in test_leases.py and by the chaos runs): the delivery is kept in
progress while a lease request hangs, as it does through a stream's election on a NATS cluster, and a lease taken
long before the claim ends is written again before the episode runs (its TTL runs from its last write); an episode
ends though its lease keeper missed its cancellation."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace
from typing import cast

from nats.aio.msg import Msg

from rollout_ledger.services.env_worker.attempt import AttemptDeps, AttemptOutcome
from rollout_ledger.services.env_worker.episode_runner import EpisodeRunner
from rollout_ledger.services.env_worker.leases import Claim, EpisodeLeases, Lease, LeaseLost, LeaseTerm
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import EpisodeRequested, SamplingParams

ACK_WAIT_S = 0.3
"""The fake consumer's ack wait: a delivery with no ack or in-progress ping for this long is delivered again."""


class FakeMsg(Msg):
    """A delivered work item that records when it was told in progress (a ``Msg`` with no connection)."""

    def __init__(self) -> None:  # no super().__init__: nothing here talks to NATS
        self.pings: list[float] = []

    async def in_progress(self) -> None:
        self.pings.append(asyncio.get_running_loop().time())


class FakeLeases:
    """A lease bucket whose first ``fail`` requests fail (NATS reconnecting) and whose requests take ``hang_s`` each
    (a stream electing its leader)."""

    def __init__(self, hang_s: float, fail: int = 0) -> None:
        self.hang_s = hang_s
        self.fail = fail
        self.clock = time.monotonic
        self.refreshed: list[int] = []
        """Revisions written again (``refresh``)."""

    async def acquire(self, episode_id: str, lease: Lease) -> Claim:
        await asyncio.sleep(self.hang_s)
        if self.fail > 0:
            self.fail -= 1
            raise BusError("take a lease failed: TimeoutError: nats: timeout", retryable=True)
        return Claim(True, 1, lease)

    async def still_queued(self, seq: int) -> bool:
        await asyncio.sleep(self.hang_s)
        return True

    async def refresh(self, episode_id: str, lease: Lease, revision: int) -> int:
        self.refreshed.append(revision)
        return revision + 1

    def term(self, every_s: float) -> LeaseTerm:
        return LeaseTerm(every_s)


def _runner(leases: FakeLeases) -> EpisodeRunner:
    return EpisodeRunner(EnvWorkerSettings(ack_wait_s=ACK_WAIT_S), cast(EpisodeLeases, leases), build_metrics(),
                         cast(AttemptDeps, None), envs=frozenset({"echo"}), route_of=lambda env: env)


def _longest_silence(started: float, ended: float, pings: list[float]) -> float:
    marks = [started, *pings, ended]
    return max(b - a for a, b in itertools.pairwise(marks))


async def test_a_delivery_is_kept_in_progress_while_its_lease_request_hangs() -> None:
    # each request hangs longer than the ack wait: without pings the item would be delivered again meanwhile
    leases = FakeLeases(hang_s=2 * ACK_WAIT_S)
    msg = FakeMsg()
    runner = _runner(leases)  # built before the clock starts: its settings and metrics are not the claim's time
    loop = asyncio.get_running_loop()
    started = loop.time()
    run = await runner._claim(msg, "b.0.0", Lease("w", "r", 7, 1))
    ended = loop.time()
    assert run is not None and run.lease.seq == 7
    assert leases.refreshed == [1] and run.revision == 2, "taken long before the claim ended: written again"
    assert msg.pings, "no in-progress ping while the lease request hung"
    assert _longest_silence(started, ended, msg.pings) < ACK_WAIT_S, msg.pings


async def test_a_delivery_is_kept_in_progress_while_the_lease_bucket_fails() -> None:
    leases = FakeLeases(hang_s=ACK_WAIT_S / 2, fail=3)
    msg = FakeMsg()
    runner = _runner(leases)  # built before the clock starts: its settings and metrics are not the claim's time
    loop = asyncio.get_running_loop()
    started = loop.time()
    run = await runner._claim(msg, "b.0.0", Lease("w", "r", 7, 1))
    ended = loop.time()
    assert run is not None and leases.fail == 0
    assert _longest_silence(started, ended, msg.pings) < ACK_WAIT_S, msg.pings


async def test_a_lease_taken_just_now_is_not_written_again() -> None:
    leases = FakeLeases(hang_s=0.0)
    run = await _runner(leases)._claim(FakeMsg(), "b.0.0", Lease("w", "r", 7, 1))
    assert run is not None and run.revision == 1 and leases.refreshed == []


class FakeDelivery(FakeMsg):
    """A delivered work item with a stream sequence, acked at once (a ``Msg`` with no connection)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.acked = 0

    @property
    def metadata(self) -> Msg.Metadata:
        return cast(Msg.Metadata, SimpleNamespace(sequence=SimpleNamespace(stream=self.seq), num_delivered=1))

    async def ack_sync(self, timeout: float = 1.0) -> Msg:  # noqa: ASYNC109 - nats-py's signature
        self.acked += 1
        return self


class RacingLeases(FakeLeases):
    """A bucket whose renewals wait for their reply as nats-py's requests do (``asyncio.wait_for``), and whose
    release lets the renewal under way have its reply: the reply lands in the same loop iteration as the keeper's
    cancellation, which Python 3.11's ``wait_for`` then loses."""

    def __init__(self) -> None:
        super().__init__(hang_s=0.0)
        self.reply: asyncio.Future[None] | None = None
        self.renewing = asyncio.Event()
        self.released_at: float | None = None
        self.renewals_after_release = 0

    def mine(self, seq: int, attempt: int) -> Lease:
        return Lease("w", "r", seq, attempt)

    async def refresh(self, episode_id: str, lease: Lease, revision: int) -> int:
        if self.released_at is not None:
            self.renewals_after_release += 1
        self.reply = asyncio.get_running_loop().create_future()
        self.renewing.set()
        await asyncio.wait_for(self.reply, 30.0)
        return revision + 1

    async def release(self, episode_id: str, revision: int) -> None:
        self.released_at = time.monotonic()
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(None)


def _work_item(group_index: int) -> EpisodeRequested:
    """The work item of episode ``b.0.<group_index>`` (one turn of ``echo``)."""
    episode_id = f"b.0.{group_index}"
    return EpisodeRequested(event_id=f"{episode_id}:requested", episode_id=episode_id, batch_id="b", attempt=1, seq=0,
                            produced_by="test", env="echo", task={}, group_id="b.0", group_index=group_index,
                            group_size=1, sampling=SamplingParams(max_tokens=16), max_turns=1)


async def test_an_episode_ends_though_its_lease_keeper_missed_the_cancellation() -> None:
    """The keeper's renewal is answered just as the episode ends: its cancellation is lost (Python 3.11), and the
    episode's task used to wait for the keeper for good, counted as running (it held a policy drain open)."""
    leases = RacingLeases()
    runner = _runner(leases)

    async def attempt(run: object, item: EpisodeRequested, attempt: int) -> AttemptOutcome:
        await leases.renewing.wait()  # the episode ends while its lease is being written again
        return AttemptOutcome("completed", 1)

    runner._attempt = attempt  # type: ignore[method-assign]  # the episode itself is not what is tested here
    msg = FakeDelivery(seq=7)
    item = _work_item(0)
    await asyncio.wait_for(runner._run_item(msg, item), 5.0)
    assert msg.acked == 1 and leases.released_at is not None
    assert leases.renewals_after_release == 0, "the lease was written again after its release"
    assert "b.0.0" not in runner.running


class TakenLeases(RacingLeases):
    """A bucket in which another holder took the lease (ours expired in a long outage): every renewal says so."""

    async def refresh(self, episode_id: str, lease: Lease, revision: int) -> int:
        raise LeaseLost(Lease("other", "r", lease.seq, lease.attempt + 1))


async def test_an_episode_fenced_out_stops_though_it_missed_the_cancellation() -> None:
    """Another holder took the lease: the keeper cancels the episode. The attempt loses that cancellation, as an
    awaited nats-py request does on Python 3.11 when its reply lands with it, and would run on beside the new holder;
    it is cancelled again until it stops, and it hands nothing back (the new holder runs the episode)."""
    leases = TakenLeases()
    runner = _runner(leases)
    lost: list[int] = []

    async def attempt(run: object, item: EpisodeRequested, attempt: int) -> AttemptOutcome:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # lost, as 3.11's wait_for loses it
            lost.append(1)
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
        await asyncio.sleep(30)  # runs on, beside the new holder
        return AttemptOutcome("completed", 1)

    runner._attempt = attempt  # type: ignore[method-assign]  # the episode itself is not what is tested here
    msg = FakeDelivery(seq=8)
    item = _work_item(1)
    running = asyncio.create_task(runner._run_item(msg, item))
    # not wait_for: on 3.11 it returns a task that ends normally after its own timeout's cancellation (this one does)
    done, _ = await asyncio.wait({running}, timeout=10.0)
    assert done, "the episode ran on beside the new holder"
    await running
    assert lost == [1], "the first cancellation was lost"
    assert msg.acked == 0 and leases.released_at is None, "fenced out: nothing acked, released or handed back"
    assert "b.0.1" not in runner.running
