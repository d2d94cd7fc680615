"""One turn request to the inference workers and its retry budget: each try sent to the chosen worker's subject
(or ``INFER_ANY``) and its reply awaited, failed over when its worker is reaped, tried again within ``max_tries``.

Requests and replies are msgpack events (``shared/events.encode``): ``InferenceRequested`` out, ``TurnGenerated``
back, or an error reply with headers ``Rollout-Error`` (class name) and ``Rollout-Retryable`` (``true``/``false``)
and the message as body. Replies come back through a ``ReplyInbox`` (shared/kit/inbox.py: one wildcard
subscription, one deadline sweeper, no timer or task per request), so a try can also be failed from outside.

A try waits ``request_timeout_s`` from its worker's last sign of life, not from its send: each request asks its
worker (headers ``Rollout-Progress-To``, this client's progress subject, and ``Rollout-Progress-Every``, a
``PROGRESS_SHARE`` of the timeout) to say that it still generates it, and each such message moves the try's
deadline. A turn that takes longer than the timeout on a slow but live worker (a long turn on a CPU, a turn held by a
weight swap) finishes on its first try instead of being cut and generated again from nothing; a try whose request or
worker was lost still fails at its timeout. A worker of an older release sends no progress: its tries wait from the
send, as before.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.services.env_worker.inference_workers import WorkerState, WorkerTable, choose
from rollout_ledger.shared.errors import InferenceError, NewerContractError, SchemaError
from rollout_ledger.shared.events import InferenceRequested, TurnGenerated, decode_as, encode
from rollout_ledger.shared.kit.backoff import backoff_delay
from rollout_ledger.shared.kit.bus import best_effort
from rollout_ledger.shared.kit.inbox import ReplyInbox
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.subjects import (
    ERROR_HEADER,
    INFER_ANY,
    INFER_CANCEL,
    PROGRESS_EVERY_HEADER,
    PROGRESS_TO_HEADER,
    RETRYABLE_HEADER,
    infer_pool_subject,
    infer_progress_subject,
)

log = get_logger(__name__)

PROGRESS_SHARE = 0.25
"""A worker says it still generates a try every this share of ``request_timeout_s``: three progress messages in a
row may be lost before a live try times out."""


class TurnSource(Protocol):
    """Where an attempt gets its turns: ``TurnRequests`` (a fake in unit tests)."""

    async def generate(self, build: Callable[[int], InferenceRequested], prefer: str | None = None, *,
                       pool: str | None = None) -> TurnGenerated:
        """The turn for the request ``build(try_number)``, preferring the worker ``prefer`` (or from the model pool
        ``pool``)."""
        ...


@dataclass(frozen=True)
class Sent:
    """One try as it was sent to a known worker."""

    worker_id: str
    subject: str
    payload: bytes
    reply: str
    headers: dict[str, str] | None


class TryFailed(InferenceError):
    """One try did not produce a turn (no responders, worker lost, timeout or a retryable error reply)."""

    retryable = True


class TurnRequests:
    """The tries in flight (by worker, on ``INFER_ANY``, by request id) and ``generate``'s retry budget."""

    def __init__(self, nc: NATS, table: WorkerTable, *, request_timeout_s: float, max_tries: int,
                 backoff_initial_s: float, backoff_max_s: float, on_retry: Callable[[], None],
                 on_latency: Callable[[float], None], tracing: Tracing, ask_progress: bool = True) -> None:
        self.nc = nc
        self.table = table
        self.max_tries = max_tries
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.tracing = tracing
        self._on_retry = on_retry
        self._on_latency = on_latency
        self.progress_subject = infer_progress_subject(uuid.uuid4().hex) if ask_progress else None
        """Where this client hears that its requests are still generated (``ask_progress=False``: nowhere, as a
        requester of an older release)."""
        self._progress_headers = {} if self.progress_subject is None else {
            PROGRESS_TO_HEADER: self.progress_subject,
            PROGRESS_EVERY_HEADER: f"{request_timeout_s * PROGRESS_SHARE:g}"}
        """Sent with every request."""
        self._progress_sub: Subscription | None = None
        silence = "reply" if self.progress_subject is None else "reply or sign of life"
        self._inbox: ReplyInbox[Msg] = ReplyInbox(
            nc, request_timeout_s, resolve=lambda fut, msg: fut.set_result(msg),
            on_timeout=lambda subject: TryFailed(f"no {silence} from {subject} within {request_timeout_s}s"),
            on_no_responders=lambda _subject: TryFailed("no responders"))
        self.waiting_any: set[asyncio.Future[Msg]] = set()
        """Tries sent to ``INFER_ANY``: whoever took them is unknown, so any worker's death fails them over."""
        self.by_request: dict[str, asyncio.Future[Msg]] = {}
        """Tries waiting for their reply, by request id (= the turn's event id on RL_EVENTS)."""
        self.sent: dict[str, Sent] = {}
        """What each try waiting on a known worker sent, by request id (``resend``)."""

    async def start(self) -> None:
        if self.progress_subject is not None and self._progress_sub is None:
            self._progress_sub = await self.nc.subscribe(self.progress_subject, cb=self._on_progress)
        await self._inbox.start()

    async def stop(self) -> None:
        if self._progress_sub is not None:
            with best_effort("unsubscribe from progress"):
                await self._progress_sub.unsubscribe()
            self._progress_sub = None
        await self._inbox.stop(lambda: TryFailed("inference client stopped"))

    async def _on_progress(self, msg: Msg) -> None:
        """A worker still holds the requests whose reply subjects it lists: each waits a full timeout again."""
        for reply in msg.data.decode(errors="replace").splitlines():
            self._inbox.extend(reply)

    def fail_over(self, dead: Iterable[WorkerState]) -> None:
        """Fail the tries waiting on reaped workers, and every try sent to ``INFER_ANY``: the dead worker may have
        taken them (a live one that did will still answer its copy; the duplicate turn has its own request id and
        is simply not kept)."""
        for state in dead:
            log.warning("inference.worker_lost", worker=state.worker_id, waiting=len(state.waiting),
                        waiting_any=len(self.waiting_any))
            for fut in [*state.waiting, *self.waiting_any]:
                if not fut.done():
                    fut.set_exception(TryFailed(f"inference worker {state.worker_id} stopped sending heartbeats"))

    async def request_once(self, subject: str, payload: bytes, worker: WorkerState | None,
                           request_id: str = "") -> Msg:
        """One try: publish the request and wait for its reply, the worker's loss, or the timeout (``expire``)."""
        token, reply, fut = self._inbox.open(subject)
        headers = self.tracing.inject(dict(self._progress_headers)) or None
        if request_id:
            self.by_request[request_id] = fut
            if worker is not None:
                self.sent[request_id] = Sent(worker.worker_id, subject, payload, reply, headers)
        if worker is not None:
            worker.waiting.add(fut)
            worker.local_inflight += 1
        else:
            self.waiting_any.add(fut)
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
            return await fut
        finally:
            self._inbox.close(token)
            if request_id:
                self.by_request.pop(request_id, None)
                self.sent.pop(request_id, None)
            if worker is not None:
                worker.waiting.discard(fut)
                worker.local_inflight -= 1
            else:
                self.waiting_any.discard(fut)

    async def generate(self, build: Callable[[int], InferenceRequested], prefer: str | None = None, *,
                       pool: str | None = None) -> TurnGenerated:
        """The turn for the request ``build(try_number)`` (tries count from 1), within the retry budget: from the
        policy's workers (``choose``), or from the queue group of the model pool ``pool`` (an env's own LLM).

        A try that failed may still run on its worker (it timed out, or its worker was reaped while it was only
        slow): it is cancelled there (``INFER_CANCEL``) before the next try, so the engine does not go on
        generating a turn nobody waits for. Raises ``InferenceError`` when the budget is spent (retryable) or a
        worker refused the request for good (not retryable).
        """
        excluded: set[str] = set()
        last: InferenceError | None = None
        loop = asyncio.get_running_loop()
        for attempt in range(1, self.max_tries + 1):
            if attempt > 1:
                self._on_retry()
                await asyncio.sleep(backoff_delay(attempt - 2, self.backoff_initial_s, self.backoff_max_s,
                                                  jitter=0.0))
            if pool is None:
                worker = choose(self.table.workers, prefer, excluded)
                subject = worker.subject if worker is not None else INFER_ANY
            else:
                worker, subject = None, infer_pool_subject(pool)
            request = build(attempt)
            started = loop.time()
            try:
                reply = await self.request_once(subject, encode(request), worker, request.request_id)
                turn = turn_of(reply, subject)
            except asyncio.CancelledError:
                # The episode stopped waiting (its deadline passed): let the worker abort the generation.
                await self.cancel(request.request_id)
                raise
            except TryFailed as exc:
                last = exc
                if worker is not None:
                    excluded.add(worker.worker_id)
                log.info("inference.try_failed", request_id=request.request_id, subject=subject, error=str(exc))
                await self.cancel(request.request_id)
                continue
            except SchemaError as exc:
                raise InferenceError(f"malformed reply from {subject}: {exc}", retryable=False) from exc
            self._on_latency(loop.time() - started)
            return turn
        where = f" of model pool {pool!r}" if pool is not None else ""
        raise InferenceError(f"no turn{where} after {self.max_tries} tries: {last}", retryable=True)

    async def resend(self, request_ids: Iterable[str]) -> int:
        """Send the tries of ``request_ids`` still waiting again, as they were sent (same id, same reply subject),
        to workers that join such a copy to the request they took (``WorkerState.takes_resent``); the number sent.

        After a NATS restart a request may have died with the server: its worker never saw it and its reply would
        only come as the try's timeout. A copy is generated where the worker never took the request, and joined to
        it where it did (in flight: the reply, to the same subject, is then let through on the worker's new
        connection; answered: the turn is read back from RL_EVENTS), so nothing is generated twice."""
        count = 0
        for request_id in request_ids:
            sent = self.sent.get(request_id)
            fut = self.by_request.get(request_id)
            if sent is None or fut is None or fut.done():
                continue
            worker = self.table.workers.get(sent.worker_id)
            if worker is None or not worker.takes_resent:
                continue
            with best_effort("send a turn request again"):
                await self.nc.publish(sent.subject, sent.payload, reply=sent.reply, headers=sent.headers)
                count += 1
        return count

    async def cancel(self, request_id: str) -> None:
        """Tell whichever worker runs ``request_id`` to abort it (one that does not run it ignores this)."""
        with best_effort("cancel a turn request"):
            await self.nc.publish(INFER_CANCEL, request_id.encode())


def turn_of(reply: Msg, subject: str) -> TurnGenerated:
    """The reply's turn; ``TryFailed`` for a retryable error reply or a worker of a newer contract major (a rolling
    upgrade: another worker can serve it), ``InferenceError`` / ``SchemaError`` otherwise."""
    _check_error_reply(reply, subject)
    try:
        return decode_as(reply.data, TurnGenerated)
    except NewerContractError as exc:
        raise TryFailed(f"{subject} answered in a newer contract: {exc}") from exc


def _check_error_reply(reply: Msg, subject: str) -> None:
    headers = reply.headers or {}
    error = headers.get(ERROR_HEADER)
    if error is None:
        return
    message = reply.data.decode(errors="replace")
    if headers.get(RETRYABLE_HEADER, "false").lower() == "true":
        raise TryFailed(f"{subject} answered {error}: {message}")
    raise InferenceError(f"{subject} refused the request ({error}): {message}", retryable=False)
