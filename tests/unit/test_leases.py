"""Episode leases against real NATS: one holder per episode, a dead process of the same worker id taken over, a
lost lease noticed on refresh, and whether a work item is still queued."""

from __future__ import annotations

import pytest

from rollout_ledger.services.env_worker.leases import EpisodeLeases, LeaseLost
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import WORK_STREAM, WORK_SUBJECT, episode_lease_key

EP = "b1.0.3"


def test_lease_key_is_a_valid_kv_key() -> None:
    assert episode_lease_key("b1.0.3") == "b1=2E0=2E3"
    assert episode_lease_key("a/b c") == "a=2Fb=20c"


async def test_one_holder_per_episode(nc: bus.NATS) -> None:
    js = nc.jetstream()
    a, b = EpisodeLeases(js, "env-a", "run1"), EpisodeLeases(js, "env-b", "run1")
    await a.start()
    await b.start()
    mine = a.mine(seq=7, attempt=1)
    claim = await a.acquire(EP, mine)
    assert claim.taken
    held = await b.acquire(EP, b.mine(seq=7, attempt=2))
    assert not held.taken and held.holder == mine  # b must not run it
    again = await a.acquire(EP, mine)  # asked again by the same holder (a failed step after taking it): still its
    assert again.taken and again.revision == claim.revision
    revision = await a.refresh(EP, mine, claim.revision)
    assert revision > claim.revision
    await a.release(EP, revision)
    assert (await b.acquire(EP, b.mine(seq=7, attempt=2))).taken  # released: b may run it now


async def test_lease_of_a_dead_process_of_the_same_worker_is_taken_over(nc: bus.NATS) -> None:
    js = nc.jetstream()
    before, after = EpisodeLeases(js, "env-a", "run1"), EpisodeLeases(js, "env-a", "run2")
    await before.start()
    await after.start()
    assert (await before.acquire(EP, before.mine(3, 1))).taken
    assert (await after.acquire(EP, after.mine(3, 2))).taken  # same worker id, another process: the old one died
    with pytest.raises(LeaseLost):  # the old holder, were it alive, finds out on its next refresh
        await before.refresh(EP, before.mine(3, 1), 1)


async def test_still_queued_until_acked(nc: bus.NATS) -> None:
    js = nc.jetstream()
    leases = EpisodeLeases(js, "env-a", "run1")
    ack = await js.publish(WORK_SUBJECT, b"{}")
    assert await leases.still_queued(ack.seq)
    await js.delete_msg(WORK_STREAM, ack.seq)  # what an ack does to a work-queue item
    assert not await leases.still_queued(ack.seq)
