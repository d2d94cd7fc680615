"""The NATS side of the inference worker: takes turn requests, runs them on the engine, records and answers them.

Design note. Requests arrive as core NATS requests on two subscriptions: the worker's own subject
(``rl.infer.worker.<id>``, for session-sticky routing) and ``rl.infer.any`` in the queue group ``inference``.
nats-py runs a subscription's callback one message at a time, so the callback only checks capacity and starts
a task; the tasks run concurrently and the engine batches them. For each request:

1. decode ``InferenceRequested`` (a bad payload gets an error reply, never a crash);
2. ``engine.generate``;
3. build ``TurnGenerated`` (``event_id`` = ``request_id``), publish it on RL_EVENTS with that ``Nats-Msg-Id``
   and await the stream's ack (shared/kit/publisher.py): the turn is durable before the requester sees it;
4. answer with the same event bytes.

Errors are answered, not raised: the reply carries headers ``Rollout-Error`` (class name) and
``Rollout-Retryable`` (``true``/``false``) with the message as body. Over ``max_inflight`` a request is
answered ``Overloaded`` (retryable) at once. A heartbeat every ``heartbeat_s`` announces the worker's subject,
load, weight version and whether it is draining. ``drain`` stops taking work, lets in-flight requests finish
within a deadline and aborts the rest (answered retryable, so the requester tries another worker). A requester
that stops waiting (its episode's deadline passed) publishes the request id on ``INFER_CANCEL``; the worker
running it aborts it in the engine, so no turn is generated or recorded for it.

Progress. A request whose headers ask for it (``Rollout-Progress-To``: the requester's progress subject,
``Rollout-Progress-Every``: seconds) is named that often on that subject while this worker holds it (waiting for a
weight swap, generating, storing), until its reply: its requester then waits for a silent worker, not for a slow
one. One loop sends them all (``PROGRESS_MIN_S`` a tick, no task per request), one message per requester and tick
listing the reply subjects of its requests that are due.

Model pools. A worker of the pool ``policy`` (the default) does all of the above and also answers requests
addressed to its pool (``infer_pool_subject("policy")``). A worker of any other pool (a simulated user's model)
subscribes only to ``infer_pool_subject(pool)`` (and ``INFER_CANCEL``): no heartbeat, so env workers never route
the policy's turns to it, and policy-version drains never wait for it. A request with ``record=False`` (an env's
own generation) is answered without publishing its turn; a non-policy pool records none.

Tracing (shared/kit/tracing.py; no-ops when off): a request whose headers carry a trace context is served in a
``generation`` span, its child (the requesting turn's), and the turn's event carries that span's context on to the
recorder. A request without one (an older env worker, an env's own generation) is served as before, untraced.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.services.inference_worker.engine import Engine, Generation
from rollout_ledger.services.inference_worker.metrics import InferenceMetrics
from rollout_ledger.services.inference_worker.weights import Cut, Weights
from rollout_ledger.shared.errors import BusError, InferenceError, NewerContractError, RolloutError, SchemaError
from rollout_ledger.shared.events import (
    FinishReason,
    InferenceRequested,
    SamplingParams,
    TurnGenerated,
    decode_as,
    dumps,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.kit.runtime import ticks
from rollout_ledger.shared.kit.tracing import SpanKind, Tracing
from rollout_ledger.shared.subjects import (
    INFER_ANY,
    INFER_CANCEL,
    INFER_HEARTBEAT,
    INFER_QUEUE,
    POLICY_POOL,
    PROGRESS_MIN_S,
    error_headers,
    infer_pool_subject,
    infer_worker_subject,
    progress_asked,
)

log = get_logger(__name__)

OVERLOADED = "Overloaded"
"""Error class of the immediate reply when the worker is at ``max_inflight``."""

PUBLISH_RETRY_S = 6.0
"""How long a turn's publish is tried again while RL_EVENTS elects a leader (~5 s after a node's loss) before the
requester gets a retryable error reply (and asks another worker): shorter than ``bus.RETRY_FOR_S``, the requester is
waiting. After a reconnect of this worker the publish goes on for ``bus.RETRY_FOR_S`` (``InferenceServer._store``)."""


@dataclass(frozen=True)
class WorkerIdentity:
    """What the worker stamps on its turns and heartbeats."""

    worker_id: str
    weight_version: int
    max_inflight: int
    heartbeat_s: float
    pool: str = POLICY_POOL
    """The model pool (``InferenceSettings.pool``): ``policy`` serves the policy's turns, any other only requests
    addressed to that pool."""

    @property
    def is_policy(self) -> bool:
        return self.pool == POLICY_POOL

    @property
    def subject(self) -> str:
        return infer_worker_subject(self.worker_id)

    @property
    def produced_by(self) -> str:
        return f"inference-worker/{self.worker_id}"


TAKEN_MEMORY_S = 300.0
"""How long a request id this worker took (in flight or answered) is remembered: a requester that lost track of its
request in a NATS restart sends it again (same id, same reply subject) while its try still waits, within its
``ROLLOUT_INFERENCE_REQUEST_TIMEOUT_S`` (120 s by default) of the first copy, and such a copy must not be generated a
second time (``TakenRequests``). A copy that comes later is generated again: compute spent twice, the turn still
stored once (the stream deduplicates it by its id)."""
TAKEN_MAX = 100_000
"""At most this many request ids are remembered (the oldest go first): ~25 MB, five minutes of a worker serving 330
turns a second."""


class TakenRequests:
    """The requests this worker took (in flight or answered) in the last ``TAKEN_MEMORY_S``, by id with their reply
    subject, oldest first."""

    def __init__(self, memory_s: float = TAKEN_MEMORY_S, max_taken: int = TAKEN_MAX) -> None:
        self.memory_s = memory_s
        self.max_taken = max_taken
        self._at: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._at

    def is_copy(self, request_id: str, reply: str) -> bool:
        """Whether a request ``request_id`` with reply subject ``reply`` is a copy of one taken: the same request sent
        again by its requester's recovery, to the same reply subject. Another requester asking with the same id (its
        own reply subject) is served as a request of its own (the turn is stored once: the stream deduplicates it)."""
        taken = self._at.get(request_id)
        return taken is not None and taken[1] == reply

    def take(self, request_id: str, reply: str, now: float | None = None) -> bool:
        """Whether the request is to be served (then it is remembered from ``now``, monotonic seconds); False for a
        copy (``is_copy``) of a request in flight or answered: its turn is generated once, and its reply, to the
        subject both copies carry, is let through by the copy's arrival on this connection."""
        now = time.monotonic() if now is None else now
        while self._at:
            oldest, (at, _) = next(iter(self._at.items()))
            if now - at <= self.memory_s:
                break
            del self._at[oldest]
        if self.is_copy(request_id, reply):
            return False
        self._at[request_id] = (now, reply)
        self._at.move_to_end(request_id)
        if len(self._at) > self.max_taken:
            self._at.popitem(last=False)
        return True

    def forget(self, request_id: str) -> None:
        """The request was answered with an error: a copy sent again is a request of its own."""
        self._at.pop(request_id, None)


PROGRESS_MAX_BYTES = 64 * 1024
"""The most bytes of reply subjects one progress message carries (far under NATS's 1 MiB payload limit: a requester
with tens of thousands of requests here gets several messages)."""


def progress_bodies(replies: list[str], max_bytes: int = PROGRESS_MAX_BYTES) -> list[bytes]:
    """The reply subjects ``replies`` as progress message bodies, one a line, each body at most ``max_bytes`` (or
    one subject, should a subject alone be longer)."""
    bodies: list[bytes] = []
    lines: list[bytes] = []
    size = 0
    for reply in replies:
        line = reply.encode()
        if lines and size + 1 + len(line) > max_bytes:
            bodies.append(b"\n".join(lines))
            lines, size = [], 0
        size += len(line) + (1 if lines else 0)
        lines.append(line)
    if lines:
        bodies.append(b"\n".join(lines))
    return bodies


def request_log(request: InferenceRequested) -> Any:
    """A logger bound to the request's episode and batch (built only when there is something to log)."""
    return log.bind(episode_id=request.episode_id, batch_id=request.batch_id, request_id=request.request_id)


class InferenceServer:
    """Serves turn requests from NATS with one engine; ``start`` subscribes, ``drain`` stops gracefully."""

    def __init__(self, nc: NATS, engine: Engine, identity: WorkerIdentity, metrics: InferenceMetrics,
                 weights: Weights | None = None, tracing: Tracing | None = None) -> None:
        self.nc = nc
        self.tracing = tracing if tracing is not None else Tracing.off()
        """Generation spans, children of the requesting turn (off: none)."""
        self.publisher = StreamPublisher(nc, tracing=self.tracing, retry_for_s=PUBLISH_RETRY_S)
        self.engine = engine
        self.identity = identity
        self.weights = weights if weights is not None else Weights(engine, identity.weight_version)
        """The version each turn carries, and the gate a weight swap closes (weights.py)."""
        self.metrics = metrics
        self.draining = False
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._active: set[str] = set()
        self._generating_since: dict[str, float] = {}
        """Request id -> when its current generation entered the engine (monotonic)."""
        self.taken = TakenRequests()
        """The request ids in flight or answered: a copy sent again is joined, not generated twice."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._progress: dict[str, tuple[str, str, float, float]] = {}
        """Request id -> (progress subject, reply subject, interval, when it is next due) of the requests held here
        whose requester asked for progress."""
        self._progress_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        metrics.oldest_generation.set_function(self.oldest_generation_s)

    def oldest_generation_s(self) -> float:
        """Seconds the longest-running generation in the engine has been running (0 when none)."""
        if not self._generating_since:
            return 0.0
        return time.monotonic() - min(self._generating_since.values())

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        """Subscribe to the worker's subject and the shared queue group, then announce the worker."""
        await self.publisher.start()
        pool_subject = infer_pool_subject(self.identity.pool)
        self._subs.append(await self.nc.subscribe(pool_subject, queue=INFER_QUEUE, cb=self._on_request))
        self._subs.append(await self.nc.subscribe(INFER_CANCEL, cb=self._on_cancel))
        if self.identity.is_policy:
            self._subs.append(await self.nc.subscribe(self.identity.subject, cb=self._on_request))
            self._subs.append(await self.nc.subscribe(INFER_ANY, queue=INFER_QUEUE, cb=self._on_request))
            await self.heartbeat()
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        self._progress_task = asyncio.create_task(self._progress_loop())
        log.info("inference.serving", subject=self.identity.subject, pool=self.identity.pool, engine=self.engine.name,
                 max_inflight=self.identity.max_inflight)

    def heartbeat_payload(self) -> dict[str, Any]:
        return {
            "worker_id": self.identity.worker_id,
            "subject": self.identity.subject,
            "inflight": self.inflight,
            "capacity": self.identity.max_inflight,
            "weight_version": self.weights.serving,
            "swapping": self.weights.swapping,
            "engine": self.engine.name,
            "draining": self.draining,
            "time": time.time(),
            "every_s": self.identity.heartbeat_s,
            # a reconnect (to another node of a cluster) makes that node refuse replies to requests taken before:
            # requesters look their turns up on RL_EVENTS instead (env_worker/inference_client.py)
            "reconnects": int(self.nc.stats.get("reconnects", 0)),
            # a request sent again with the same id joins the one in flight or answered: requesters may send the
            # requests a NATS restart may have lost again instead of waiting for their timeout (inference_recovery)
            "takes_resent": True,
        }

    async def heartbeat(self) -> None:
        if not self.identity.is_policy:  # a worker of another pool is never routed policy turns by heartbeat
            return
        with bus.best_effort("publish a heartbeat"):  # a missed heartbeat is harmless; the next one follows
            await self.nc.publish(INFER_HEARTBEAT, dumps(self.heartbeat_payload()))

    async def _heartbeat_loop(self) -> None:
        async for _ in ticks(self._stopped, self.identity.heartbeat_s, at_once=False):  # the first went out at start
            await self.heartbeat()

    async def _progress_loop(self) -> None:
        async for _ in ticks(self._stopped, PROGRESS_MIN_S, at_once=False):
            await self.say_progress(time.monotonic())

    async def say_progress(self, now: float) -> int:
        """Tell the requesters of the requests whose progress is due at ``now`` that each is still held here (one
        message per requester); how many requests were named."""
        due: dict[str, list[str]] = {}
        for request_id, (to, reply, every_s, at) in self._progress.items():
            if at <= now:
                due.setdefault(to, []).append(reply)
                self._progress[request_id] = (to, reply, every_s, now + every_s)
        for to, replies in due.items():
            for body in progress_bodies(replies):
                with bus.best_effort("publish a progress message"):  # a lost one is covered by the next ones
                    await self.nc.publish(to, body)
        return sum(len(replies) for replies in due.values())

    async def drain(self, timeout_s: float) -> None:
        """Announce draining, stop taking requests, finish in-flight ones within ``timeout_s``, abort the rest."""
        self.draining = True
        await self.heartbeat()
        for sub in self._subs:
            with bus.best_effort("drain a subscription"):
                await asyncio.wait_for(sub.drain(), timeout=5)
        self._subs.clear()
        log.info("inference.draining", inflight=self.inflight, timeout_s=timeout_s)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            if pending:
                log.warning("inference.drain_timeout", aborting=len(self._active))
                for request_id in list(self._active):
                    await self.engine.abort(request_id)
                _, pending = await asyncio.wait(pending, timeout=5)
                for task in pending:
                    task.cancel()
        self._stopped.set()
        if self._heartbeat_task is not None:
            await self._heartbeat_task
        if self._progress_task is not None:
            await self._progress_task
        await self.publisher.stop()
        with bus.best_effort("flush"):
            await self.nc.flush(timeout=5)
        log.info("inference.drained")

    async def _on_request(self, msg: Msg) -> None:
        received = time.perf_counter()
        if not msg.reply:
            self.metrics.outcome["bad_request"].inc()
            log.warning("inference.no_reply_subject", subject=msg.subject)
            return
        if len(self._tasks) >= self.identity.max_inflight:
            if self._copy_of_taken(msg):  # its generation is one of those in flight: no error reply to fail it
                self.metrics.outcome["resent"].inc()
                return
            self.metrics.outcome["overloaded"].inc()
            await self._reply_error(msg, OVERLOADED, True, f"worker {self.identity.worker_id} is at capacity")
            return
        task = asyncio.create_task(self._serve(msg, received))
        self._tasks.add(task)
        self.metrics.inflight.set(len(self._tasks))
        task.add_done_callback(self._done)

    def _copy_of_taken(self, msg: Msg) -> bool:
        """Whether ``msg`` is a copy of a request this worker took (read only when it is at capacity)."""
        try:
            return self.taken.is_copy(decode_as(msg.data, InferenceRequested).request_id, msg.reply)
        except SchemaError:  # not a request this code reads: refused as overloaded, as any request would be
            return False

    async def _on_cancel(self, msg: Msg) -> None:
        """The requester stopped waiting for a request (a deadline): abort it if it runs here."""
        request_id = msg.data.decode(errors="replace")
        if request_id in self._active:
            log.info("inference.cancelled_by_requester", request_id=request_id)
            await self.engine.abort(request_id)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.metrics.inflight.set(len(self._tasks))

    def _reconnects(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    async def _store(self, event: TurnGenerated, data: bytes, reconnects: int) -> None:
        """Publish the turn and await the stream's ack (tried again for ``PUBLISH_RETRY_S``). When this worker
        reconnected since the request came (to another node of a cluster), its reply would be refused: the requester
        reads the turn from RL_EVENTS instead (inference_client.py), so the publish goes on for ``bus.RETRY_FOR_S``
        rather than end in an error reply nobody receives."""
        deadline = time.monotonic() + bus.RETRY_FOR_S
        while True:
            try:
                await self.publisher.publish(event.type, event.event_id, data)
                return
            except BusError as exc:
                if not exc.retryable or self._reconnects() == reconnects or time.monotonic() >= deadline:
                    raise
                log.info("inference.publish_retry_after_reconnect", request_id=event.request_id, error=str(exc))

    async def _reply_error(self, msg: Msg, error_class: str, retryable: bool, message: str) -> None:
        with bus.best_effort("reply with an error"):
            await self.nc.publish(msg.reply, message.encode(), headers=error_headers(error_class, retryable))

    async def _serve(self, msg: Msg, received: float) -> None:
        try:
            request = decode_as(msg.data, InferenceRequested)
        except NewerContractError as exc:
            # A newer env worker in a rolling upgrade: another (upgraded) worker can serve it.
            self.metrics.outcome["newer_contract"].inc()
            log.warning("inference.newer_contract", error=str(exc))
            await self._reply_error(msg, type(exc).__name__, True, str(exc))
            return
        except SchemaError as exc:
            self.metrics.outcome["bad_request"].inc()
            log.warning("inference.bad_request", error=str(exc))
            await self._reply_error(msg, type(exc).__name__, False, str(exc))
            return
        except Exception as exc:  # a decoder bug must not leave the requester waiting
            self.metrics.outcome["internal_error"].inc()
            log.exception("inference.decode_failed")
            await self._reply_error(msg, type(exc).__name__, False, str(exc))
            return
        if not self.taken.take(request.request_id, msg.reply):
            self.metrics.outcome["resent"].inc()
            request_log(request).info("inference.resent_request_joined")
            return
        answered = False
        asked = progress_asked(msg.headers)
        if asked is not None:
            to, every_s = asked
            self._progress[request.request_id] = (to, msg.reply, every_s, time.monotonic() + every_s)
        try:
            parent = self.tracing.extract(msg.headers)
            if parent is None:
                answered = await self._generate_and_publish(msg, request, received)
                return
            with self.tracing.span("generation", parent=parent, kind=SpanKind.SERVER, attributes={
                    "rollout.request_id": request.request_id, "rollout.episode_id": request.episode_id,
                    "rollout.turn_index": request.turn_index, "rollout.worker_id": self.identity.worker_id,
                    "gen_ai.system": self.engine.name, "gen_ai.request.max_tokens": request.max_tokens,
                    "gen_ai.usage.input_tokens": int(request.prompt_token_ids.shape[0])}):
                answered = await self._generate_and_publish(msg, request, received)
        except Exception as exc:  # the last line of defence: answer, never crash the worker
            self.metrics.outcome["internal_error"].inc()
            request_log(request).exception("inference.internal_error")
            await self._reply_error(msg, type(exc).__name__, False, str(exc))
        finally:
            self._progress.pop(request.request_id, None)
            if not answered:  # an error reply: a copy sent again is a request of its own
                self.taken.forget(request.request_id)

    async def _generate_and_publish(self, msg: Msg, request: InferenceRequested, received: float) -> bool:
        """Generate the turn, store it and reply with it: True; False when the reply was an error."""
        metrics = self.metrics
        reconnects = self._reconnects()  # this connection received the request: only it may answer it
        piece: Generation | None = None
        kept = _Kept()  # what generations cut by swaps in mode keep had sampled, with their versions
        started = time.perf_counter()
        while True:
            version = await self.weights.admit(request.request_id)  # waits while a weight swap is on
            self._active.add(request.request_id)
            self._generating_since[request.request_id] = time.monotonic()
            if piece is None:
                started = time.perf_counter()
            try:
                piece = await self.engine.generate(
                    request.request_id, kept.prompt(request.prompt_token_ids), kept.sampling(request.sampling),
                    request.max_tokens - kept.count, session_key=request.episode_id,
                )
            except RolloutError as exc:
                metrics.outcome["engine_error"].inc()
                request_log(request).warning("inference.engine_error", error=str(exc), retryable=exc.retryable)
                await self._reply_error(msg, type(exc).__name__, exc.retryable, str(exc))
                return False
            finally:
                self._active.discard(request.request_id)
                self._generating_since.pop(request.request_id, None)
                cut = self.weights.finished(request.request_id)
            if cut is Cut.AGAIN:
                # a swap in mode abort cut it: generated again from the start on the new weights
                metrics.regenerated.inc()
                metrics.swap_tokens.labels(fate="lost").inc(kept.count + int(piece.token_ids.shape[0]))
                kept = _Kept()
                continue
            if cut is Cut.CONTINUE and piece.finish_reason == FinishReason.ABORT:
                # mode keep: its ids stay, with the version that sampled them; generation goes on after them
                metrics.swap_tokens.labels(fate="kept").inc(int(piece.token_ids.shape[0]))
                kept.add(piece, version)
                if kept.count < request.max_tokens:
                    continue
                piece = Generation(np.zeros(0, np.int32), np.zeros(0, np.float32), FinishReason.LENGTH)
            kept.add(piece, version, final=True)
            break
        finished = time.perf_counter()
        if piece.finish_reason == FinishReason.ABORT:
            metrics.outcome["aborted"].inc()
            await self._reply_error(msg, InferenceError.__name__, True,
                                    f"request {request.request_id} aborted by worker {self.identity.worker_id} "
                                    "(draining, or its requester cancelled it)")
            return False
        generation = kept.generation(piece)
        version = kept.runs[0][1]
        prompt_len = int(request.prompt_token_ids.shape[0])
        event = TurnGenerated(
            event_id=request.request_id,
            episode_id=request.episode_id,
            batch_id=request.batch_id,
            attempt=request.attempt,
            seq=request.reply_seq,
            produced_by=self.identity.produced_by,
            request_id=request.request_id,
            turn_index=request.turn_index,
            prompt_len=prompt_len,
            token_ids=generation.token_ids,
            logprobs=generation.logprobs,
            top_logprobs=generation.top_logprobs,
            finish_reason=generation.finish_reason,
            weight_version=version,
            version_runs=kept.runs if len(kept.runs) > 1 else None,
            engine=self.engine.name,
            worker_id=self.identity.worker_id,
            queue_ms=(started - received) * 1000.0,
            generate_ms=(finished - started) * 1000.0,
            cached_tokens=generation.cached_tokens,
        )
        data = encode(event)
        try:
            if request.record and self.identity.is_policy:
                await self._store(event, data, reconnects)
            else:
                metrics.unrecorded.inc()  # an env's own generation (a simulated user): answered, not a policy turn
        except RolloutError as exc:
            metrics.outcome["bus_error"].inc()
            request_log(request).warning("inference.publish_failed", error=str(exc))
            await self._reply_error(msg, type(exc).__name__, True, str(exc))
            return False
        with bus.best_effort("reply with the turn"):  # stored: a lost reply is read back from RL_EVENTS
            await self.nc.publish(msg.reply, data)
        metrics.outcome["ok"].inc()
        metrics.prompt_tokens.inc(prompt_len)
        metrics.generated_tokens.inc(int(generation.token_ids.shape[0]))
        if generation.cached_tokens:
            metrics.cached_tokens.inc(generation.cached_tokens)
        metrics.queue_seconds.observe(started - received)
        metrics.generate_seconds.observe(finished - started)
        return True


class _Kept:
    """The pieces of one turn across swaps in mode ``keep``: each piece's ids and logprobs, and the runs of versions
    (``TurnGenerated.version_runs``)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.top: list[dict[int, float]] | None = []
        self.runs: list[tuple[int, int]] = []
        self.count = 0

    def prompt(self, prompt: np.ndarray) -> np.ndarray:
        """What the next piece is generated from: the prompt and every id kept so far."""
        return np.concatenate([prompt, *self.ids]).astype(np.int32, copy=False) if self.ids else prompt

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The next piece's parameters: a ``min_tokens`` floor counts the ids kept so far."""
        if not self.count or not sampling.min_tokens:
            return sampling
        return sampling.model_copy(update={"min_tokens": max(0, sampling.min_tokens - self.count)})

    def add(self, piece: Generation, version: int, final: bool = False) -> None:
        """One more piece, sampled by ``version`` (``final``: the last one, which ends the turn)."""
        n = int(piece.token_ids.shape[0])
        if (n and (not self.runs or self.runs[-1][1] != version)) or (final and not self.runs):
            self.runs.append((self.count, version))
        self.ids.append(piece.token_ids)
        self.logprobs.append(piece.logprobs)
        if self.top is not None and piece.top_logprobs is not None:
            self.top.extend(piece.top_logprobs)
        elif n:
            self.top = None
        self.count += n

    def generation(self, last: Generation) -> Generation:
        """The whole turn: every piece in order, ending as the last one ended."""
        if len(self.ids) == 1:
            return last
        return Generation(np.concatenate(self.ids).astype(np.int32, copy=False),
                          np.concatenate(self.logprobs).astype(np.float32, copy=False), last.finish_reason,
                          self.top or None, last.cached_tokens)

