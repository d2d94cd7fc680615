"""The policy weights an inference worker serves: the version every turn it generates carries, the swap of its
engine's weights to a newer version without a restart, and the follower that takes the version announced in the
``rl_policy`` bucket and reports each step in ``rl_policy_workers``.

An announcement in mode ``drain`` is an episode-level drain: the env workers start no new episode and report in
``rl_policy_env`` once their running episodes have finished (services/env_worker/policy_gate.py). The follower
checks the checkpoint first (a refused one pauses nobody for long), then keeps serving the turns of those episodes
until every live env worker reports drained for the version (at most ``episode_drain_timeout_s``; past it, logged,
it goes on with the turn-level drain below and episodes that still run span the two versions), then swaps. The env
workers start episodes again once every live inference worker serves the version. ``abort`` pauses no episode.

A swap (one at a time; a newer announcement during a swap is taken after it):

1. the gate closes: a request that arrives waits at it (it is not refused: its episode goes on after the swap);
2. ``drain``: the generations in flight finish on the old weights (for at most ``drain_timeout_s``; the rest are
   then aborted as below). ``abort``: they are aborted now and, after the swap, generated again on the new weights
   (the requester gets one turn, on the new version; the turns its episode kept before keep theirs). ``keep``:
   they are aborted now too, but each keeps the ids it had sampled, with the old version, and after the swap
   generation continues from prompt + those ids on the new weights (``server.py``): the turn carries both
   versions (``TurnGenerated.version_runs``) and nothing sampled is thrown away (AReaL's and PipelineRL's
   interruptible generation). An engine that cannot return a cut generation's ids refuses ``keep``;
3. the engine loads the checkpoint (``Engine.load_weights`` checks it first; a refusal changes nothing and the old
   version keeps serving) and drops its prefix cache;
4. the new version serves: every generation that starts from now on carries it; the gate opens.

A load that fails after the check may leave a half-loaded model: the engine reports itself unhealthy, the worker
turns not ready and exits, and its supervisor restarts it; at start a worker loads the announced version.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollout_ledger.services.inference_worker.checkpoints import WeightsRefused
from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus, ReportMirror
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.policy_versions import (
    EnvPolicyReport,
    PolicyAnnouncement,
    SwapMode,
    WorkerPolicyReport,
    WorkerPolicyState,
    envs_not_drained,
)
from rollout_ledger.shared.subjects import POLICY_WORKERS_BUCKET

log = get_logger(__name__)


class SwapRefused(WeightsRefused):
    """The swap cannot be done in the announced mode by this engine (nothing changed)."""


class Cut(enum.Enum):
    """What a swap did to a generation in flight (``Weights.finished``)."""

    NONE = "none"
    """Not cut: its output is the turn."""
    AGAIN = "again"
    """Cut in mode ``abort`` (or a drain past its timeout): generated again from the start on the new weights."""
    CONTINUE = "continue"
    """Cut in mode ``keep``: its ids are kept, and generation continues after them on the new weights."""


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
        self._cut: dict[str, Cut] = {}
        """Requests a swap cut, and how they go on after it."""
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

    def finished(self, request_id: str) -> Cut:
        """The request's generation returned; whether a swap cut it (and how it goes on)."""
        self._running.pop(request_id, None)
        if not self._running:
            self._idle.set()
        return self._cut.pop(request_id, Cut.NONE)

    async def swap(self, version: int, checkpoint: str, mode: SwapMode) -> None:
        """Serve ``version`` from ``checkpoint``; ``WeightsRefused`` (the old version still serves) or any other
        exception (the engine may be half-loaded: it reports itself unhealthy)."""
        if mode is SwapMode.KEEP and not self.engine.supports_keep:
            raise SwapRefused(f"mode keep: the {self.engine.name} engine cannot return the ids of a cut generation "
                              "to continue it; announce it with mode drain or abort")
        async with self._lock:
            began = time.monotonic()
            self._open.clear()
            try:
                if mode is SwapMode.ABORT:
                    await self._abort_running()
                elif mode is SwapMode.KEEP:
                    await self._abort_running(Cut.CONTINUE)
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

    async def _abort_running(self, how: Cut = Cut.AGAIN) -> None:
        running = list(self._running)
        log.info("weights.abort_running", cut=len(running), then=how.value)
        self._cut.update((rid, how) for rid in running)
        await asyncio.gather(*(self.engine.abort(rid) for rid in running), return_exceptions=True)

    async def _wait_idle(self, timeout_s: float | None) -> bool:
        if timeout_s is None:
            await self._idle.wait()
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self._idle.is_set()


@dataclass(frozen=True)
class EpisodeDrain:
    """How the follower waits for the env workers' episodes before a ``drain`` swap (see the module docstring)."""

    episodes: ReportMirror[EnvPolicyReport] | None
    """The env workers' reports (``rl_policy_env``); None: no episode-level drain (turn-level only)."""
    timeout_s: float = 120.0
    """At most this long; 0: turn-level drain only."""
    precheck: Callable[[str], Awaitable[None]] | None = None
    """Raises ``WeightsRefused`` for a checkpoint the engine would refuse, before anyone is held back for it."""
    on_waited: Callable[[float], None] | None = None
    """Called with the seconds each episode-level drain waited (a metric)."""
    on_timeout: Callable[[], None] | None = None
    """Called when one gave up waiting (a metric)."""


class PolicyFollower:
    """Takes the announced version into ``Weights`` and reports this worker's state (see the module docstring)."""

    def __init__(self, bus: PolicyBus, weights: Weights, worker_id: str, report_s: float = 15.0,
                 on_failed_load: Callable[[BaseException], Awaitable[None]] | None = None,
                 episode_drain: EpisodeDrain | None = None) -> None:
        self.bus = bus
        self.weights = weights
        self.worker_id = worker_id
        self.report_s = report_s
        self.on_failed_load = on_failed_load
        self.episode_drain = episode_drain or EpisodeDrain(None)
        self.target = weights.serving
        """The newest version this worker was told of."""
        self.state = WorkerPolicyState.SERVING
        self.error = ""
        self.last_episode_drain_s: float | None = None
        """Seconds the last ``drain`` swap waited for the env workers' episodes."""
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Load the announced version if it is newer than the start weights (before the worker serves), report,
        then follow announcements and report periodically."""
        self._started = True
        newer = [a for a in await self.bus.announced() if a.version > self.weights.serving]
        if newer:
            await self._load_newest(newer)
        await self.report()
        self._tasks = [asyncio.create_task(self.bus.follow(self.apply, self._stopped), name="policy-follow"),
                       asyncio.create_task(self._report_forever(), name="policy-report")]

    async def stop(self) -> None:
        """Stop following and take this worker's report out of ``rl_policy_workers``: a worker that stopped serves
        nothing, so admission and the env workers' drain must not count its version until the report expires."""
        self._stopped.set()
        await cancel_and_wait(self._tasks, raise_errors=False)
        self._tasks.clear()
        if self._started:
            await self.bus.delete(POLICY_WORKERS_BUCKET, self.worker_id)

    async def apply(self, announcement: PolicyAnnouncement) -> None:
        """Swap to ``announcement`` if it is newer than what serves; report every step."""
        if announcement.version <= self.weights.serving or announcement.version < self.target:
            return
        if announcement.version == self.target and self.state is WorkerPolicyState.FAILED:
            return  # refused already (a replayed announcement): wait for a newer one
        old = self.weights.serving
        try:
            if announcement.mode is SwapMode.DRAIN:
                await self._drain_episodes(announcement)
            self.target, self.state, self.error = announcement.version, WorkerPolicyState.LOADING, ""
            await self.report()
            log.info("weights.swap", version=announcement.version, mode=str(announcement.mode),
                     checkpoint=announcement.checkpoint, serving=old)
            await self.weights.swap(announcement.version, announcement.checkpoint, announcement.mode)
        except WeightsRefused as exc:
            self.target, self.state, self.error = announcement.version, WorkerPolicyState.FAILED, str(exc)
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

    async def _drain_episodes(self, announcement: PolicyAnnouncement) -> None:
        """Before a ``drain`` swap: check the checkpoint, then serve on until every live env worker has drained
        for the version (bounded; see the module docstring). ``WeightsRefused`` for a refused checkpoint."""
        drain = self.episode_drain
        version = announcement.version
        self.target, self.state, self.error = version, WorkerPolicyState.ANNOUNCED, ""
        if drain.precheck is not None:
            await drain.precheck(announcement.checkpoint)
        if drain.episodes is None or drain.timeout_s <= 0:
            return
        await self.report()
        episodes = drain.episodes
        began = time.monotonic()
        waiting = envs_not_drained(episodes.live(), version)
        if waiting:
            log.info("weights.episode_drain", version=version, waiting_for=waiting, timeout_s=drain.timeout_s)
        drained = await episodes.wait_until(lambda live: not envs_not_drained(live, version), drain.timeout_s)
        self.last_episode_drain_s = waited = time.monotonic() - began
        if drain.on_waited is not None:
            drain.on_waited(waited)
        if drained:
            log.info("weights.episodes_drained", version=version, waited_s=round(waited, 3),
                     env_workers=len(episodes.live()))
            return
        log.warning("weights.episode_drain_timeout", version=version, timeout_s=drain.timeout_s,
                    waiting_for=envs_not_drained(episodes.live(), version),
                    action="turn-level drain: episodes still running span the two versions")
        if drain.on_timeout is not None:
            drain.on_timeout()

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
        if self._started:
            await self.bus.put(POLICY_WORKERS_BUCKET, self.worker_id, report or self.current_report())

    async def _report_forever(self) -> None:
        async for _ in ticks(self._stopped, self.report_s, at_once=False):  # the first report went out at start
            await self.report()
