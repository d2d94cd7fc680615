"""The inference workers this env worker knows, whether each is live and which one gets a turn request: their
heartbeats read into a table, a worker live until its last heartbeat is older than ``heartbeat_timeout_s``, the
silent ones reaped; a request goes to the episode's sticky worker while it can take it, else the least loaded by load
per capacity (``choose``; draining and excluded workers get none).

Heartbeats are JSON (``shared/events.dumps``) on ``INFER_HEARTBEAT``, about once a second per worker. Times come
from an injectable ``clock`` (monotonic seconds; ``time.monotonic``, the event loop's own clock, by default) and
``wall`` (wall time, for recovery's look-up on the stream), so liveness is tested on a fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from nats.aio.msg import Msg

from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)


@dataclass
class WorkerState:
    """What this client knows about one inference worker."""

    worker_id: str
    subject: str
    capacity: int
    """Concurrent requests the worker accepts (<= 0: unknown, treated as unbounded)."""
    reported_inflight: int
    draining: bool
    last_seen: float
    weight_version: int | None = None
    engine: str = ""
    local_inflight: int = 0
    """Requests this client has outstanding on the worker right now."""
    waiting: set[asyncio.Future[Msg]] = field(default_factory=set)
    reconnects: int = 0
    """The worker's NATS reconnects, as its last heartbeat reported them."""
    seen_at: float = 0.0
    """Wall time of its last heartbeat."""
    takes_resent: bool = False
    """The worker joins a request sent again (same id) to the one it took (heartbeat ``takes_resent``; workers of
    earlier releases would generate it again): a recovery may send it the tries a NATS restart may have lost."""

    @property
    def load(self) -> int:
        return max(self.reported_inflight, self.local_inflight)

    @property
    def has_room(self) -> bool:
        return self.capacity <= 0 or self.load < self.capacity


def choose(workers: Mapping[str, WorkerState], prefer: str | None = None,
           exclude: frozenset[str] | set[str] = frozenset()) -> WorkerState | None:
    """The sticky worker when it is live, not draining and has room; else the least loaded; else None."""
    if prefer is not None and prefer not in exclude:
        state = workers.get(prefer)
        if state is not None and not state.draining and state.has_room:
            return state
    best: WorkerState | None = None
    best_score = 0.0
    for state in workers.values():
        if state.draining or state.worker_id in exclude:
            continue
        score = state.load / state.capacity if state.capacity > 0 else float(state.load)
        if best is None or score < best_score:
            best, best_score = state, score
    return best


class WorkerTable:
    """Live inference workers by id, from their heartbeats; ``reap`` forgets the silent ones."""

    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        """Monotonic seconds: ``last_seen`` and the reaper's ``now``."""
        self.wall = wall
        """Wall time: ``seen_at`` (where a recovery after a worker's reconnect starts reading)."""
        self.workers: dict[str, WorkerState] = {}
        self._warned_short: set[str] = set()
        """Workers whose heartbeat interval was found too close to ``heartbeat_timeout_s`` (warned once each)."""

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def heard(self, hb: dict[str, Any]) -> float | None:
        """Take one heartbeat (``worker_id`` and ``subject`` present: ``KeyError`` otherwise). Returns the wall time
        of the worker's previous heartbeat when this one reports a reconnect of its own (replies to requests it took
        before are refused by the node it reconnected to: the caller reads their turns back from there); else
        None."""
        worker_id = str(hb["worker_id"])
        subject = str(hb["subject"])
        now = self.clock()
        state = self.workers.get(worker_id)
        if state is None:
            state = WorkerState(worker_id, subject, 0, 0, False, now)
            self.workers[worker_id] = state
            log.info("inference.worker_joined", worker=worker_id, subject=subject)
        state.subject = subject
        state.capacity = _int(hb.get("capacity"), 0)
        state.reported_inflight = _int(hb.get("inflight"), 0)
        state.draining = bool(hb.get("draining", False))
        state.weight_version = _int(hb.get("weight_version"), 0) if hb.get("weight_version") is not None else None
        state.engine = str(hb.get("engine", ""))
        state.takes_resent = hb.get("takes_resent") is True
        state.last_seen = now
        reconnects = _int(hb.get("reconnects"), 0)
        reconnected_since: float | None = None
        if reconnects > state.reconnects and state.seen_at:
            # it reconnected (to another node of a cluster): replies to requests it took before are refused there
            log.info("inference.worker_reconnected", worker=worker_id, reconnects=reconnects)
            reconnected_since = state.seen_at
        state.reconnects = reconnects
        state.seen_at = self.wall()
        every = hb.get("every_s")
        if (isinstance(every, int | float) and self.heartbeat_timeout_s < 2 * every
                and worker_id not in self._warned_short):
            self._warned_short.add(worker_id)
            log.warning("inference.heartbeat_timeout_short", worker=worker_id, heartbeat_s=every,
                        heartbeat_timeout_s=self.heartbeat_timeout_s,
                        hint="a heartbeat a little late fails over the turns of a live worker: set "
                             "ROLLOUT_HEARTBEAT_TIMEOUT_S to 3x the workers' ROLLOUT_HEARTBEAT_S or more")
        return reconnected_since

    def is_live(self, worker_id: str, now: float | None = None) -> bool:
        """Whether the worker is known and its last heartbeat is not older than ``heartbeat_timeout_s`` (exactly
        that old: still live)."""
        state = self.workers.get(worker_id)
        if state is None:
            return False
        return (self.clock() if now is None else now) - state.last_seen <= self.heartbeat_timeout_s

    def reap(self, now: float | None = None) -> list[WorkerState]:
        """Forget the workers whose last heartbeat is older than ``heartbeat_timeout_s``; returns them (their
        tries are the caller's to fail over)."""
        now = self.clock() if now is None else now
        dead = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for state in dead:
            del self.workers[state.worker_id]
        return dead

    def excuse(self, now: float | None = None) -> None:
        """Every worker gets a full ``heartbeat_timeout_s`` from ``now`` (the clock's by default): heartbeats this
        client could not read are not their silence (a NATS restart, or this client's own loop blocked)."""
        now = self.clock() if now is None else now
        for state in self.workers.values():
            state.last_seen = max(state.last_seen, now)

    def excuse_stall(self, stalled_s: float) -> None:
        """This client's own event loop was blocked for ``stalled_s``: the heartbeats that arrived meanwhile are
        still unread, so every worker gets a full ``heartbeat_timeout_s`` from now (as after a NATS restart)
        rather than being reaped for this client's silence."""
        self.excuse()
        log.warning("inference.loop_stalled", stalled_s=round(stalled_s, 3), workers=len(self.workers))


def parse_heartbeat(msg: Msg) -> dict[str, Any] | None:
    """The heartbeat's JSON object with its ``worker_id`` and ``subject``; None (logged) when it is not one."""
    try:
        hb: dict[str, Any] = orjson.loads(msg.data)
        str(hb["worker_id"])
        str(hb["subject"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        log.warning("inference.bad_heartbeat", data=msg.data[:200].decode(errors="replace"))
        return None
    return hb


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
