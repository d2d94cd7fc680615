"""Bus helpers: connect with bounded timeouts, declare streams and consumers, fetch and ack (publishing is the
producer's: publisher.py).

Ack policies are declared as data (``ConsumerSpec`` in subjects.py plus the per-service settings that
size them); the loops that apply them live in the services.

Failures are turned into ``BusError`` here, the one place that knows nats-py's error types: ``retryable`` is True
for what passes (a JetStream cluster electing a leader answers 503 ``ServiceUnavailableError`` or no responders, a
node going away makes requests time out while the client reconnects to another) and False for a refusal that
another try cannot change (400, 404, an authorization violation). Loops catch ``BusError`` and back off
(``bus_errors``, ``fetch``); publishes and acks whose every try is idempotent (``Nats-Msg-Id`` dedupe, a repeated
ack) retry by themselves for ``retry_for_s`` (``ack_sync``; publishes in publisher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.settings import NatsSecurity
from rollout_ledger.shared.kit.tasks import cancel_and_wait
from rollout_ledger.shared.nats_auth import inbox_prefix
from rollout_ledger.shared.subjects import (
    BUCKET_HISTORY,
    BUCKET_TTL_S,
    BUCKETS,
    EVENTS_STREAM,
    RECORDER_CONSUMER,
    STREAMS,
    WORK_CONSUMER,
    WORK_STREAM,
    WORK_SUBJECT,
    ConsumerSpec,
    StreamSpec,
    event_subject,
    work_consumer,
    work_subject,
)

log = get_logger(__name__)

_T = TypeVar("_T")

RETRY_FOR_S = 30.0
"""How long an idempotent publish or ack retries a passing failure by default: a JetStream cluster elects a new
stream leader within ~5-10 s of a node's loss (measured: docs/benchmarks.md, "NATS cluster")."""
_RETRY_BASE_S, _RETRY_CAP_S = 0.1, 2.0
"""Pauses between tries of a passing failure: 0.1 s doubling to 2 s."""

_PASSING = (
    ServiceUnavailableError,  # 503: the stream or consumer has no leader (an election), or JetStream is not ready
    ServerError,  # 5xx
    NoStreamResponseError,  # a publish no stream answered: the stream's leader is being elected
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,  # no answer: a request in flight to a node that went away
    TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.errors.SlowConsumerError,
    ConnectionError,
)
"""nats-py failures that pass: another try, after a pause, can succeed."""


def is_retryable(exc: BaseException) -> bool:
    """Whether another try of the operation that raised ``exc`` can succeed (a ``BusError`` says so itself).

    Passing: the types of ``_PASSING`` and any JetStream API error of status 5xx or without one. Not passing: 4xx
    refusals (bad request, not found, a wrong last sequence), a closed or draining connection (this process is
    stopping), an authorization violation, and anything that is not a NATS failure."""
    if isinstance(exc, BusError):
        return exc.retryable
    if isinstance(exc, _PASSING):
        return True
    if isinstance(exc, BadRequestError | NotFoundError):  # whatever their code says (unset when built bare)
        return False
    if isinstance(exc, APIError):
        code = getattr(exc, "code", None)  # unset on an APIError built without arguments
        return code is None or int(code) >= 500
    return False


NATS_FAILURES: tuple[type[BaseException], ...] = (
    nats.errors.Error, nats.js.errors.Error, TimeoutError, ConnectionError)
"""What nats-py raises when an operation fails (its errors, a timeout, a dropped socket); anything else raised
around it is a bug of the caller's. ``except NATS_FAILURES as exc: raise as_bus_error(exc, what) from exc``."""


def as_bus_error(exc: BaseException, what: str) -> BusError:
    """``exc`` (raised by nats-py while doing ``what``) as a ``BusError`` saying whether a retry can help."""
    if isinstance(exc, BusError):
        return exc
    detail = str(exc) or "no detail"
    return BusError(f"{what} failed: {type(exc).__name__}: {detail}", retryable=is_retryable(exc))


@contextlib.contextmanager
def bus_errors(what: str) -> Iterator[None]:
    """Raise the nats-py failures of the block as ``BusError`` (``as_bus_error``); other exceptions pass as they
    are. ``with bus_errors("read the work consumer"): info = await js.consumer_info(...)``."""
    try:
        yield
    except BusError:
        raise
    except NATS_FAILURES as exc:
        raise as_bus_error(exc, what) from exc


_AFFORDABLE: tuple[type[BaseException], ...] = (*NATS_FAILURES, BusError)
"""What ``best_effort`` drops: a NATS failure, raw or already a ``BusError`` of the kit."""


@contextlib.contextmanager
def best_effort(what: str) -> Iterator[None]:
    """A NATS operation whose loss the caller can afford (a lost ack is a redelivery, which is idempotent; a lost
    unsubscribe goes with the connection): its failure is logged at debug and dropped. A bug (any other exception)
    is raised. ``with best_effort("nak a handed-back item"): await msg.nak()``."""
    try:
        yield
    except _AFFORDABLE as exc:
        log.debug("nats.best_effort_failed", what=what, error=f"{type(exc).__name__}: {exc}")


async def retrying(op: Callable[[], Awaitable[_T]], what: str, retry_for_s: float = RETRY_FOR_S) -> _T:
    """Run ``op`` (idempotent: a publish with a ``Nats-Msg-Id``, an ack) until it succeeds, fails for good, or
    ``retry_for_s`` passed since the first try; a passing failure is retried after a pause of 0.1 s doubling to
    2 s. Raises ``BusError`` (retryable when the last failure was passing)."""
    deadline = time.monotonic() + retry_for_s
    backoff = Backoff(_RETRY_BASE_S, _RETRY_CAP_S, jitter=0.5)
    while True:
        try:
            with bus_errors(what):
                return await op()
        except BusError as exc:
            pause = backoff.delay()
            if not exc.retryable or time.monotonic() + pause > deadline:
                raise
            log.info("nats.retry", what=what, tries=backoff.retries, pause_s=round(pause, 3), error=str(exc))
            await asyncio.sleep(pause)


async def settled(op: Callable[[], Awaitable[_T]], what: str, retry_for_s: float = RETRY_FOR_S) -> _T:
    """Run ``op`` (an idempotent JetStream API request: create a stream, read a bucket) until it answers, retrying a
    passing failure as ``retrying`` does: at a cluster's start its nodes answer late while they create every
    service's replicated streams at once. A refusal is raised as nats-py raised it (the caller tells an existing
    stream by its ``BadRequestError``); the last passing failure, once ``retry_for_s`` is spent, as ``BusError``."""
    deadline = time.monotonic() + retry_for_s
    backoff = Backoff(_RETRY_BASE_S, _RETRY_CAP_S, jitter=0.5)
    while True:
        try:
            return await op()
        except NATS_FAILURES as exc:
            if not is_retryable(exc):
                raise
            pause = backoff.delay()
            if time.monotonic() + pause > deadline:
                raise as_bus_error(exc, what) from exc
            log.info("nats.retry", what=what, tries=backoff.retries, pause_s=round(pause, 3), error=str(exc))
            await asyncio.sleep(pause)


async def bucket(js: JetStreamContext, name: str, retry_for_s: float = RETRY_FOR_S) -> KeyValue:
    """The KV bucket ``name``, read with ``settled`` (``BucketNotFoundError`` when it does not exist)."""
    return await settled(lambda: js.key_value(name), f"read the bucket {name}", retry_for_s)


def _tls_context(security: NatsSecurity) -> ssl.SSLContext | None:
    """A client TLS context verifying the server with ``tls_ca`` (and presenting ``tls_cert`` when set)."""
    if not security.tls_ca:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=security.tls_ca)
    if security.tls_cert:
        ctx.load_cert_chain(security.tls_cert, security.tls_key or None)
    return ctx


async def connect(url: str, *, name: str, connect_timeout_s: float = 2.0, initial_wait_s: float = 30.0,
                  security: NatsSecurity | None = None) -> NATS:
    """Connect to NATS, retrying the first connection for ``initial_wait_s``, then reconnecting forever.

    nats-py's defaults take minutes to report a dead server; here a dead URL fails after ``initial_wait_s``
    with a ``BusError`` naming it. ``security`` (default: the ``ROLLOUT_NATS_USER`` / ``ROLLOUT_NATS_PASSWORD``
    / ``ROLLOUT_NATS_TLS_*`` settings) gives the user, whose replies come on its own inbox prefix (the
    permissions of shared/nats_auth.py allow no other), and the TLS files. A refused login is not retried.
    """
    if security is None:
        from rollout_ledger.shared.kit.settings import BaseServiceSettings

        security = BaseServiceSettings().nats_security()
    servers = [s.strip() for s in url.split(",") if s.strip()]
    options: dict[str, Any] = {}
    if security.user:
        options.update(user=security.user, password=security.password, inbox_prefix=inbox_prefix(security.user))
    tls = _tls_context(security)
    if tls is not None:
        options.update(tls=tls, tls_handshake_first=False)
    refused: list[Exception] = []
    connected = False

    async def _on_error(exc: Exception) -> None:
        log.warning("nats.error", error=str(exc))
        if not connected and _is_auth_refusal(exc):
            refused.append(exc)
            attempt.cancel()

    # nats-py retries a first connection forever (max_reconnect_attempts=-1): bounded here, and ended at the
    # first refused login (wrong or missing credentials do not become right by waiting).
    attempt = asyncio.ensure_future(nats.connect(
        servers=servers,
        name=name,
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=_on_error,
        pending_size=64 * 1024 * 1024,
        **options,
    ))
    try:
        nc = await asyncio.wait_for(attempt, timeout=initial_wait_s)
    except (asyncio.CancelledError, TimeoutError) as exc:
        if refused:
            raise BusError(f"NATS at {url} refused the login of user {security.user or '(anonymous)'}: "
                           f"{refused[0]}", retryable=False) from exc
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise BusError(f"cannot connect to NATS at {url} within {initial_wait_s}s", retryable=True) from exc
    except Exception as exc:  # nats-py raises several unrelated types here
        raise BusError(f"cannot connect to NATS at {url}: {exc}", retryable=True) from exc
    connected = True
    return nc


def _is_auth_refusal(exc: Exception) -> bool:
    """The server refused the credentials (or their absence): another try cannot succeed."""
    return "authorization violation" in str(exc).lower()


def stream_config(spec: StreamSpec, replicas: int = 1) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=js_api.RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue" else js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        max_age=spec.max_age_s,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
        num_replicas=replicas,
    )


def work_consumer_spec(ack_wait_s: float, max_deliver: int, max_ack_pending: int,
                       route: str | None = None) -> ConsumerSpec:
    """The consumer of one route's work items (``route`` None: the legacy consumer of the previous release's single
    subject), shared by every env worker with the route: redelivered after ``ack_wait_s`` without progress,
    ``max_deliver`` tries."""
    if route is None:
        durable, subject, what = WORK_CONSUMER, WORK_SUBJECT, "items a previous release queued on the single subject"
    else:
        durable, subject, what = work_consumer(route), work_subject(route), f"route {route!r}"
    return ConsumerSpec(
        stream=WORK_STREAM,
        durable=durable,
        filter_subject=subject,
        ack_wait_s=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        description=f"env workers pull episodes of {what}; ack after the terminal event is stored on the bus",
    )


def recorder_consumer_spec(ack_wait_s: float, max_ack_pending: int) -> ConsumerSpec:
    """The recorder's consumer: unlimited redelivery (nothing is dropped while Postgres is down)."""
    return ConsumerSpec(
        stream=EVENTS_STREAM,
        durable=RECORDER_CONSUMER,
        filter_subject=event_subject(">"),
        ack_wait_s=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
        description="recorder writes events to Postgres; ack after commit",
    )


def consumer_config(spec: ConsumerSpec) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(
        durable_name=spec.durable,
        description=spec.description,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        filter_subject=spec.filter_subject,
        backoff=list(spec.backoff_s) or None,
    )


def stream_replicas(replicas: int | None) -> int:
    """``replicas`` or, when None, ``ROLLOUT_STREAM_REPLICAS`` (services pass their own ``settings.stream_replicas``;
    the fallback serves scripts and tests that call without settings)."""
    if replicas is not None:
        return replicas
    from rollout_ledger.shared.kit.settings import BaseServiceSettings

    return BaseServiceSettings().stream_replicas


async def ensure_streams(js: JetStreamContext, max_msg_size: int | None = None, replicas: int | None = None) -> None:
    """Create or update every stream of the contract (idempotent; safe from every service at start; a service
    whose NATS user may not update streams leaves a changed configuration to the scheduler).

    ``replicas`` (default: ``ROLLOUT_STREAM_REPLICAS``) is 1 on one NATS server and 3 on a JetStream cluster.
    """
    num_replicas = stream_replicas(replicas)
    for spec in STREAMS:
        if max_msg_size is not None:
            spec = replace(spec, max_msg_size=max_msg_size)
        cfg = stream_config(spec, num_replicas)
        try:
            await settled(functools.partial(js.add_stream, cfg), f"create the stream {spec.name}")
        except BadRequestError:
            try:
                await js.update_stream(cfg)
            except nats.errors.TimeoutError as exc:
                # No answer: on a server with authorization only the scheduler's user may update a stream (the
                # others are refused, which nats-py sees as a timeout); the scheduler applies it at its start.
                log.warning("nats.stream_not_updated", stream=spec.name, error=str(exc) or "no answer",
                            hint="only the scheduler's NATS user may change a stream's configuration")


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> None:
    """Create the durable consumer, or update it to ``spec`` when it exists."""
    cfg = consumer_config(spec)
    try:
        # The server's consumer-create is create-or-update for a durable whose changes are compatible.
        await settled(lambda: js.add_consumer(spec.stream, cfg), f"create the consumer {spec.durable}")
    except BadRequestError as exc:
        log.warning("nats.consumer_not_updated", consumer=spec.durable, stream=spec.stream, error=str(exc))


async def ensure_buckets(js: JetStreamContext, replicas: int | None = None) -> None:
    """Create every KV bucket of the contract; an existing bucket of another replica count (made on one server,
    before the move to a cluster) has its stream scaled to ``replicas``."""
    num_replicas = stream_replicas(replicas)
    for name in BUCKETS:
        try:
            await bucket(js, name)
        except NotFoundError:
            kv_cfg = js_api.KeyValueConfig(bucket=name, history=BUCKET_HISTORY.get(name, 1),
                                           replicas=num_replicas, ttl=BUCKET_TTL_S.get(name))
            with contextlib.suppress(BadRequestError):
                await settled(functools.partial(js.create_key_value, kv_cfg), f"create the bucket {name}")
            continue
        info = await settled(functools.partial(js.stream_info, f"KV_{name}"), f"read the bucket {name}")
        if (info.config.num_replicas or 1) != num_replicas:
            try:
                await js.update_stream(replace(info.config, num_replicas=num_replicas))
            except nats.errors.TimeoutError as exc:  # as in ensure_streams: only the scheduler's user may
                log.warning("nats.stream_not_updated", stream=f"KV_{name}", error=str(exc) or "no answer",
                            hint="only the scheduler's NATS user may change a stream's configuration")


async def ensure_topology(js: JetStreamContext, replicas: int | None = None) -> None:
    """Streams and buckets of the contract (consumers are declared by the services that own them).

    ``replicas`` defaults to ``ROLLOUT_STREAM_REPLICAS`` (see ``ensure_streams``).
    """
    num_replicas = stream_replicas(replicas)
    await ensure_streams(js, replicas=num_replicas)
    await ensure_buckets(js, num_replicas)


async def fetch(
    psub: JetStreamContext.PullSubscription,
    batch: int,
    timeout: float,  # noqa: ASYNC109 - the pull request's expiry inside nats-py
) -> list[Msg]:
    """Fetch up to ``batch`` messages, waiting at most ``timeout``; an empty list on timeout. Any other failure is a
    ``BusError``: retryable while the consumer's stream elects a leader (503) or the client reconnects, so the
    caller's loop backs off and fetches again (the pull subscription stays bound: after an election the same
    durable consumer answers)."""
    try:
        return await psub.fetch(batch, timeout=timeout)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    except (nats.errors.Error, nats.js.errors.Error, ConnectionError) as exc:
        raise as_bus_error(exc, "fetch") from exc


async def ack_sync(msg: Msg, timeout: float = 10.0,  # noqa: ASYNC109 - nats-py's per-request ack timeout
                   retry_for_s: float = RETRY_FOR_S) -> None:
    """Ack ``msg`` and wait for the server's confirmation, trying again through an election (a repeated ack of an
    acked message is confirmed too); ``BusError`` when it cannot be confirmed."""
    await retrying(lambda: _ack_sync(msg, timeout), "ack", retry_for_s)


ACK_RECONNECT_LOOK_S = 0.25
"""While an ack waits for its confirmation, how often the client's reconnect count is looked at."""


async def _ack_sync(msg: Msg, timeout: float) -> None:  # noqa: ASYNC109 - see ack_sync
    """One try. When the client reconnects meanwhile (the node that had the ack, or would have sent its
    confirmation, is gone) the try ends at once as a passing failure, and ``ack_sync`` sends the ack again, instead
    of waiting out ``timeout`` for a confirmation that cannot come."""
    nc = getattr(msg, "_client", None)
    before = int(nc.stats.get("reconnects", 0)) if nc is not None else 0
    confirm = asyncio.ensure_future(msg.ack_sync(timeout=timeout))
    try:
        while True:
            done, _ = await asyncio.wait({confirm}, timeout=ACK_RECONNECT_LOOK_S)
            if done:
                confirm.result()
                return
            if nc is not None and int(nc.stats.get("reconnects", 0)) != before:
                raise BusError("the connection was re-established before the ack's confirmation", retryable=True)
    finally:
        if not confirm.done():
            confirm.cancel()
            with contextlib.suppress(asyncio.CancelledError, *NATS_FAILURES):
                await confirm


@contextlib.asynccontextmanager
async def keep_in_progress(msgs: Msg | Sequence[Msg], interval_s: float) -> AsyncIterator[None]:
    """Tell JetStream the message(s) are still being worked on every ``interval_s`` while the block runs."""
    batch = [msgs] if isinstance(msgs, Msg) else list(msgs)

    async def _tick() -> None:
        while True:
            await asyncio.sleep(interval_s)
            for msg in batch:
                with best_effort("tell JetStream a message is in progress"):  # a lost ping risks a redelivery
                    await msg.in_progress()

    task = asyncio.create_task(_tick())
    try:
        yield
    finally:
        await cancel_and_wait(task)


def delivery_attempt(msg: Msg) -> int:
    """1 on the first delivery, n on the n-th redelivery."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1


async def close(nc: NATS | None) -> None:
    if nc is None or nc.is_closed:
        return
    with best_effort("drain the connection"):
        await asyncio.wait_for(nc.drain(), timeout=5)
    with best_effort("close the connection"):
        await nc.close()


__all__ = [
    "NATS",
    "NATS_FAILURES",
    "JetStreamContext",
    "Msg",
    "NatsSecurity",
    "ack_sync",
    "as_bus_error",
    "best_effort",
    "bucket",
    "bus_errors",
    "connect",
    "delivery_attempt",
    "ensure_consumer",
    "ensure_topology",
    "fetch",
    "is_retryable",
    "keep_in_progress",
    "recorder_consumer_spec",
    "retrying",
    "settled",
    "work_consumer_spec",
]
