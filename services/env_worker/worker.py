"""The env worker's consume loop: pulls work items for free slots, runs each episode as a task, holds new episodes
back while a policy version is drained (policy_gate.py), drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollout_ledger.services.env_worker.cancellation import CancelWatch
from rollout_ledger.services.env_worker.dead_letters import reject_work_item
from rollout_ledger.services.env_worker.driver import DriverDeps, EpisodeDriver
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.metrics import EnvWorkerMetrics
from rollout_ledger.services.env_worker.policy_gate import EpisodeGate
from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.sessions.agents import AgentRuntime
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.shared.errors import BusError, NewerContractError, SchemaError
from rollout_ledger.shared.events import EpisodeRequested, decode_as, dumps
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import PolicyBus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import Health, Shutdown, sleep_or_shutdown
from rollout_ledger.shared.subjects import ENVS_BUCKET, WORK_CONSUMER, WORK_STREAM, WORK_SUBJECT, env_key

log = get_logger(__name__)

_NAK_DELAY_S = 1.0
"""Pause before a handed-back work item is offered again (a bus hiccup should not burn deliveries at once)."""


async def register_envs(js: JetStreamContext, envs: EnvRegistry, worker_id: str) -> None:
    """Put one key per env into the ``rl_envs`` bucket (the scheduler's list of known envs)."""
    kv = await js.key_value(ENVS_BUCKET)
    for spec in envs.specs():
        await kv.put(env_key(spec.name), dumps(spec.advert(registered_by=worker_id)))


class EnvWorker:
    """Runs episodes from the work queue with at most ``settings.concurrency`` in flight."""

    def __init__(self, settings: EnvWorkerSettings, nc: NATS, envs: EnvRegistry, template: TurnTemplate,
                 metrics: EnvWorkerMetrics, health: Health, agents: AgentRuntime | None = None) -> None:
        self.settings = settings
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
        )
        self.publisher = StreamPublisher(nc, settings.publish_timeout_s)
        self.gate = EpisodeGate(PolicyBus(self.js), settings.worker_id, drain_timeout_s=settings.policy_drain_timeout_s,
                                report_s=settings.policy_report_s, alive=lambda w: w in self.client.workers,
                                metrics=metrics)
        """Holds new episodes back while a policy version announced in mode ``drain`` is being swapped in."""
        self._stopping = asyncio.Event()
        metrics.cancelled_batches.set_function(lambda: len(self.cancels.cancelled))
        self.tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()

    def _deps(self) -> DriverDeps:
        return DriverDeps(js=self.js, client=self.client, envs=self.envs, template=self.template,
                          is_cancelled=self.cancels.is_cancelled, metrics=self.metrics,
                          worker_id=self.settings.worker_id, max_model_len=self.settings.max_model_len,
                          publish_timeout_s=self.settings.publish_timeout_s, publisher=self.publisher,
                          budgets=RetryBudgets(self.settings.retry_budgets()),
                          episode_timeout_s=self.settings.episode_timeout_s)

    async def run(self, shutdown: Shutdown) -> None:
        """Set up, take work until ``shutdown``, then drain."""
        s = self.settings
        await bus.ensure_topology(self.js, s.stream_replicas)
        await bus.ensure_consumer(self.js, bus.work_consumer_spec(s.ack_wait_s, s.max_deliver, s.max_ack_pending))
        await register_envs(self.js, self.envs, s.worker_id)
        if self.agents is not None:
            await self.agents.register(self.js, s.worker_id)
        await self.cancels.start(self.js)
        await self.publisher.start()
        await self.client.start()
        if not await self.client.wait_for_workers(s.inference_discovery_s):
            log.warning("env_worker.no_inference_workers", waited_s=s.inference_discovery_s)
        await self.gate.start()  # after the heartbeats: which inference workers are live
        psub = await self.js.pull_subscribe(WORK_SUBJECT, durable=WORK_CONSUMER, stream=WORK_STREAM)
        deps = self._deps()
        self.health.checks["nats"] = lambda: self.nc.is_connected
        self.health.ready = True
        log.info("env_worker.ready", envs=self.envs.names(), concurrency=s.concurrency)
        try:
            await self._consume(psub, deps, shutdown)
        finally:
            self._stopping.set()
            self.health.draining = True
            await self._drain()
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            await self.gate.stop()
            await self.client.stop()
            await self.publisher.stop()
            await self.cancels.stop()

    async def _consume(self, psub: JetStreamContext.PullSubscription, deps: DriverDeps, shutdown: Shutdown) -> None:
        s = self.settings
        while not shutdown.requested:
            if not self.gate.is_open:  # a policy version is being drained: take no new work item
                await _first(self.gate.wait_open(self._stopping), shutdown.wait())
                continue
            free = s.concurrency - len(self.tasks)
            if free <= 0:
                self._slot_free.clear()
                await _first(self._slot_free.wait(), shutdown.wait())
                continue
            try:
                msgs = await bus.fetch(psub, min(free, s.fetch_batch), timeout=s.fetch_timeout_s)
            except Exception as exc:  # disconnected or reconnecting: nats-py raises several types; retry
                log.warning("work.fetch_failed", error=f"{type(exc).__name__}: {exc}")
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

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._slot_free.set()

    async def _handle(self, msg: Msg, deps: DriverDeps) -> None:
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
        attempt = item.attempt_base + bus.delivery_attempt(msg)
        if not self.gate.is_open:  # taken before the gate closed: hold it, in progress, until it opens
            async with bus.keep_in_progress(msg, self.settings.ack_wait_s / 3):
                admitted = await self.gate.admit(self._stopping)
        else:
            admitted = await self.gate.admit(self._stopping)
        if not admitted:  # the worker stops while the item waited: hand it back
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        self.metrics.episodes_in_flight.inc()
        try:
            async with bus.keep_in_progress(msg, self.settings.ack_wait_s / 3):
                agent = self.agents.driver(deps, item, attempt) if self.agents is not None else None
                outcome = await (agent or EpisodeDriver(deps, item, attempt)).run()
                if outcome.retry is not None:
                    # The next attempt's work item goes on the queue before this one is acked (retries.py); if
                    # the publish fails, the handed-back item's redelivery runs that attempt instead.
                    await bus.publish_event(self.js, outcome.retry, timeout=self.settings.publish_timeout_s)
                    self.metrics.attempts_retried.labels(failure_class=str(outcome.failure_class)).inc()
            await msg.ack_sync(timeout=self.settings.publish_timeout_s)
            self.metrics.episodes_total.labels(status=outcome.status).inc()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            log.info("episode.handed_back", episode_id=item.episode_id, attempt=attempt, reason="drain timeout")
            raise
        except Exception as exc:  # a bus failure or a bug: hand the item back for another attempt
            log.error("episode.handed_back", episode_id=item.episode_id, attempt=attempt,
                      error=f"{type(exc).__name__}: {exc}", exc_info=not isinstance(exc, BusError))
            with contextlib.suppress(Exception):
                await msg.nak(delay=_NAK_DELAY_S)
        finally:
            self.gate.finished()
            self.metrics.episodes_in_flight.dec()

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
