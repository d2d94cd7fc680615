"""Asks inference workers for turns: the env worker's one handle on inference, composing the parts that each own
one job.

- ``inference_workers.py``: the table of live workers from their heartbeats (JSON on ``INFER_HEARTBEAT``, about
  once a second); a worker silent for ``heartbeat_timeout_s`` is reaped, and the requests waiting on it fail over
  at once instead of waiting for ``request_timeout_s``; and which worker gets a request (``choose``: sticky, else
  least loaded).
- ``inference_request.py``: one request and its retry budget. Requests and replies are msgpack events
  (``InferenceRequested`` as a core NATS request to the worker's own subject, or to ``INFER_ANY``, a queue group,
  when no worker is known; ``TurnGenerated`` back, or an error reply with headers).
- ``inference_recovery.py``: after a NATS restart (or a reconnect to another cluster node), the tries still
  waiting are answered from their turns on RL_EVENTS rather than generated twice.

With tracing on, each request's headers carry the trace context of the turn asking (shared/kit/tracing.py): the
inference worker's generation span is its child.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.services.env_worker.inference_recovery import TurnRecovery
from rollout_ledger.services.env_worker.inference_request import TurnRequests
from rollout_ledger.services.env_worker.inference_workers import WorkerState, WorkerTable, parse_heartbeat
from rollout_ledger.shared.events import InferenceRequested, TurnGenerated
from rollout_ledger.shared.kit.bus import best_effort
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import INFER_HEARTBEAT


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
    ask_progress: bool = True
    """Ask workers for signs of life while they generate a try, and wait ``request_timeout_s`` from the last one
    (inference_request.py); False: wait from the send, as a requester of an older release does."""


class InferenceClient:
    """Routes turn requests to inference workers and retries them within a budget."""

    def __init__(self, nc: NATS, config: InferenceClientConfig, *,
                 on_retry: Callable[[], None] | None = None,
                 on_latency: Callable[[float], None] | None = None, tracing: Tracing | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self.config = config
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Carries the current span's trace context in each request's headers (off: no headers)."""
        self.table = WorkerTable(config.heartbeat_timeout_s, clock)
        self.requests = TurnRequests(
            nc, self.table, request_timeout_s=config.request_timeout_s, max_tries=config.max_tries,
            backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s,
            on_retry=on_retry or (lambda: None), on_latency=on_latency or (lambda _s: None), tracing=self.tracing,
            ask_progress=config.ask_progress)
        self.recovery = TurnRecovery(nc, self.table, self.requests, config.request_timeout_s)
        self._first_heartbeat = asyncio.Event()
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None

    @property
    def workers(self) -> dict[str, WorkerState]:
        """The live inference workers by id."""
        return self.table.workers

    async def start(self) -> None:
        """Subscribe to heartbeats and the reply inbox; start the reaper of silent workers."""
        await self.requests.start()
        self._subs.append(await self.nc.subscribe(INFER_HEARTBEAT, cb=self._on_heartbeat))
        self._reaper = asyncio.create_task(self._reap_forever())

    async def wait_for_workers(self, timeout_s: float) -> bool:
        """Listen up to ``timeout_s`` for a first heartbeat, so the first turns are routed to known workers."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._first_heartbeat.wait()
        return bool(self.workers)

    async def stop(self) -> None:
        await self.recovery.stop()
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
        for sub in self._subs:
            with best_effort("unsubscribe"):
                await sub.unsubscribe()
        self._subs.clear()
        await self.requests.stop()

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = parse_heartbeat(msg)
        if hb is None:
            return
        reconnected_since = self.table.heard(hb)
        if reconnected_since is not None:
            self.recovery.worker_reconnected(reconnected_since)
        self._first_heartbeat.set()

    def reap(self) -> list[str]:
        """Forget workers silent for ``heartbeat_timeout_s``; fail the tries waiting on them (and those sent to
        ``INFER_ANY``). Returns their ids. Nobody is reaped while this client is itself cut off from NATS, nor at
        the tick it is back (``TurnRecovery.cut_off``)."""
        now = self.table.clock()
        if self.recovery.cut_off(now):
            return []
        dead = self.table.reap(now)
        self.requests.fail_over(dead)
        return [s.worker_id for s in dead]

    def excuse_stall(self, stalled_s: float) -> None:
        """This client's own loop was blocked for ``stalled_s``: every worker gets a full heartbeat timeout."""
        self.table.excuse_stall(stalled_s)

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

    async def request_once(self, subject: str, payload: bytes, worker: WorkerState | None,
                           request_id: str = "") -> Msg:
        """One try (``TurnRequests.request_once``)."""
        return await self.requests.request_once(subject, payload, worker, request_id)

    async def generate(self, build: Callable[[int], InferenceRequested], prefer: str | None = None, *,
                       pool: str | None = None) -> TurnGenerated:
        """The turn for the request ``build(try_number)`` within the retry budget (``TurnRequests.generate``)."""
        return await self.requests.generate(build, prefer, pool=pool)
