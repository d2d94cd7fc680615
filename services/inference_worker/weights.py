"""The policy weights an inference worker serves: the version every turn it generates carries, the swap of its
engine's weights to a newer version without a restart, and the follower that takes the version announced in the
``rl_policy`` bucket and reports each step in ``rl_policy_workers``.

A swap (one at a time; a newer announcement during a swap is taken after it):

1. the gate closes: a request that arrives waits at it (it is not refused: its episode goes on after the swap);
2. ``drain``: the generations in flight finish on the old weights (for at most ``drain_timeout_s``; the rest are
   then aborted as below). ``abort``: they are aborted now and, after the swap, generated again on the new weights
   (the requester gets one turn, on the new version; the turns its episode kept before keep theirs). ``keep`` is
   refused before anything stops: a turn carries one weight version, so no turn may straddle a swap;
3. the engine loads the checkpoint (``Engine.load_weights`` checks it first; a refusal changes nothing and the old
   version keeps serving) and drops its prefix cache;
4. the new version serves: every generation that starts from now on carries it; the gate opens.

A load that fails after the check may leave a half-loaded model: the engine reports itself unhealthy, the worker
turns not ready and exits, and its supervisor restarts it; at start a worker loads the announced version.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from rollout_ledger.services.inference_worker.checkpoints import WeightsRefused
from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.shared.errors import SchemaError
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.policy import (
    PolicyAnnouncement,
    SwapMode,
    WorkerPolicyReport,
    WorkerPolicyState,
    read_value,
)
from rollout_ledger.shared.subjects import POLICY_BUCKET, POLICY_KEY, POLICY_WORKERS_BUCKET

log = get_logger(__name__)


class SwapRefused(WeightsRefused):
    """The swap cannot be done in the announced mode by this engine (nothing changed)."""


class Weights:
    """The version an engine serves and the gate in front of it (see the module docstring)."""

    def __init__(self, engine: Engine, version: int, drain_timeout_s: float = 60.0,
                 on_swap: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.on_swap = on_swap
        """Called with the seconds each successful swap held the gate closed (a metric)."""
        self.serving = version
        """The version every generation that starts now carries."""
        self.drain_timeout_s = drain_timeout_s
        self.swaps = 0
        self.last_swap_s: float | None = None
        """Seconds the last swap held the gate closed (drain + load)."""
        self._open = asyncio.Event()
        self._open.set()
        self._running: dict[str, int] = {}
        """Request id -> the version its generation started on."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._again: set[str] = set()
        """Requests a swap aborted: generated again after it."""
        self._lock = asyncio.Lock()

    @property
    def swapping(self) -> bool:
        return not self._open.is_set()

    async def admit(self, request_id: str) -> int:
        """Wait while a swap is on, then count the request as running; the version its generation carries."""
        while not self._open.is_set():
            await self._open.wait()
        self._running[request_id] = self.serving
        self._idle.clear()
        return self.serving

    def finished(self, request_id: str) -> bool:
        """The request's generation returned; True when a swap aborted it and it must be generated again."""
        self._running.pop(request_id, None)
        if not self._running:
            self._idle.set()
        if request_id in self._again:
            self._again.discard(request_id)
            return True
        return False

    async def swap(self, version: int, checkpoint: str, mode: SwapMode) -> None:
        """Serve ``version`` from ``checkpoint``; ``WeightsRefused`` (the old version still serves) or any other
        exception (the engine may be half-loaded: it reports itself unhealthy)."""
        if mode is SwapMode.KEEP and not self.engine.supports_keep:
            raise SwapRefused(f"mode keep: the {self.engine.name} engine cannot carry a turn across two weight "
                              "versions (a turn has one version); announce it with mode drain or abort")
        async with self._lock:
            began = time.monotonic()
            self._open.clear()
            try:
                if mode is SwapMode.ABORT:
                    await self._abort_running()
                elif not await self._wait_idle(self.drain_timeout_s):
                    log.warning("weights.drain_timeout", running=len(self._running), timeout_s=self.drain_timeout_s)
                    await self._abort_running()
                await self._wait_idle(None)
                await self.engine.load_weights(checkpoint)
                self.serving = version
                self.swaps += 1
            finally:
                self.last_swap_s = time.monotonic() - began
                self._open.set()
            if self.on_swap is not None:
                self.on_swap(self.last_swap_s)

    async def _abort_running(self) -> None:
        running = list(self._running)
        self._again.update(running)
        await asyncio.gather(*(self.engine.abort(rid) for rid in running), return_exceptions=True)

    async def _wait_idle(self, timeout_s: float | None) -> bool:
        if timeout_s is None:
            await self._idle.wait()
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self._idle.is_set()


class PolicyFollower:
    """Takes the announced version into ``Weights`` and reports this worker's state (see the module docstring)."""

    def __init__(self, js: JetStreamContext, weights: Weights, worker_id: str, report_s: float = 15.0,
                 on_failed_load: Callable[[BaseException], Awaitable[None]] | None = None) -> None:
        self.js = js
        self.weights = weights
        self.worker_id = worker_id
        self.report_s = report_s
        self.on_failed_load = on_failed_load
        self.target = weights.serving
        """The newest version this worker was told of."""
        self.state = WorkerPolicyState.SERVING
        self.error = ""
        self._policy: KeyValue | None = None
        self._reports: KeyValue | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Load the announced version if it is newer than the start weights (before the worker serves), report,
        then follow announcements and report periodically."""
        self._policy = await self.js.key_value(POLICY_BUCKET)
        self._reports = await self.js.key_value(POLICY_WORKERS_BUCKET)
        newer = [a for a in await self._announced() if a.version > self.weights.serving]
        if newer:
            await self._load_newest(newer)
        await self.report()
        self._tasks = [asyncio.create_task(self._follow(), name="policy-follow"),
                       asyncio.create_task(self._report_forever(), name="policy-report")]

    async def stop(self) -> None:
        self._stopped.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def apply(self, announcement: PolicyAnnouncement) -> None:
        """Swap to ``announcement`` if it is newer than what serves; report every step."""
        if announcement.version <= self.weights.serving or announcement.version < self.target:
            return
        if announcement.version == self.target and self.state is WorkerPolicyState.FAILED:
            return  # refused already (a replayed announcement): wait for a newer one
        old = self.weights.serving
        self.target, self.state, self.error = announcement.version, WorkerPolicyState.LOADING, ""
        await self.report()
        log.info("weights.swap", version=announcement.version, mode=str(announcement.mode),
                 checkpoint=announcement.checkpoint, serving=old)
        try:
            await self.weights.swap(announcement.version, announcement.checkpoint, announcement.mode)
        except WeightsRefused as exc:
            self.state, self.error = WorkerPolicyState.FAILED, str(exc)
            log.warning("weights.refused", version=announcement.version, error=str(exc), serving=old)
            await self.report()
            return
        except Exception as exc:  # the engine may be half-loaded: it is unhealthy now, the worker stops
            await self._failed_load(announcement.version, exc)
            return
        await self.report(WorkerPolicyReport(worker_id=self.worker_id, serving=self.weights.serving, version=old,
                                             state=WorkerPolicyState.RETIRED, engine=self.weights.engine.name))
        self.state = WorkerPolicyState.SERVING
        log.info("weights.serving", version=self.weights.serving, swap_s=round(self.weights.last_swap_s or 0, 3))
        await self.report()

    async def _load_newest(self, newer: list[PolicyAnnouncement]) -> None:
        """At start: serve the newest announced version that loads (the current one, unless it is refused: then
        the newest earlier one), and report the current one's state."""
        newest = newer[-1]
        self.target = newest.version
        refusal = ""
        for announcement in reversed(newer):
            try:
                await self.weights.swap(announcement.version, announcement.checkpoint, SwapMode.DRAIN)
            except WeightsRefused as exc:
                refusal = refusal or str(exc)
                log.warning("weights.refused", version=announcement.version, error=str(exc))
                continue
            except Exception as exc:  # half-loaded: see apply
                await self._failed_load(announcement.version, exc)
                return
            break
        if self.weights.serving == newest.version:
            self.state, self.error = WorkerPolicyState.SERVING, ""
        else:
            self.state, self.error = WorkerPolicyState.FAILED, refusal
        log.info("weights.start", serving=self.weights.serving, announced=newest.version, state=str(self.state))

    async def _failed_load(self, version: int, exc: BaseException) -> None:
        """A load failed after the checkpoint's check: report it, and let the worker stop (half-loaded engine)."""
        self.state, self.error = WorkerPolicyState.FAILED, f"{type(exc).__name__}: {exc}"
        log.error("weights.load_failed", version=version, error=self.error)
        await self.report()
        if self.on_failed_load is not None:
            await self.on_failed_load(exc)

    def current_report(self) -> WorkerPolicyReport:
        return WorkerPolicyReport(worker_id=self.worker_id, serving=self.weights.serving, version=self.target,
                                  state=self.state, error=self.error, engine=self.weights.engine.name)

    async def report(self, report: WorkerPolicyReport | None = None) -> None:
        """Put a report (this worker's current one by default); a lost report is repaired by the next."""
        if self._reports is None:
            return
        value = orjson.dumps((report or self.current_report()).model_dump(mode="json"))
        try:
            await self._reports.put(self.worker_id, value)
        except Exception as exc:  # nats-py errors share no base class; the periodic report follows
            log.warning("weights.report_failed", error=str(exc))

    async def _announced(self) -> list[PolicyAnnouncement]:
        """The announcements the bucket still holds, oldest first (``BUCKET_HISTORY``)."""
        assert self._policy is not None
        try:
            entries = await self._policy.history(POLICY_KEY)
        except (KeyNotFoundError, NoKeysError):
            return []
        parsed = [_parse(e.value) for e in entries if e.value]
        return sorted((a for a in parsed if a is not None), key=lambda a: a.version)

    async def _follow(self) -> None:
        assert self._policy is not None
        while not self._stopped.is_set():
            try:
                watcher = await self._policy.watch(POLICY_KEY)
                try:
                    while not self._stopped.is_set():
                        try:
                            entry = await watcher.updates(timeout=1.0)
                        except TimeoutError:
                            continue
                        if entry is None or entry.value is None:
                            continue
                        announcement = _parse(entry.value)
                        if announcement is not None:
                            await self.apply(announcement)
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost watch (NATS restarting): watch again, it replays the current value
                log.warning("weights.watch_lost", error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), 1.0)

    async def _report_forever(self) -> None:
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.report_s)
            if not self._stopped.is_set():
                await self.report()


def _parse(value: bytes | None) -> PolicyAnnouncement | None:
    try:
        return read_value(PolicyAnnouncement, value)
    except SchemaError as exc:
        log.warning("weights.bad_announcement", error=str(exc))
        return None
