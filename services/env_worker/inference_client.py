"""Asks inference workers for turns: a registry of live workers from heartbeats, sticky routing, failover, budget.

Protocol (fixed with the inference worker): a core NATS request of ``InferenceRequested`` JSON to the worker's
own subject (session-sticky) or to ``INFER_ANY`` (queue group, when no worker is known); the reply is the
``TurnGenerated`` JSON, or an error reply with headers ``Rollout-Error`` (class name) and ``Rollout-Retryable``
(``true``/``false``) and the message as body. Workers publish heartbeats on ``INFER_HEARTBEAT`` about once a
second; a worker silent for ``heartbeat_timeout_s`` is dead, and requests waiting on it fail over at once
instead of waiting for ``request_timeout_s``.

Replies come back through a ``ReplyInbox`` (shared/kit/inbox.py: one wildcard subscription, one deadline
sweeper, no timer or task per request; at thousands of turns per second those cost more than the routing
itself), so a try can also be failed from outside: the heartbeat reaper fails the tries of a silent worker.

With tracing on, each request's headers carry the trace context of the turn asking (shared/kit/tracing.py): the
inference worker's generation span is its child.

A NATS restart: while this client is cut off nobody is reaped, and once it is back the tries still waiting are
looked up on RL_EVENTS (``recover``): a worker publishes the turn there before it replies, and a reply sent while
this client was not yet reconnected is lost, though the turn is stored; trying again would generate it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api as js_api

from rollout_ledger.shared.errors import InferenceError, NewerContractError, SchemaError
from rollout_ledger.shared.events import InferenceRequested, TurnGenerated, decode_as, encode
from rollout_ledger.shared.kit.backoff import backoff_delay
from rollout_ledger.shared.kit.inbox import ReplyInbox
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import (
    ERROR_HEADER,
    EVENTS_STREAM,
    INFER_ANY,
    INFER_CANCEL,
    INFER_HEARTBEAT,
    MSG_ID_HEADER,
    RETRYABLE_HEADER,
    event_subject,
)

log = get_logger(__name__)

TURN_RECOVERY_PREFIX = "turns-"
"""Names of the short-lived consumers on RL_EVENTS that look up turns whose reply a NATS restart lost."""


class TryFailed(InferenceError):
    """One try did not produce a turn (no responders, worker lost, timeout or a retryable error reply)."""

    retryable = True


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

    @property
    def load(self) -> int:
        return max(self.reported_inflight, self.local_inflight)

    @property
    def has_room(self) -> bool:
        return self.capacity <= 0 or self.load < self.capacity


@dataclass(frozen=True)
class InferenceClientConfig:
    """Timeouts and retry budget (from ``EnvWorkerSettings``)."""

    request_timeout_s: float = 120.0
    max_tries: int = 3
    backoff_initial_s: float = 0.2
    """Pause before the second try; doubled before each further try. No jitter: a retry goes to another worker,
    chosen by load at the moment it is sent, so retries that fail together are spread by routing, not time."""
    backoff_max_s: float = 2.0
    """Longest pause between tries."""
    heartbeat_timeout_s: float = 3.0


class InferenceClient:
    """Routes turn requests to inference workers and retries them within a budget."""

    def __init__(self, nc: NATS, config: InferenceClientConfig, *,
                 on_retry: Callable[[], None] | None = None,
                 on_latency: Callable[[float], None] | None = None, tracing: Tracing | None = None) -> None:
        self.nc = nc
        self.config = config
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Carries the current span's trace context in each request's headers (off: no headers)."""
        self.workers: dict[str, WorkerState] = {}
        self._warned_short: set[str] = set()
        """Workers whose heartbeat interval was found too close to ``heartbeat_timeout_s`` (warned once each)."""
        self._on_retry = on_retry or (lambda: None)
        self._on_latency = on_latency or (lambda _s: None)
        self._inbox: ReplyInbox[Msg] = ReplyInbox(
            nc, config.request_timeout_s, resolve=lambda fut, msg: fut.set_result(msg),
            on_timeout=lambda subject: TryFailed(f"no reply from {subject} within {config.request_timeout_s}s"),
            on_no_responders=lambda _subject: TryFailed("no responders"))
        self._waiting_any: set[asyncio.Future[Msg]] = set()
        """Tries sent to ``INFER_ANY``: whoever took them is unknown, so any worker's death fails them over."""
        self._first_heartbeat = asyncio.Event()
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None
        self._cut_off_since: float | None = None
        """Wall time this client's own connection was first seen down (a NATS restart); None while connected."""
        self._by_request: dict[str, asyncio.Future[Msg]] = {}
        """Tries waiting for their reply, by request id (= the turn's event id on RL_EVENTS)."""
        self._recovery: asyncio.Task[int] | None = None

    async def start(self) -> None:
        """Subscribe to heartbeats and the reply inbox; start the reaper of silent workers."""
        await self._inbox.start()
        self._subs.append(await self.nc.subscribe(INFER_HEARTBEAT, cb=self._on_heartbeat))
        self._reaper = asyncio.create_task(self._reap_forever())

    async def wait_for_workers(self, timeout_s: float) -> bool:
        """Listen up to ``timeout_s`` for a first heartbeat, so the first turns are routed to known workers."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._first_heartbeat.wait()
        return bool(self.workers)

    async def recover(self, since: float, grace_s: float) -> int:
        """After ``grace_s`` (replies still on their way arrive as usual), answer each try still waiting from its
        turn on RL_EVENTS, if its worker published one since ``since`` (wall time, a few seconds of margin), or
        publishes it later (a generation that ends after the restart: under NATS permissions its reply is refused,
        the server no longer knowing the request); the number answered. Reads until every such try is answered or
        has failed (``request_timeout_s``): a try whose request died with the server fails over as usual."""
        await asyncio.sleep(grace_s)
        targets = {rid: f for rid, f in self._by_request.items() if not f.done()}
        if not targets:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
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
                await js.add_consumer(EVENTS_STREAM, js_api.ConsumerConfig(
                    name=name, deliver_subject=inbox, filter_subject=event_subject("turn.generated"),
                    deliver_policy=js_api.DeliverPolicy.BY_START_TIME, opt_start_time=start,
                    ack_policy=js_api.AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True))
                while any(not f.done() for f in targets.values()) and loop.time() < deadline:
                    try:
                        msg = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except TimeoutError:  # no turn stored meanwhile: look at the tries again
                        continue
                    fut = targets.get((msg.headers or {}).get(MSG_ID_HEADER, ""))
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                        found += 1
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        except Exception as exc:  # NATS gone again: the tries fail over by heartbeat or timeout as usual
            log.warning("inference.recover_failed", error=f"{type(exc).__name__}: {exc}")
        log.info("inference.recovered_replies", recovered=found)
        return found

    async def stop(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        await self._inbox.stop(lambda: TryFailed("inference client stopped"))

    # --- registry ---------------------------------------------------------------------------------
    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb: dict[str, Any] = orjson.loads(msg.data)
            worker_id = str(hb["worker_id"])
            subject = str(hb["subject"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("inference.bad_heartbeat", data=msg.data[:200].decode(errors="replace"))
            return
        now = asyncio.get_running_loop().time()
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
        state.last_seen = now
        every = hb.get("every_s")
        if (isinstance(every, int | float) and self.config.heartbeat_timeout_s < 2 * every
                and worker_id not in self._warned_short):
            self._warned_short.add(worker_id)
            log.warning("inference.heartbeat_timeout_short", worker=worker_id, heartbeat_s=every,
                        heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                        hint="a heartbeat a little late fails over the turns of a live worker: set "
                             "ROLLOUT_HEARTBEAT_TIMEOUT_S to 3x the workers' ROLLOUT_HEARTBEAT_S or more")
        self._first_heartbeat.set()

    def reap(self) -> list[str]:
        """Forget workers silent for ``heartbeat_timeout_s``; fail the tries waiting on them. Returns their ids.

        Tries sent to ``INFER_ANY`` fail over too: the dead worker may have taken them (a live one that did
        will still answer its copy; the duplicate turn has its own request id and is simply not kept).

        While this client is itself disconnected (a NATS restart) nobody is reaped, and after it reconnected every
        worker gets a full ``heartbeat_timeout_s`` again: failing over then would generate every in-flight turn a
        second time, the first copy being published by its worker once it reconnects.
        """
        now = asyncio.get_running_loop().time()
        if not self.nc.is_connected:  # cut off from NATS ourselves (a NATS restart): nobody's heartbeat can arrive
            if self._cut_off_since is None:
                self._cut_off_since = time.time()
            return []
        if self._cut_off_since is not None:  # back: every worker gets a full heartbeat_timeout_s from now
            since, self._cut_off_since = self._cut_off_since, None
            for state in self.workers.values():
                state.last_seen = max(state.last_seen, now)
            if self._recovery is None or self._recovery.done():
                self._recovery = asyncio.create_task(self.recover(since, self.config.heartbeat_timeout_s))
            return []
        dead = [w for w in self.workers.values() if now - w.last_seen > self.config.heartbeat_timeout_s]
        for state in dead:
            del self.workers[state.worker_id]
            log.warning("inference.worker_lost", worker=state.worker_id, waiting=len(state.waiting),
                        waiting_any=len(self._waiting_any))
            for fut in [*state.waiting, *self._waiting_any]:
                if not fut.done():
                    fut.set_exception(TryFailed(f"inference worker {state.worker_id} stopped sending heartbeats"))
        return [s.worker_id for s in dead]

    def expire(self) -> int:
        """Fail the tries whose reply is overdue (``request_timeout_s``); returns how many (the inbox's sweeper
        does this on its own)."""
        return self._inbox.sweep()

    def excuse_stall(self, stalled_s: float) -> None:
        """This client's own event loop was blocked for ``stalled_s``: the heartbeats that arrived meanwhile are
        still unread, so every worker gets a full ``heartbeat_timeout_s`` from now (as after a NATS restart)
        rather than being reaped for this client's silence."""
        now = asyncio.get_running_loop().time()
        for state in self.workers.values():
            state.last_seen = max(state.last_seen, now)
        log.warning("inference.loop_stalled", stalled_s=round(stalled_s, 3), workers=len(self.workers))

    async def _reap_forever(self) -> None:
        loop = asyncio.get_running_loop()
        interval = max(0.05, self.config.heartbeat_timeout_s / 4)
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            late = loop.time() - due
            if late > self.config.heartbeat_timeout_s / 2:
                self.excuse_stall(late)
            self.reap()

    def choose(self, prefer: str | None = None, exclude: frozenset[str] | set[str] = frozenset()) -> WorkerState | None:
        """The sticky worker when it is live, not draining and has room; else the least loaded; else None."""
        if prefer is not None and prefer not in exclude:
            state = self.workers.get(prefer)
            if state is not None and not state.draining and state.has_room:
                return state
        best: WorkerState | None = None
        best_score = 0.0
        for state in self.workers.values():
            if state.draining or state.worker_id in exclude:
                continue
            score = state.load / state.capacity if state.capacity > 0 else float(state.load)
            if best is None or score < best_score:
                best, best_score = state, score
        return best

    # --- requests ---------------------------------------------------------------------------------
    async def request_once(self, subject: str, payload: bytes, worker: WorkerState | None,
                           request_id: str = "") -> Msg:
        """One try: publish the request and wait for its reply, the worker's loss, or the timeout (``expire``)."""
        token, reply, fut = self._inbox.open(subject)
        if request_id:
            self._by_request[request_id] = fut
        if worker is not None:
            worker.waiting.add(fut)
            worker.local_inflight += 1
        else:
            self._waiting_any.add(fut)
        try:
            headers: dict[str, str] | None = self.tracing.inject({}) if self.tracing.enabled else None
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
            return await fut
        finally:
            self._inbox.close(token)
            if request_id:
                self._by_request.pop(request_id, None)
            if worker is not None:
                worker.waiting.discard(fut)
                worker.local_inflight -= 1
            else:
                self._waiting_any.discard(fut)

    async def generate(self, build: Callable[[int], InferenceRequested], prefer: str | None = None) -> TurnGenerated:
        """The turn for the request ``build(try_number)`` (tries count from 1), within the retry budget.

        Raises ``InferenceError`` when the budget is spent (retryable) or a worker refused the request for
        good (not retryable).
        """
        excluded: set[str] = set()
        last: InferenceError | None = None
        loop = asyncio.get_running_loop()
        for attempt in range(1, self.config.max_tries + 1):
            if attempt > 1:
                self._on_retry()
                await asyncio.sleep(backoff_delay(attempt - 2, self.config.backoff_initial_s,
                                                  self.config.backoff_max_s, jitter=0.0))
            worker = self.choose(prefer, excluded)
            subject = worker.subject if worker is not None else INFER_ANY
            request = build(attempt)
            started = loop.time()
            try:
                reply = await self.request_once(subject, encode(request), worker, request.request_id)
                turn = self._turn_of(reply, subject)
            except asyncio.CancelledError:
                # The episode stopped waiting (its deadline passed): let the worker abort the generation.
                with contextlib.suppress(Exception):
                    await self.nc.publish(INFER_CANCEL, request.request_id.encode())
                raise
            except TryFailed as exc:
                last = exc
                if worker is not None:
                    excluded.add(worker.worker_id)
                log.info("inference.try_failed", request_id=request.request_id, subject=subject, error=str(exc))
                continue
            except SchemaError as exc:
                raise InferenceError(f"malformed reply from {subject}: {exc}", retryable=False) from exc
            self._on_latency(loop.time() - started)
            return turn
        raise InferenceError(f"no turn after {self.config.max_tries} tries: {last}", retryable=True)

    @classmethod
    def _turn_of(cls, reply: Msg, subject: str) -> TurnGenerated:
        """The reply's turn; ``TryFailed`` for a retryable error reply or a worker of a newer contract major (a
        rolling upgrade: another worker can serve it), ``InferenceError`` / ``SchemaError`` otherwise."""
        cls._check_error_reply(reply, subject)
        try:
            return decode_as(reply.data, TurnGenerated)
        except NewerContractError as exc:
            raise TryFailed(f"{subject} answered in a newer contract: {exc}") from exc

    @staticmethod
    def _check_error_reply(reply: Msg, subject: str) -> None:
        headers = reply.headers or {}
        error = headers.get(ERROR_HEADER)
        if error is None:
            return
        message = reply.data.decode(errors="replace")
        if headers.get(RETRYABLE_HEADER, "false").lower() == "true":
            raise TryFailed(f"{subject} answered {error}: {message}")
        raise InferenceError(f"{subject} refused the request ({error}): {message}", retryable=False)


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
