"""One delivered work item to its end: decoded (dead-lettered when it cannot be, handed back when it is of a newer
contract or not this worker's env), its episode claimed under its lease (``leases.py``: a redelivery of an episode
running elsewhere is held, not run again), run as an attempt in its span (continued
from the work item's headers), then acked, or handed back (nak) when the attempt could not end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg

from rollout_ledger.services.env_worker.agents.agent_runtime import AgentRuntime
from rollout_ledger.services.env_worker.attempt import AttemptDeps, AttemptOutcome
from rollout_ledger.services.env_worker.driver import EpisodeDriver
from rollout_ledger.services.env_worker.leases import Claim, EpisodeLeases, Lease, LeaseLost, LeaseTerm
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.refusals import hand_back, reject_work_item
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.shared.errors import BusError, NewerContractError, SchemaError
from rollout_ledger.shared.events import EpisodeRequested, decode_as
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.kit.tracing import SpanKind, Tracing
from rollout_ledger.shared.subjects import LEASE_TTL_S

log = get_logger(__name__)

_NAK_DELAY_S = 1.0
"""Pause before a handed-back work item is offered again (a bus hiccup should not burn deliveries at once)."""

_LEASE_POLL_S = 0.5
"""How often a held redelivery asks whether its episode's lease holder is still there."""


@dataclass
class _Running:
    """An episode this worker runs: its lease and every delivery of its work item (a redelivery to this same worker
    while it runs joins ``msgs``: pinged and acked with the first)."""

    msgs: list[Msg]
    lease: Lease
    revision: int
    term: LeaseTerm
    """When the lease was last written and the next renewal is due."""
    lost: LeaseLost | None = None
    """Set when another holder took the lease (ours expired): the episode's task is cancelled, nothing handed back."""
    settled: bool = False
    """Set once the item is acked or handed back: its lease is written no more and its deliveries pinged no more."""


class EpisodeRunner:
    """Runs the episodes of the work items this worker pulled, each under its lease."""

    def __init__(self, settings: EnvWorkerSettings, leases: EpisodeLeases, metrics: EnvWorkerMetrics,
                 deps: AttemptDeps, *, envs: frozenset[str], route_of: Callable[[str], str],
                 agents: AgentRuntime | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.leases = leases
        self.metrics = metrics
        self.deps = deps
        self.agents = agents
        """Agent functions run as envs (their episodes talk to the policy through the session endpoint)."""
        self.tracing = tracing if tracing is not None else Tracing.off()
        self.envs = envs
        """The envs this worker has (built-in, library, remote and user envs, and agent functions)."""
        self._route_of = route_of
        """The route of one of this worker's envs: where the next attempt's work item goes."""
        self.running: dict[str, _Running] = {}
        """Episode id -> the episode this worker runs now."""
        self._ping_s = min(settings.ack_wait_s, LEASE_TTL_S) / 3
        """In-progress pings and lease refreshes: three per ack wait and per lease TTL."""

    async def handle(self, msg: Msg) -> None:
        """Decode one delivery and run it, or dead-letter it or hand it back."""
        try:
            item = decode_as(msg.data, EpisodeRequested)
        except NewerContractError as exc:
            # A newer scheduler in a rolling upgrade: not garbage. Hand it back for a newer worker.
            self.metrics.work_items_parked.inc()
            log.warning("work_item.newer_contract", error=str(exc), delay_s=self.settings.park_delay_s)
            try:
                await hand_back(self.deps.publisher, msg, self.settings.park_delay_s, self.settings.publish_timeout_s)
            except BusError as bus_exc:
                log.warning("work_item.hand_back_failed", error=str(bus_exc))
            return
        except Exception as exc:  # SchemaError, or anything else the bytes make the decoder raise: dead-lettered
            reason = f"undecodable work item: {exc}" if isinstance(exc, SchemaError) else \
                f"undecodable work item: {type(exc).__name__}: {exc}"
            await reject_work_item(self.deps.publisher, msg, reason)
            return
        if item.env not in self.envs:
            # Not this worker's env: an item of the previous release's single subject, or a family member this
            # worker lacks. Another worker's: hand it back without spending a delivery (it waits, never fails).
            log.info("work_item.not_my_env", env=item.env, episode_id=item.episode_id, subject=msg.subject,
                     delay_s=self.settings.route_hand_back_s)
            try:
                await hand_back(self.deps.publisher, msg, self.settings.route_hand_back_s,
                                self.settings.publish_timeout_s)
            except BusError as bus_exc:
                log.warning("work_item.hand_back_failed", error=str(bus_exc))
            return
        await self._run_item(msg, item)

    async def _run_item(self, msg: Msg, item: EpisodeRequested) -> None:
        """Run the episode of a decoded work item under its lease, unless it runs already (here or elsewhere)."""
        seq = msg.metadata.sequence.stream
        running = self.running.get(item.episode_id)
        if running is not None and running.lease.seq == seq:  # redelivered to this worker while it runs it
            running.msgs.append(msg)
            self.metrics.work_items_fenced.inc()
            log.info("work_item.fenced", episode_id=item.episode_id, holder=self.settings.worker_id,
                     delivery=bus.delivery_attempt(msg))
            return
        attempt = item.attempt_base + bus.delivery_attempt(msg)
        run = await self._claim(msg, item.episode_id, self.leases.mine(seq, attempt))
        if run is None:
            return
        self.running[item.episode_id] = run
        task = asyncio.current_task()
        assert task is not None
        keeper = asyncio.create_task(self._keep(item.episode_id, run, task))
        try:
            await self._run_leased(run, item, attempt)
        finally:
            try:
                await cancel_and_wait(keeper)  # a plain cancel can be lost in a lease refresh: this episode hung on it
            finally:  # even when a cancellation of the keeper's (fenced out) lands here: the episode is over
                if self.running.get(item.episode_id) is run:
                    del self.running[item.episode_id]

    async def _claim(self, msg: Msg, episode_id: str, lease: Lease) -> _Running | None:
        """Take the episode's lease for this delivery. While a live holder has it (the episode runs elsewhere: this
        is a redelivery after a NATS restart) wait; once the lease is gone, run the item as a new attempt if it is
        still queued (its holder died), else let it be (its holder finished). None when there is nothing to run.

        The delivery is kept in progress all along: a lease request that hangs through a stream's election (a few
        seconds) must not let the ack wait run out, or the item is delivered again elsewhere and run there as a
        new attempt, though this one never started."""
        async with bus.keep_in_progress(msg, self._ping_s):
            return await self._claim_in_progress(msg, episode_id, lease)

    async def _claim_in_progress(self, msg: Msg, episode_id: str, lease: Lease) -> _Running | None:
        held_since: Claim | None = None
        # (revision, clock time) of the last write of our lease: its TTL runs from there, not from the claim's end
        written: tuple[int, float] | None = None
        while True:
            try:
                claim = await self.leases.acquire(episode_id, lease)
                if claim.taken:
                    if written is None or written[0] != claim.revision:
                        written = (claim.revision, self.leases.clock())
                    if await self.leases.still_queued(lease.seq):
                        revision = claim.revision
                        if self.leases.clock() - written[1] > self._ping_s:
                            # the claim took long (an election): write the lease again before the episode runs, or
                            # its TTL may end under it and a redelivery elsewhere run a second attempt beside it
                            revision = await self.leases.refresh(episode_id, lease, revision)
                        return _Running([msg], lease, revision, self.leases.term(self._ping_s))
                    # finished and acked by another holder between this delivery and now: nothing to run
                    await self.leases.release(episode_id, claim.revision)
                    log.info("work_item.finished_elsewhere", episode_id=episode_id, seq=lease.seq)
                    return None
            except BusError as exc:  # NATS reconnecting: ask again
                log.warning("episode.lease_unavailable", episode_id=episode_id, error=str(exc))
                await asyncio.sleep(_LEASE_POLL_S)
                continue
            except LeaseLost as exc:  # ours expired during the claim and another holder took it: wait for it
                claim = Claim(False, 0, exc.holder)
            if held_since is None:
                self.metrics.work_items_fenced.inc()
                log.info("work_item.fenced", episode_id=episode_id, attempt=lease.attempt,
                         holder=claim.holder.worker if claim.holder else None,
                         holder_attempt=claim.holder.attempt if claim.holder else None)
            held_since = claim
            await self.leases.wait_gone(episode_id, claim, _LEASE_POLL_S)

    async def _keep(self, episode_id: str, run: _Running, task: asyncio.Task[None]) -> None:
        """Every ``term.every_s``: in-progress pings for every delivery of the item, and the lease written again.
        When another holder took the lease (ours expired during a long outage), cancel the episode's task."""
        while True:
            await asyncio.sleep(run.term.every_s)
            if run.settled:
                return
            for m in list(run.msgs):
                # a lost ping only risks a redelivery, which the lease holds
                with bus.best_effort("tell JetStream an item is in progress"):
                    await m.in_progress()
            if run.settled:
                return
            try:
                run.revision = await self.leases.refresh(episode_id, run.lease, run.revision)
            except LeaseLost as exc:
                run.lost = exc
                log.warning("episode.lease_lost", episode_id=episode_id, attempt=run.lease.attempt, error=str(exc))
                # cancelled again until it stops: a cancellation landing with a request's reply is lost on 3.11, and
                # the episode would run on beside the new holder (its end, _run_item's, cancels this keeper)
                await cancel_and_wait(task, raise_errors=False)
                return
            except BusError as exc:  # NATS reconnecting: the next tick writes it again
                # past the TTL the bucket has dropped the lease: the next write that succeeds takes it again or
                # finds the holder that took it (LeaseLost, above)
                log.warning("episode.lease_refresh_failed", episode_id=episode_id, error=str(exc),
                            unrenewed_s=round(run.term.age(), 1), expired=run.term.expired())
                continue
            run.term.renewed()

    async def _hand_back(self, run: _Running, episode_id: str, delay_s: float | None = None) -> None:
        """Nak the item (another attempt, here or elsewhere) and release its lease so that attempt need not wait."""
        run.settled = True
        with bus.best_effort("nak an item to retry"):
            await run.msgs[-1].nak(delay=delay_s)
        await self.leases.release(episode_id, run.revision)

    async def _run_leased(self, run: _Running, item: EpisodeRequested, attempt: int) -> None:
        self.metrics.episodes_in_flight.inc()
        try:
            outcome = await self._attempt(run, item, attempt)
            await bus.ack_sync(run.msgs[-1], self.settings.publish_timeout_s)  # tried again through an election
            run.settled = True
            for m in run.msgs[:-1]:
                with bus.best_effort("ack a finished item"):
                    await m.ack()
            # after the ack: a delivery that finds the lease gone then finds the item gone from the queue too
            await self.leases.release(item.episode_id, run.revision)
            self.metrics.episodes_total.labels(status=outcome.status).inc()
        except asyncio.CancelledError:
            if run.lost is not None:  # another holder runs the episode now: stop, hand nothing back
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                log.info("episode.fenced_out", episode_id=item.episode_id, attempt=attempt)
                return
            await self._hand_back(run, item.episode_id)
            log.info("episode.handed_back", episode_id=item.episode_id, attempt=attempt, reason="drain timeout")
            raise
        except Exception as exc:  # a bus failure or a bug: hand the item back for another attempt
            log.error("episode.handed_back", episode_id=item.episode_id, attempt=attempt,
                      error=f"{type(exc).__name__}: {exc}", exc_info=not isinstance(exc, BusError))
            await self._hand_back(run, item.episode_id, _NAK_DELAY_S)
        finally:
            self.metrics.episodes_in_flight.dec()

    async def _attempt(self, run: _Running, item: EpisodeRequested, attempt: int) -> AttemptOutcome:
        """Run the attempt, in its span (a child of the trace context in the work item's headers, when tracing is on
        and it carries one), and queue the next attempt's work item when it failed with budget left."""
        deps = self.deps
        with self.tracing.span("episode", parent=self.tracing.extract(run.msgs[0].headers), kind=SpanKind.CONSUMER,
                               attributes={"rollout.episode_id": item.episode_id, "rollout.batch_id": item.batch_id,
                                           "rollout.attempt": attempt, "rollout.env": item.env,
                                           "rollout.worker_id": self.settings.worker_id}) as span:
            agent = self.agents.driver(deps, item, attempt) if self.agents is not None else None
            outcome = await (agent or EpisodeDriver(deps, item, attempt)).run()
            if span is not None:
                span.set_attributes({"rollout.status": outcome.status, "rollout.turns": outcome.num_turns})
            if outcome.retry is not None:
                # The next attempt's work item goes on the queue before this one is acked (retries.py); if
                # the publish fails, the handed-back item's redelivery runs that attempt instead. It carries this
                # attempt's trace context: the next attempt continues the episode's trace.
                await deps.publisher.publish_event(outcome.retry, route=self._route_of(item.env))
                self.metrics.attempts_retried.labels(failure_class=str(outcome.failure_class)).inc()
        return outcome
