"""The env worker's consume loop: pulls work items for free slots from the consumers of its routes (routing.py: only
episodes of envs it has reach it), runs each episode as a task under its episode lease (leases.py: a redelivery of
an episode running elsewhere is held, not run again), holds new episodes back while a policy version is drained
(policy_gate.py), drains on SIGTERM. Each attempt is a span of its episode's trace (shared/kit/tracing.py), continued
from the work item's headers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.agents.runtime import AgentRuntime
from rollout_ledger.services.env_worker.attempt import AttemptDeps, AttemptOutcome
from rollout_ledger.services.env_worker.cancellation import CancelWatch
from rollout_ledger.services.env_worker.dead_letters import reject_work_item
from rollout_ledger.services.env_worker.driver import EpisodeDriver
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.leases import Claim, EpisodeLeases, Lease, LeaseLost
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.services.env_worker.resume import ResumeReader
from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.routing import (
    FairSlots,
    WorkerReport,
    register_adverts,
    report_forever,
    routes_of,
)
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.envs.base import EnvLLM
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.shared.errors import BusError, NewerContractError, SchemaError
from rollout_ledger.shared.events import EpisodeRequested, decode_as
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import Health, Shutdown, sleep_or_shutdown
from rollout_ledger.shared.kit.tracing import SpanKind, Tracing
from rollout_ledger.shared.subjects import (
    LEASE_TTL_S,
    WORK_CONSUMER,
    WORK_STREAM,
    WORK_SUBJECT,
    work_consumer,
    work_subject,
)

log = get_logger(__name__)

_NAK_DELAY_S = 1.0
"""Pause before a handed-back work item is offered again (a bus hiccup should not burn deliveries at once)."""


_LEASE_POLL_S = 0.5
"""How often a held redelivery asks whether its episode's lease holder is still there."""

_SUBSCRIBE_RETRY_S = 5.0
"""Pause before trying again to declare a route's consumer the server refused (e.g. ``RL_WORK`` does not take the
route subjects yet: during an upgrade only the scheduler's NATS user may update the stream)."""

LEGACY = ""
"""The key of the legacy consumer among a worker's pullers (no route is empty)."""


@dataclass
class _Running:
    """An episode this worker runs: its lease and every delivery of its work item (a redelivery to this same worker
    while it runs joins ``msgs``: pinged and acked with the first)."""

    msgs: list[Msg]
    lease: Lease
    revision: int
    lost: LeaseLost | None = None
    """Set when another holder took the lease (ours expired): the episode's task is cancelled, nothing handed back."""


async def register_envs(js: JetStreamContext, envs: EnvRegistry, worker_id: str) -> None:
    """Advertise this worker's envs in the ``rl_envs`` bucket (the scheduler's list of known envs and their routes;
    a family as one entry, routing.py)."""
    await register_adverts(js, envs.specs(), worker_id)


class EnvWorker:
    """Runs episodes from the work queue with at most ``settings.concurrency`` in flight."""

    def __init__(self, settings: EnvWorkerSettings, nc: NATS, envs: EnvRegistry, template: TurnTemplate,
                 metrics: EnvWorkerMetrics, health: Health, agents: AgentRuntime | None = None,
                 env_llm: EnvLLM | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing if tracing is not None else Tracing.off()
        """An attempt's span continues the trace of its work item; turns and env calls are its children."""
        self.env_llm = env_llm
        """The chat LLM handed to envs (a simulated user); None: envs get none."""
        self.agents = agents
        """Agent functions run as envs (their episodes talk to the policy through the session endpoint)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.envs = envs
        self.template = template
        self.metrics = metrics
        self.health = health
        self.cancels = CancelWatch()
        self.client = InferenceClient(
            nc,
            InferenceClientConfig(
                request_timeout_s=settings.inference_request_timeout_s,
                max_tries=settings.inference_max_tries,
                backoff_initial_s=settings.inference_backoff_s,
                backoff_max_s=settings.inference_backoff_max_s,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
            ),
            on_retry=metrics.inference_retries.inc,
            on_latency=metrics.turn_latency.observe,
            tracing=self.tracing,
        )
        self.publisher = StreamPublisher(nc, settings.publish_timeout_s, self.tracing)
        self.gate = EpisodeGate(PolicyBus(self.js), settings.worker_id, drain_timeout_s=settings.policy_drain_timeout_s,
                                report_s=settings.policy_report_s, alive=lambda w: w in self.client.workers,
                                metrics=metrics)
        """Holds new episodes back while a policy version announced in mode ``drain`` is being swapped in."""
        self._stopping = asyncio.Event()
        metrics.cancelled_batches.set_function(lambda: len(self.cancels.cancelled))
        self.tasks: set[asyncio.Task[None]] = set()
        metrics.work_items_held.set_function(lambda: len(self.tasks))
        self.routes = routes_of(envs.specs(), agents.names() if agents is not None else ())
        """Route -> the envs of this worker routed by it: the routes whose consumers it pulls."""
        self._env_names = {e for names in self.routes.values() for e in names}
        self.slots = FairSlots(settings.concurrency, settings.fetch_batch, lambda: len(self.tasks))
        self.leases = EpisodeLeases(self.js, settings.worker_id, uuid.uuid4().hex[:12])
        self.running: dict[str, _Running] = {}
        """Episode id -> the episode this worker runs now."""
        self._ping_s = min(settings.ack_wait_s, LEASE_TTL_S) / 3
        """In-progress pings and lease refreshes: three per ack wait and per lease TTL."""

    def _deps(self) -> AttemptDeps:
        resume = ResumeReader(self.nc, self.settings.resume_timeout_s) if self.settings.resume else None
        return AttemptDeps(js=self.js, client=self.client, envs=self.envs, template=self.template,
                          is_cancelled=self.cancels.is_cancelled, metrics=self.metrics,
                          worker_id=self.settings.worker_id, max_model_len=self.settings.max_model_len,
                          publish_timeout_s=self.settings.publish_timeout_s, publisher=self.publisher,
                          budgets=RetryBudgets(self.settings.retry_budgets()),
                          episode_timeout_s=self.settings.episode_timeout_s, env_llm=self.env_llm,
                          tracing=self.tracing, resume=resume)

    def _runs(self, env: str) -> bool:
        """Whether this worker has the env (a built-in, library, remote or user env, or an agent function)."""
        return env in self._env_names

    def _route_of(self, env: str) -> str:
        """The route of one of this worker's envs (an agent function's is its name)."""
        return next((route for route, names in self.routes.items() if env in names), env)

    async def _subscribe(self, route: str) -> JetStreamContext.PullSubscription:
        """Declare the consumer of ``route`` (``LEGACY``: the previous release's subject) and bind a pull to it."""
        s = self.settings
        legacy = route == LEGACY
        spec = bus.work_consumer_spec(s.ack_wait_s, s.max_deliver, s.max_ack_pending, None if legacy else route)
        await bus.ensure_consumer(self.js, spec)
        return await self.js.pull_subscribe(WORK_SUBJECT if legacy else work_subject(route),
                                            durable=WORK_CONSUMER if legacy else work_consumer(route),
                                            stream=WORK_STREAM)

    async def run(self, shutdown: Shutdown) -> None:
        """Set up, take work until ``shutdown``, then drain."""
        s = self.settings
        await bus.ensure_topology(self.js, s.stream_replicas)
        await self.leases.start()
        await register_envs(self.js, self.envs, s.worker_id)
        if self.agents is not None:
            await self.agents.register(self.js, s.worker_id)
        await self.cancels.start(self.js)
        await self.publisher.start()
        await self.client.start()
        if not await self.client.wait_for_workers(s.inference_discovery_s):
            log.warning("env_worker.no_inference_workers", waited_s=s.inference_discovery_s)
        await self.gate.start()  # after the heartbeats: which inference workers are live
        deps = self._deps()
        report = WorkerReport(s.worker_id, list(self.routes), sorted({e for es in self.routes.values() for e in es}),
                              s.legacy_work_queue)
        reporter = asyncio.create_task(report_forever(self.js, report, self._stopping))
        self.health.checks["nats"] = lambda: self.nc.is_connected
        self.health.ready = True
        log.info("env_worker.ready", envs=self.envs.names(), routes=list(self.routes), concurrency=s.concurrency)
        pullers = [*self.routes, *([LEGACY] if s.legacy_work_queue else [])]
        subs: dict[str, JetStreamContext.PullSubscription] = {}
        try:
            async with asyncio.TaskGroup() as group:
                for route in pullers:
                    group.create_task(self._pull(route, subs, deps, shutdown))
        finally:
            self._stopping.set()
            self.health.draining = True
            await self._drain()
            for psub in subs.values():
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()
            with contextlib.suppress(Exception):
                await reporter
            await self.gate.stop()
            await self.client.stop()
            await self.publisher.stop()
            await self.cancels.stop()

    async def _pull(self, route: str, subs: dict[str, JetStreamContext.PullSubscription], deps: AttemptDeps,
                    shutdown: Shutdown) -> None:
        """Pull the work items of one route (or the legacy subject) while slots are free, until ``shutdown``."""
        s = self.settings
        while not shutdown.requested and route not in subs:
            try:
                subs[route] = await self._subscribe(route)
            except Exception as exc:  # refused or NATS reconnecting (nats-py raises several types): again later
                log.warning("work.subscribe_failed", route=route or "(legacy)", error=f"{type(exc).__name__}: {exc}",
                            retry_s=_SUBSCRIBE_RETRY_S)
                await sleep_or_shutdown(shutdown, _SUBSCRIBE_RETRY_S)
        while not shutdown.requested:
            if not self.gate.is_open:  # a policy version is being drained: take no new work item
                await _first(self.gate.wait_open(self._stopping), shutdown.wait())
                continue
            granted = self.slots.grant(route)
            if granted <= 0:
                changed = self.slots.changed()
                await _first(changed.wait(), shutdown.wait())
                continue
            try:
                msgs = await bus.fetch(subs[route], granted, timeout=s.fetch_timeout_s)
            except Exception as exc:  # disconnected or reconnecting: nats-py raises several types; retry
                self.slots.settle(route, granted, 0)
                log.warning("work.fetch_failed", route=route or "(legacy)", error=f"{type(exc).__name__}: {exc}")
                await sleep_or_shutdown(shutdown, 0.5)
                continue
            for msg in msgs:
                if shutdown.requested:
                    with contextlib.suppress(Exception):
                        await msg.nak()
                    continue
                task = asyncio.create_task(self._handle(msg, deps))
                self.tasks.add(task)
                task.add_done_callback(self._task_done)
            self.slots.settle(route, granted, len(msgs))
            if not msgs:
                await asyncio.sleep(0)  # let the routes woken by this settle take the slot before probing again

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.slots.notify()

    async def _handle(self, msg: Msg, deps: AttemptDeps) -> None:
        try:
            item = decode_as(msg.data, EpisodeRequested)
        except NewerContractError as exc:
            # A newer scheduler in a rolling upgrade: not garbage. Hand it back for a newer worker.
            self.metrics.work_items_parked.inc()
            log.warning("work_item.newer_contract", error=str(exc), delay_s=self.settings.park_delay_s)
            try:
                await bus.hand_back(self.js, msg, self.settings.park_delay_s, self.settings.publish_timeout_s)
            except BusError as bus_exc:
                log.warning("work_item.hand_back_failed", error=str(bus_exc))
            return
        except Exception as exc:  # SchemaError, or anything else the bytes make the decoder raise: dead-lettered
            reason = f"undecodable work item: {exc}" if isinstance(exc, SchemaError) else \
                f"undecodable work item: {type(exc).__name__}: {exc}"
            await reject_work_item(self.js, msg, reason, self.settings.publish_timeout_s)
            return
        if not self._runs(item.env):
            # Not this worker's env: an item of the previous release's single subject, or a family member this
            # worker lacks. Another worker's: hand it back without spending a delivery (it waits, never fails).
            log.info("work_item.not_my_env", env=item.env, episode_id=item.episode_id, subject=msg.subject,
                     delay_s=self.settings.route_hand_back_s)
            try:
                await bus.hand_back(self.js, msg, self.settings.route_hand_back_s, self.settings.publish_timeout_s)
            except BusError as bus_exc:
                log.warning("work_item.hand_back_failed", error=str(bus_exc))
            return
        await self._run_item(msg, item, deps)

    async def _run_item(self, msg: Msg, item: EpisodeRequested, deps: AttemptDeps) -> None:
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
            await self._run_leased(run, item, attempt, deps)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            if self.running.get(item.episode_id) is run:
                del self.running[item.episode_id]

    async def _claim(self, msg: Msg, episode_id: str, lease: Lease) -> _Running | None:
        """Take the episode's lease for this delivery. While a live holder has it (the episode runs elsewhere: this
        is a redelivery after a NATS restart) keep this delivery in progress and wait; once the lease is gone, run
        the item as a new attempt if it is still queued (its holder died), else let it be (its holder finished).
        None when there is nothing to run."""
        held_since: Claim | None = None
        while True:
            try:
                claim = await self.leases.acquire(episode_id, lease)
                if claim.taken:
                    if await self.leases.still_queued(lease.seq):
                        return _Running([msg], lease, claim.revision)
                    # finished and acked by another holder between this delivery and now: nothing to run
                    await self.leases.release(episode_id, claim.revision)
                    log.info("work_item.finished_elsewhere", episode_id=episode_id, seq=lease.seq)
                    return None
            except Exception as exc:  # NATS reconnecting: nats-py raises several types; ask again
                log.warning("episode.lease_unavailable", episode_id=episode_id, error=f"{type(exc).__name__}: {exc}")
                async with bus.keep_in_progress(msg, self._ping_s):
                    await asyncio.sleep(_LEASE_POLL_S)
                continue
            if held_since is None:
                self.metrics.work_items_fenced.inc()
                log.info("work_item.fenced", episode_id=episode_id, attempt=lease.attempt,
                         holder=claim.holder.worker if claim.holder else None,
                         holder_attempt=claim.holder.attempt if claim.holder else None)
            held_since = claim
            async with bus.keep_in_progress(msg, self._ping_s):
                await self.leases.wait_gone(episode_id, claim, _LEASE_POLL_S)

    async def _keep(self, episode_id: str, run: _Running, task: asyncio.Task[None]) -> None:
        """Every ``_ping_s``: in-progress pings for every delivery of the item, and the lease written again. When
        another holder took the lease (ours expired during a long outage), cancel the episode's task."""
        while True:
            await asyncio.sleep(self._ping_s)
            for m in list(run.msgs):
                with contextlib.suppress(Exception):  # a lost ping only risks a redelivery, which the lease holds
                    await m.in_progress()
            try:
                run.revision = await self.leases.refresh(episode_id, run.lease, run.revision)
            except LeaseLost as exc:
                run.lost = exc
                log.warning("episode.lease_lost", episode_id=episode_id, attempt=run.lease.attempt, error=str(exc))
                task.cancel()
                return
            except Exception as exc:  # NATS reconnecting: the next tick writes it again
                log.warning("episode.lease_refresh_failed", episode_id=episode_id, error=f"{type(exc).__name__}: {exc}")

    async def _hand_back(self, run: _Running, episode_id: str, delay_s: float | None = None) -> None:
        """Nak the item (another attempt, here or elsewhere) and release its lease so that attempt need not wait."""
        with contextlib.suppress(Exception):
            await run.msgs[-1].nak(delay=delay_s)
        await self.leases.release(episode_id, run.revision)

    async def _run_leased(self, run: _Running, item: EpisodeRequested, attempt: int, deps: AttemptDeps) -> None:
        if not await self.gate.admit(self._stopping):  # the worker stops while the item waited: hand it back
            await self._hand_back(run, item.episode_id)
            return
        self.metrics.episodes_in_flight.inc()
        try:
            outcome = await self._attempt(run, item, attempt, deps)
            await run.msgs[-1].ack_sync(timeout=self.settings.publish_timeout_s)
            for m in run.msgs[:-1]:
                with contextlib.suppress(Exception):
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
            self.gate.finished()
            self.metrics.episodes_in_flight.dec()

    async def _attempt(self, run: _Running, item: EpisodeRequested, attempt: int, deps: AttemptDeps) -> AttemptOutcome:
        """Run the attempt, in its span (a child of the trace context in the work item's headers, when tracing is on
        and it carries one), and queue the next attempt's work item when it failed with budget left."""
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
                await bus.publish_event(self.js, outcome.retry, timeout=self.settings.publish_timeout_s,
                                        route=self._route_of(item.env), tracing=self.tracing)
                self.metrics.attempts_retried.labels(failure_class=str(outcome.failure_class)).inc()
        return outcome

    async def _drain(self) -> None:
        """Let in-flight episodes finish within ``drain_timeout_s``; cancel (and so nak) the rest."""
        if not self.tasks:
            return
        log.info("env_worker.draining", in_flight=len(self.tasks), timeout_s=self.settings.drain_timeout_s)
        _, pending = await asyncio.wait(set(self.tasks), timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        log.info("env_worker.drained", handed_back=len(pending))


async def _first(*aws: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of the coroutines completes; cancel the others."""
    tasks = [asyncio.create_task(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
