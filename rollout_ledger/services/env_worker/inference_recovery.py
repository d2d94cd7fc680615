"""Recovery of turn replies a NATS restart lost: noticing that this client was cut off (or reconnected to another
node), and answering the tries still waiting from their turns on RL_EVENTS instead of generating them again.

A worker publishes the turn on RL_EVENTS before it replies, and a reply sent while this client was not yet
reconnected is lost, though the turn is stored; trying again would generate it twice. While this client is cut off
nobody is reaped (no heartbeat can arrive), and once it is back every worker gets a full heartbeat timeout again.
On a NATS cluster a client reconnects to another node within a second (too fast for the reaper to see it cut off):
its own reconnect count growing starts the same recovery, and so does a worker's heartbeat reporting a reconnect
of its own: the server it reconnected to does not know the requests it took before, and refuses their replies (a
permissions violation the requester never hears of), though their turns are stored. A request can also die with
the server before its worker saw it: no turn comes for it, so each try still waiting is sent again to workers that
join a copy to the request they took (``TurnRequests.resend``), instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api as js_api

from rollout_ledger.services.env_worker.inference_request import TurnRequests
from rollout_ledger.services.env_worker.inference_workers import WorkerTable
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.subjects import EVENTS_STREAM, MSG_ID_HEADER, event_subject

log = get_logger(__name__)

TURN_RECOVERY_PREFIX = "turns-"
"""Names of the short-lived consumers on RL_EVENTS that look up turns whose reply a NATS restart lost."""


class TurnRecovery:
    """Watches this client's own connection and reads lost replies back from RL_EVENTS."""

    def __init__(self, nc: NATS, table: WorkerTable, requests: TurnRequests, request_timeout_s: float,
                 wall: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.table = table
        self.requests = requests
        self.request_timeout_s = request_timeout_s
        self.wall = wall
        self._cut_off_since: float | None = None
        """Wall time this client's own connection was first seen down (a NATS restart); None while connected."""
        self._recoveries: set[asyncio.Task[int]] = set()
        """The recoveries under way: one per reconnect, this client's own or a worker's. Each reads the tries
        waiting when its grace ends; one still reading (a try of its own waits for its timeout) does not keep a
        later reconnect's lost requests from being sent again."""
        self._reconnects = 0
        """This client's NATS reconnects seen by the reaper."""
        self._tick_at = wall()
        """Wall time of the reaper's last tick."""

    @property
    def resend_every_s(self) -> float:
        """While a recovery reads, how often it sends the tries still waiting again: a copy joined to a generation
        whose reply is lost too (an error reply the worker's node refused after a reconnect: ``allow_responses`` is
        per connection) is then generated anew, the worker having forgotten a request it answered with an error;
        one it answered with a turn is joined again, its turn read from RL_EVENTS. One heartbeat timeout, 1 s at
        least."""
        return max(self.table.heartbeat_timeout_s, 1.0)

    @property
    def under_way(self) -> int:
        """Recoveries under way."""
        return len(self._recoveries)

    def cut_off(self, now: float) -> bool:
        """Called by the reaper at each tick (``now``: the table's clock), before it reaps. True while this client
        is cut off from NATS, and at the first tick after it is back (then every worker gets a full heartbeat
        timeout from ``now`` and a recovery starts): nobody is reaped at those ticks.

        Failing over then would generate every in-flight turn a second time, the first copy being published by its
        worker once it reconnects."""
        last_tick, self._tick_at = self._tick_at, self.wall()
        if not self.nc.is_connected:  # cut off from NATS ourselves (a NATS restart): nobody's heartbeat can arrive
            if self._cut_off_since is None:
                self._cut_off_since = self.wall()
            return True
        reconnects = int(self.nc.stats.get("reconnects", 0))
        if reconnects > self._reconnects:  # reconnected between two ticks (a cluster's other node): as if cut off
            self._reconnects = reconnects
            if self._cut_off_since is None:
                self._cut_off_since = last_tick
        if self._cut_off_since is not None:  # back: every worker gets a full heartbeat_timeout_s from now
            since, self._cut_off_since = self._cut_off_since, None
            self.table.excuse(now)
            self._start(since)
            return True
        return False

    def worker_reconnected(self, since: float) -> None:
        """A worker's heartbeat reported a reconnect: recover the replies it sent since ``since`` (wall time)."""
        self._start(since)

    def _start(self, since: float) -> None:
        task = asyncio.create_task(self.recover(since, self.table.heartbeat_timeout_s))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def recover(self, since: float, grace_s: float) -> int:
        """After ``grace_s`` (replies still on their way arrive as usual), answer each try still waiting from its
        turn on RL_EVENTS, if its worker published one since ``since`` (wall time, a few seconds of margin), or
        publishes it later (a generation that ends after the restart: under NATS permissions its reply is refused,
        the server no longer knowing the request); the number answered. Reads until every such try is answered or
        has failed (``request_timeout_s``). Each such try is first sent again (``TurnRequests.resend``), and again every
        ``resend_every_s`` while it waits: one whose request died with the server is then generated, instead of
        failing over only at its timeout."""
        await asyncio.sleep(grace_s)
        targets = {rid: f for rid, f in self.requests.by_request.items() if not f.done()}
        if not targets:
            return 0
        # a request that died with the server is generated by its copy; one its worker took is not generated again
        resent = await self.requests.resend(list(targets))
        if resent:
            log.info("inference.resent_requests", resent=resent, waiting=len(targets))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        found = 0
        try:
            js = self.nc.jetstream()
            start = datetime.fromtimestamp(since - 5.0, tz=UTC)
            # A push consumer filtered to turns, delivering into this client's own inbox: the only grant it needs is
            # $JS.API.CONSUMER.CREATE.RL_EVENTS.<name>.rl.events.turn.generated (shared/nats_auth.py). Not deleted:
            # the server drops it 30 s after it went quiet.
            name = f"{TURN_RECOVERY_PREFIX}{uuid.uuid4().hex[:16]}"
            inbox = self.nc.new_inbox()
            queue: asyncio.Queue[Msg] = asyncio.Queue()
            sub = await self.nc.subscribe(inbox, cb=queue.put)
            try:
                config = js_api.ConsumerConfig(
                    name=name, deliver_subject=inbox, filter_subject=event_subject("turn.generated"),
                    deliver_policy=js_api.DeliverPolicy.BY_START_TIME, opt_start_time=start,
                    ack_policy=js_api.AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True)
                # RL_EVENTS may be electing a leader still (a cluster node lost): tried again until it answers
                await bus.retrying(lambda: js.add_consumer(EVENTS_STREAM, config), "turn recovery's consumer",
                                   max(0.0, deadline - loop.time()))
                resend_at = loop.time() + self.resend_every_s
                while any(not f.done() for f in targets.values()) and loop.time() < deadline:
                    if loop.time() >= resend_at:  # a copy joined to a generation whose reply was lost again
                        again = await self.requests.resend([rid for rid, f in targets.items() if not f.done()])
                        if again:
                            log.info("inference.resent_requests", resent=again, again=True)
                        resend_at = loop.time() + self.resend_every_s
                    try:
                        msg = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except TimeoutError:  # no turn stored meanwhile: look at the tries again
                        continue
                    fut = targets.get((msg.headers or {}).get(MSG_ID_HEADER, ""))
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                        found += 1
            finally:
                with bus.best_effort("unsubscribe the recovery inbox"):
                    await sub.unsubscribe()
        except Exception as exc:  # NATS gone again: the tries fail over by heartbeat or timeout as usual
            log.warning("inference.recover_failed", error=f"{type(exc).__name__}: {exc}")
        log.info("inference.recovered_replies", recovered=found)
        return found

    async def stop(self) -> None:
        """Cancel the recoveries under way."""
        await cancel_and_wait(list(self._recoveries))
