"""Episode lease timing on a fake clock (no sleeps): the holder's term (a renewal due every ``every_s``, the lease
surely expired just past the TTL, not at it) and ``EpisodeLeases`` against an in-memory bucket that expires entries
on the same clock: a refresh renews the TTL, an unrefreshed lease expires, and a lease another holder took after
it expired is lost on the next refresh."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from rollout_ledger.services.env_worker.leases import EpisodeLeases, LeaseLost, LeaseTerm
from rollout_ledger.shared.subjects import LEASE_BUCKET, LEASE_TTL_S
from tests.helpers import FakeClock

EP = "b1.0.3"
EVERY_S = 5.0
JUST_PAST = 1.0 / 1024
"""A step past a boundary, exact in binary."""


class FakeBucket:
    """The KV calls ``EpisodeLeases`` makes, with revisions and a TTL on the fake clock: an entry not written for
    longer than ``ttl_s`` is gone (exactly ``ttl_s``: still there, as ``LeaseTerm.expired`` says)."""

    def __init__(self, clock: FakeClock, ttl_s: float = LEASE_TTL_S) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.revision = 0
        self.entries: dict[str, tuple[bytes, int, float]] = {}

    def _live(self, key: str) -> tuple[bytes, int, float] | None:
        entry = self.entries.get(key)
        if entry is not None and self.clock() - entry[2] > self.ttl_s:
            del self.entries[key]
            return None
        return entry

    def _write(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.entries[key] = (value, self.revision, self.clock())
        return self.revision

    async def create(self, key: str, value: bytes) -> int:
        if self._live(key) is not None:
            raise KeyWrongLastSequenceError()
        return self._write(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        entry = self._live(key)
        if entry is None or entry[1] != last:
            raise KeyWrongLastSequenceError()
        return self._write(key, value)

    async def get(self, key: str) -> KeyValue.Entry:
        entry = self._live(key)
        if entry is None:
            raise KeyNotFoundError()
        return KeyValue.Entry(LEASE_BUCKET, key, entry[0], entry[1], None, None, None)

    async def delete(self, key: str, last: int) -> None:
        entry = self._live(key)
        if entry is None or entry[1] != last:
            raise KeyWrongLastSequenceError()
        del self.entries[key]


class FakeJetStream:
    def __init__(self, bucket: FakeBucket) -> None:
        self.bucket = bucket

    async def key_value(self, name: str) -> Any:
        assert name == LEASE_BUCKET
        return self.bucket


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


async def _leases(clock: FakeClock, bucket: FakeBucket, worker: str, run: str = "run1") -> EpisodeLeases:
    leases = EpisodeLeases(FakeJetStream(bucket), worker, run, clock=clock)  # type: ignore[arg-type]
    await leases.start()
    return leases


def test_the_age_counts_from_the_last_acknowledged_write(clock: FakeClock) -> None:
    term = LeaseTerm(EVERY_S, LEASE_TTL_S, clock)
    clock.advance(EVERY_S)
    assert term.age() == EVERY_S
    term.renewed()
    assert term.age() == 0.0


def test_a_lease_expires_just_past_its_ttl_not_at_it(clock: FakeClock) -> None:
    term = LeaseTerm(EVERY_S, LEASE_TTL_S, clock)
    clock.advance(LEASE_TTL_S)
    assert not term.expired()
    clock.advance(JUST_PAST)
    assert term.expired()
    term.renewed()  # a write the bucket acknowledged (a refresh after an outage took it again)
    assert not term.expired()


async def test_a_refresh_renews_the_ttl(clock: FakeClock) -> None:
    bucket = FakeBucket(clock)
    a, b = await _leases(clock, bucket, "env-a"), await _leases(clock, bucket, "env-b")
    mine = a.mine(seq=7, attempt=1)
    claim = await a.acquire(EP, mine)
    term = a.term(EVERY_S)
    assert claim.taken and term.every_s == EVERY_S and term.ttl_s == LEASE_TTL_S
    revision = claim.revision
    for _ in range(5):  # well past one TTL in all, never past it since the last write
        clock.advance(EVERY_S)
        revision = await a.refresh(EP, mine, revision)
        term.renewed()
        assert not term.expired()
    held = await b.acquire(EP, b.mine(seq=7, attempt=2))
    assert not held.taken and held.holder == mine


async def test_a_lease_not_refreshed_expires_exactly_when_its_term_says(clock: FakeClock) -> None:
    bucket = FakeBucket(clock)
    a, b = await _leases(clock, bucket, "env-a"), await _leases(clock, bucket, "env-b")
    claim = await a.acquire(EP, a.mine(seq=7, attempt=1))
    term = a.term(EVERY_S)
    clock.advance(LEASE_TTL_S)  # exactly the TTL: still held
    assert not term.expired()
    assert not (await b.acquire(EP, b.mine(seq=7, attempt=2))).taken
    clock.advance(JUST_PAST)
    assert term.expired()
    assert await a.holder(EP) == (None, 0)
    assert claim.taken and (await b.acquire(EP, b.mine(seq=7, attempt=2))).taken


async def test_an_expired_lease_nobody_took_is_taken_again_on_refresh(clock: FakeClock) -> None:
    bucket = FakeBucket(clock)
    a = await _leases(clock, bucket, "env-a")
    mine = a.mine(seq=7, attempt=1)
    claim = await a.acquire(EP, mine)
    clock.advance(LEASE_TTL_S + JUST_PAST)  # a NATS outage longer than the TTL
    revision = await a.refresh(EP, mine, claim.revision)
    assert revision > claim.revision
    assert await a.holder(EP) == (mine, revision)


async def test_a_lease_another_holder_took_after_it_expired_is_lost(clock: FakeClock) -> None:
    bucket = FakeBucket(clock)
    a, b = await _leases(clock, bucket, "env-a"), await _leases(clock, bucket, "env-b")
    mine = a.mine(seq=7, attempt=1)
    claim = await a.acquire(EP, mine)
    clock.advance(LEASE_TTL_S + JUST_PAST)
    theirs = b.mine(seq=7, attempt=2)
    assert (await b.acquire(EP, theirs)).taken
    with pytest.raises(LeaseLost) as lost:
        await a.refresh(EP, mine, claim.revision)
    assert lost.value.holder == theirs


async def test_a_released_lease_is_free_at_once(clock: FakeClock) -> None:
    bucket = FakeBucket(clock)
    a, b = await _leases(clock, bucket, "env-a"), await _leases(clock, bucket, "env-b")
    claim = await a.acquire(EP, a.mine(seq=7, attempt=1))
    await a.release(EP, claim.revision)
    assert (await b.acquire(EP, b.mine(seq=7, attempt=2))).taken
    await a.release(EP, claim.revision)  # not ours any more: left alone (best effort, no error)
    assert (await b.holder(EP))[0] == b.mine(seq=7, attempt=2)
