"""The env worker's side of a policy version announced in mode ``drain`` (an episode-level drain): the gate in front
of new episodes, this worker's report in ``rl_policy_env``, and when to open the gate again.

1. An announcement (``rl_policy``, through shared/kit/policy_bus.py) of a version ``v`` newer than this worker knew,
   in mode ``drain``, while some live inference worker does not serve ``v`` yet: the gate closes. The worker takes
   no new work item (none is lost and no delivery is spent: they wait in the queue); an item it had taken already
   waits at the gate, kept in progress. Episodes it started before go on (the inference workers keep serving them).
2. When none of its episodes runs it reports ``drained`` for ``v``; every inference worker swaps to ``v`` once
   every live env worker has (services/inference_worker/weights.py), so no episode spans the two versions.
3. The gate opens when every live inference worker serves ``v`` (or refused it), or ``drain_timeout_s`` after it
   closed (logged: an inference worker is stuck). Live inference workers are those whose heartbeats this worker
   hears and that report in ``rl_policy_workers``; with none, nothing closes (no deadlock).

``abort`` and ``keep`` pause nothing (the inference workers cut their turns in flight: generated again, or
continued on the new weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import RECHECK_S, PolicyBus, ReportMirror
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.policy_versions import (
    EnvPolicyReport,
    EnvPolicyState,
    PolicyAnnouncement,
    SwapMode,
    WorkerPolicyReport,
    workers_behind,
)
from rollout_ledger.shared.subjects import POLICY_ENV_BUCKET, POLICY_WORKERS_BUCKET

log = get_logger(__name__)


class EpisodeGate:
    """Whether this env worker may start an episode now, and its report (see the module docstring)."""

    def __init__(self, bus: PolicyBus, worker_id: str, *, drain_timeout_s: float, report_s: float,
                 alive: Callable[[str], bool], metrics: EnvWorkerMetrics | None = None) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.drain_timeout_s = drain_timeout_s
        self.report_s = report_s
        self.alive = alive
        """Whether an inference worker is live (its heartbeats are heard)."""
        self.metrics = metrics
        self.known: int | None = None
        """The newest announced version."""
        self.paused_for: int | None = None
        """The version new episodes are held back for (the gate is closed)."""
        self.drained_for: int | None = None
        self.running = 0
        """Episodes started through the gate and not finished."""
        self.held = 0
        """Work items waiting at the closed gate."""
        self.pauses = 0
        self.last_pause_s: float | None = None
        self.workers: ReportMirror[WorkerPolicyReport] = bus.reports(POLICY_WORKERS_BUCKET, WorkerPolicyReport)
        self._open = asyncio.Event()
        self._open.set()
        self._wake = asyncio.Event()
        self._paused_at = 0.0
        self._deadline = 0.0
        self._stopped = asyncio.Event()
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def state(self) -> EnvPolicyState:
        if self.is_open:
            return EnvPolicyState.RUNNING
        return EnvPolicyState.DRAINED if self.running == 0 else EnvPolicyState.DRAINING

    async def start(self) -> None:
        """Mirror the inference workers' reports, take the current announcement (closing the gate if it is a
        ``drain`` not every live inference worker serves yet), report, then follow announcements."""
        self._started = True
        self.workers.on_change(self._wake.set)
        await self.workers.start()
        current = await self.bus.current()
        if current is not None:
            await self.on_announcement(current)
        else:
            await self.report()
        self._tasks = [asyncio.create_task(self.bus.follow(self.on_announcement, self._stopped), name="policy-follow"),
                       asyncio.create_task(self._report_forever(), name="policy-env-report")]

    async def stop(self) -> None:
        """Stop following and remove this worker's report (inference workers no longer wait for it)."""
        self._stopped.set()
        tasks = [*self._tasks, *([self._supervisor] if self._supervisor is not None else [])]
        await cancel_and_wait(tasks, raise_errors=False)
        self._tasks.clear()
        self._supervisor = None
        await self.workers.stop()
        if self._started:
            await self.bus.delete(POLICY_ENV_BUCKET, self.worker_id)

    async def wait_open(self, stopping: asyncio.Event) -> bool:
        """Wait while the gate is closed; False when ``stopping`` is set first."""
        if self.is_open:
            return True
        waits = [asyncio.create_task(self._open.wait()), asyncio.create_task(stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return self.is_open

    async def admit(self, stopping: asyncio.Event) -> bool:
        """Wait at the gate, then count the episode as running (``finished`` when it ends); False when
        ``stopping`` is set first (the episode does not start)."""
        if not self.is_open:
            self.held += 1
            try:
                if not await self.wait_open(stopping):
                    return False
            finally:
                self.held -= 1
        self.running += 1
        return True

    def finished(self) -> None:
        """An episode admitted by ``admit`` ended."""
        self.running -= 1
        self._wake.set()

    def behind(self, version: int) -> list[str]:
        """The live inference workers that do not serve ``version`` yet (and have not refused it)."""
        return workers_behind(self.workers.live(), version, self.alive)

    async def on_announcement(self, announcement: PolicyAnnouncement) -> None:
        """Take an announcement: a newer ``drain`` that some live inference worker does not serve closes the
        gate; report."""
        version = announcement.version
        if self.known is not None and version <= self.known:
            return
        self.known = version
        behind = self.behind(version) if announcement.mode is SwapMode.DRAIN else []
        if behind:
            self._pause(version, behind)
        else:
            log.info("policy.version_known", version=version, mode=str(announcement.mode), paused=not self.is_open)
        await self.report()

    def _pause(self, version: int, behind: list[str]) -> None:
        now = time.monotonic()
        if self.is_open:
            self._open.clear()
            self._paused_at = now
            self.pauses += 1
            if self.metrics is not None:
                self.metrics.policy_paused.set(1)
        self.paused_for = max(version, self.paused_for or 0)
        self._deadline = now + self.drain_timeout_s
        log.info("policy.pause", version=version, running=self.running, waiting_for=behind,
                 timeout_s=self.drain_timeout_s)
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.create_task(self._supervise(), name="policy-gate")
        self._wake.set()

    async def _supervise(self) -> None:
        """While the gate is closed: report ``drained`` once no episode runs; open it when every live inference
        worker serves the version, or at the deadline."""
        while not self.is_open:
            version = self.paused_for
            assert version is not None
            if self.running == 0 and self.drained_for != version:
                self.drained_for = version
                drained_s = time.monotonic() - self._paused_at
                if self.metrics is not None:
                    self.metrics.policy_episode_drain_seconds.observe(drained_s)
                log.info("policy.drained", version=version, drained_s=round(drained_s, 3), held=self.held)
                await self.report()
            behind = self.behind(version)
            left = self._deadline - time.monotonic()
            if not behind or left <= 0:
                await self._resume(version, behind)
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(RECHECK_S, left))

    async def _resume(self, version: int, behind: list[str]) -> None:
        paused_s = time.monotonic() - self._paused_at
        self.last_pause_s = paused_s
        self.paused_for = None
        self._open.set()
        if self.metrics is not None:
            self.metrics.policy_paused.set(0)
            self.metrics.policy_pause_seconds.observe(paused_s)
        if behind:
            if self.metrics is not None:
                self.metrics.policy_pause_timeouts.inc()
            log.warning("policy.resume_timeout", version=version, paused_s=round(paused_s, 3), waiting_for=behind,
                        timeout_s=self.drain_timeout_s, action="starting episodes while these workers do not serve "
                        "the version: episodes may span versions")
        else:
            log.info("policy.resume", version=version, paused_s=round(paused_s, 3), running=self.running)
        await self.report()

    def current_report(self) -> EnvPolicyReport:
        return EnvPolicyReport(worker_id=self.worker_id, version=self.known or 0, state=self.state,
                               paused_for=self.paused_for, drained_for=self.drained_for, running=self.running,
                               held=self.held)

    async def report(self) -> None:
        """Put this worker's report into ``rl_policy_env``; a lost one is repaired by the next."""
        if self._started and not self._stopped.is_set():
            await self.bus.put(POLICY_ENV_BUCKET, self.worker_id, self.current_report())

    async def _report_forever(self) -> None:
        async for _ in ticks(self._stopped, self.report_s, at_once=False):  # the first report went out at start
            await self.report()
