"""Episode leases: one live attempt per episode, fenced through the ``rl_episode_leases`` KV bucket.

Why: after a NATS restart the server restores the work consumer's pending items with the delivery times it had
stored, not the in-progress pings it received since; every item whose stored time is older than ``ack_wait`` is
redelivered as soon as a worker pulls, before the worker still running it can ping again. Without a fence each such
redelivery ran the episode a second time beside the first (measured: every episode of a 2 s outage with a 1.5 s
ack wait; 4.4 % of the load with the defaults).

How: the worker running an episode holds the key of its episode (``episode_lease_key``), written with ``create``
and kept alive (``refresh``) every few seconds; the bucket's TTL expires it when the holder died. A worker handed a
work item whose episode's lease another live holder has does not run it: it keeps its copy in progress until the
lease goes (``wait_gone``); then, if the work item is still on the queue (``still_queued``: the work queue drops an
acked item), the holder died and the item runs as a new attempt; if not, the holder finished and acked it.

When: a ``LeaseTerm`` keeps the holder's side of the time, on an injectable clock (``time.monotonic`` by default):
a renewal due every ``every_s``, and the lease surely expired once ``ttl_s`` (the bucket's TTL) passed since the
last write the bucket acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.bus import bucket, bus_errors
from rollout_ledger.shared.subjects import LEASE_BUCKET, LEASE_TTL_S, WORK_STREAM, episode_lease_key


@dataclass(frozen=True)
class Lease:
    """Who runs an episode: a worker process (``worker`` and the ``run`` id of that process) and its work item."""

    worker: str
    run: str
    seq: int
    """Stream sequence of the work item in ``RL_WORK``."""
    attempt: int

    def encode(self) -> bytes:
        return json.dumps({"worker": self.worker, "run": self.run, "seq": self.seq, "attempt": self.attempt}).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> Lease | None:
        """The lease in ``data``; None when it is not one this module wrote (then nobody can be shown alive)."""
        try:
            raw = json.loads(data or b"")
            return cls(str(raw["worker"]), str(raw["run"]), int(raw["seq"]), int(raw["attempt"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Claim:
    """The answer of ``acquire``: ``taken`` with the lease's revision, or the live ``holder`` and its revision
    (``holder`` None: a value this module did not write)."""

    taken: bool
    revision: int
    holder: Lease | None


class LeaseLost(Exception):
    """Another holder took the episode's lease (ours had expired): this worker must stop running the episode."""

    def __init__(self, holder: Lease | None) -> None:
        super().__init__(f"episode lease taken by {holder.worker if holder else 'another holder'}")
        self.holder = holder


class LeaseTerm:
    """The holder's clock on one lease: when it was last written (acknowledged by the bucket), how often it is
    renewed, and whether the bucket's TTL has surely ended it (a renewal failing past the TTL says so in its log)."""

    def __init__(self, every_s: float, ttl_s: float = LEASE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        """Renewal interval (the worker's: a third of the lease TTL and of the ack wait)."""
        self.ttl_s = ttl_s
        self.clock = clock
        self.written_at = clock()
        """Clock time of the last write the bucket acknowledged (the lease is taken when the term starts)."""

    def renewed(self) -> None:
        """The bucket acknowledged a write of the lease now: its TTL starts over."""
        self.written_at = self.clock()

    def age(self) -> float:
        """Seconds since the last acknowledged write."""
        return self.clock() - self.written_at

    def expired(self) -> bool:
        """Whether the bucket has surely expired the lease: no acknowledged write for longer than ``ttl_s`` (exactly
        ``ttl_s``: not yet). Another holder may have it then; ``refresh`` finds out which."""
        return self.age() > self.ttl_s


class EpisodeLeases:
    """Create, refresh and release the leases of the episodes this worker process runs."""

    def __init__(self, js: JetStreamContext, worker: str, run: str, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.js = js
        self.worker = worker
        self.run = run
        """Distinguishes this process from an earlier one of the same ``worker`` id (killed and started again)."""
        self.clock = clock
        """The clock of the terms of its leases (``term``)."""
        self._kv: KeyValue | None = None

    async def start(self) -> None:
        self._kv = await bucket(self.js, LEASE_BUCKET)

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("EpisodeLeases.start() was not awaited")
        return self._kv

    def mine(self, seq: int, attempt: int) -> Lease:
        return Lease(self.worker, self.run, seq, attempt)

    def term(self, every_s: float) -> LeaseTerm:
        """The term of a lease just taken, renewed every ``every_s``, on this object's clock."""
        return LeaseTerm(every_s, LEASE_TTL_S, self.clock)

    async def holder(self, episode_id: str) -> tuple[Lease | None, int]:
        """The live lease of the episode and its revision; (None, 0) when there is none. ``BusError`` when the
        bucket cannot be read (as every method here)."""
        with bus_errors("read a lease"):
            try:
                entry = await self.kv.get(episode_lease_key(episode_id))
            except KeyNotFoundError:  # never written, released, or expired
                return None, 0
        return Lease.decode(entry.value), int(entry.revision or 0)

    async def acquire(self, episode_id: str, lease: Lease) -> Claim:
        """Take the episode's lease, or learn who holds it. A lease of an earlier process of this same worker id is
        stale (that process is gone): taken over at once."""
        key = episode_lease_key(episode_id)
        while True:
            with bus_errors("take a lease"):
                try:
                    return Claim(True, await self.kv.create(key, lease.encode()), lease)
                except KeyWrongLastSequenceError:
                    pass
            held, revision = await self.holder(episode_id)
            if revision == 0:  # released or expired between the two calls: try again
                continue
            if held == lease:  # ours already (an earlier call took it and its caller did not get to use it)
                return Claim(True, revision, lease)
            if held is not None and held.worker == self.worker and held.run != self.run:
                with bus_errors("take over a lease"):
                    try:
                        return Claim(True, await self.kv.update(key, lease.encode(), last=revision), lease)
                    except KeyWrongLastSequenceError:
                        continue
            return Claim(False, revision, held)

    async def refresh(self, episode_id: str, lease: Lease, revision: int) -> int:
        """Write the lease again (its TTL starts over); the new revision. ``LeaseLost`` when another holder has
        it; the lease is taken again when it expired meanwhile (a NATS outage longer than the TTL) and is free."""
        with bus_errors("renew a lease"):
            try:
                return await self.kv.update(episode_lease_key(episode_id), lease.encode(), last=revision)
            except KeyWrongLastSequenceError:
                pass
        held, revision = await self.holder(episode_id)
        if held == lease:  # ours at another revision (the reply to an earlier refresh was lost)
            return revision
        if revision == 0:  # expired meanwhile and nobody took it: take it again
            with bus_errors("take a lease again"):
                try:
                    return await self.kv.create(episode_lease_key(episode_id), lease.encode())
                except KeyWrongLastSequenceError:
                    pass
            held, _ = await self.holder(episode_id)
        raise LeaseLost(held)

    async def release(self, episode_id: str, revision: int) -> None:
        """Delete the lease if it is still ours (``revision``); best effort: an unreleased lease expires."""
        try:
            with bus_errors("release a lease"):
                await self.kv.delete(episode_lease_key(episode_id), last=revision)
        except BusError:  # taken over (a wrong last sequence) or NATS down: the TTL ends it
            return

    async def wait_gone(self, episode_id: str, claim: Claim, poll_s: float) -> None:
        """Return once the holder of ``claim`` (a claim not taken) no longer holds the episode's lease: released,
        expired or replaced (a lease this module cannot read: once its revision changes)."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                current, revision = await self.holder(episode_id)
            except BusError:  # NATS reconnecting: ask again
                continue
            if revision == 0 or current != claim.holder or (current is None and revision != claim.revision):
                return

    async def still_queued(self, seq: int) -> bool:
        """Whether the work item ``seq`` is still on the work queue (not acked by whoever ran it)."""
        with bus_errors(f"read work item {seq}"):
            try:
                await self.js.get_msg(WORK_STREAM, seq)
            except NotFoundError:
                return False
        return True
