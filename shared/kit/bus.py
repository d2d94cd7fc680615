"""Bus helpers: connect with bounded timeouts, declare streams and consumers, publish with dedupe ids, fetch.

Ack policies are declared as data (``ConsumerSpec`` in subjects.py plus the per-service settings that
size them); the loops that apply them live in the services.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, NotFoundError

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import EventBase, encode
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.settings import NatsSecurity
from rollout_ledger.shared.kit.tracing import Tracing
from rollout_ledger.shared.nats_auth import inbox_prefix
from rollout_ledger.shared.subjects import (
    BUCKET_HISTORY,
    BUCKET_TTL_S,
    BUCKETS,
    EVENTS_STREAM,
    MSG_ID_HEADER,
    PARKED_HEADER,
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
            await js.add_stream(cfg)
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
        await js.add_consumer(spec.stream, cfg)
    except BadRequestError as exc:
        log.warning("nats.consumer_not_updated", consumer=spec.durable, stream=spec.stream, error=str(exc))


async def ensure_buckets(js: JetStreamContext, replicas: int | None = None) -> None:
    num_replicas = stream_replicas(replicas)
    for bucket in BUCKETS:
        try:
            await js.key_value(bucket)
        except NotFoundError:
            with contextlib.suppress(BadRequestError):
                await js.create_key_value(js_api.KeyValueConfig(
                    bucket=bucket, history=BUCKET_HISTORY.get(bucket, 1), replicas=num_replicas,
                    ttl=BUCKET_TTL_S.get(bucket)))


async def ensure_topology(js: JetStreamContext, replicas: int | None = None) -> None:
    """Streams and buckets of the contract (consumers are declared by the services that own them).

    ``replicas`` defaults to ``ROLLOUT_STREAM_REPLICAS`` (see ``ensure_streams``).
    """
    num_replicas = stream_replicas(replicas)
    await ensure_streams(js, replicas=num_replicas)
    await ensure_buckets(js, num_replicas)


def msg_id_headers(event_id: str) -> dict[str, str]:
    return {MSG_ID_HEADER: event_id}


async def publish_event(
    js: JetStreamContext,
    event: EventBase,
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - nats-py's per-request publish timeout
    route: str | None = None,
    tracing: Tracing | None = None,
) -> js_api.PubAck:
    """Publish one event to its subject with its ``event_id`` as ``Nats-Msg-Id``; await the stream's ack. A work
    item (``episode.requested``) goes to its env's ``route`` (``work_subject``); without one, to the legacy
    subject every env worker pulls. With ``tracing`` on, the headers carry the current span's trace context."""
    event_type = str(event.type)
    if event_type == "episode.requested":
        subject = work_subject(route) if route is not None else WORK_SUBJECT
    else:
        subject = event_subject(event_type)
    try:
        headers = msg_id_headers(str(event.event_id))
        if tracing is not None:
            tracing.inject(headers)
        return await js.publish(subject, encode(event), timeout=timeout, headers=headers)
    except Exception as exc:
        raise BusError(f"publish of {event_type} failed: {exc}") from exc


async def fetch(
    psub: JetStreamContext.PullSubscription,
    batch: int,
    timeout: float,  # noqa: ASYNC109 - the pull request's expiry inside nats-py
) -> list[Msg]:
    """Fetch up to ``batch`` messages, waiting at most ``timeout``; an empty list on timeout."""
    try:
        return await psub.fetch(batch, timeout=timeout)
    except (TimeoutError, nats.errors.TimeoutError):
        return []


@contextlib.asynccontextmanager
async def keep_in_progress(msgs: Msg | Sequence[Msg], interval_s: float) -> AsyncIterator[None]:
    """Tell JetStream the message(s) are still being worked on every ``interval_s`` while the block runs."""
    batch = [msgs] if isinstance(msgs, Msg) else list(msgs)

    async def _tick() -> None:
        while True:
            await asyncio.sleep(interval_s)
            for msg in batch:
                with contextlib.suppress(Exception):  # a lost ping only risks a redelivery, never a loss
                    await msg.in_progress()

    task = asyncio.create_task(_tick())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def hand_back(js: JetStreamContext, msg: Msg, delay_s: float, timeout_s: float = 10.0) -> None:
    """Put a work item this worker cannot run (a newer contract major, or an env it lacks: an item of the legacy
    subject or of a family member it does not have) back on the queue for another worker, on the same subject,
    without spending its deliveries: after ``delay_s`` (reporting progress meanwhile, so it is not redelivered
    here), republish the same bytes as a new message and ack this one. A nak would count a delivery, and after
    ``max_deliver`` of them the episode would fail during a rolling upgrade. If the republish fails the item is
    nak'ed (one delivery spent) and ``BusError`` raised."""
    headers = dict(msg.headers or {})
    try:
        parked = int(headers.get(PARKED_HEADER) or 0) + 1
    except ValueError:  # a header we did not write: count from here
        parked = 1
    original_id = headers.get(MSG_ID_HEADER) or f"{msg.subject}:{msg.metadata.sequence.stream}"
    headers[PARKED_HEADER] = str(parked)
    headers[MSG_ID_HEADER] = f"{original_id.split(':parked', 1)[0]}:parked{parked}"
    async with keep_in_progress(msg, max(0.5, delay_s / 3)):
        await asyncio.sleep(delay_s)
    try:
        await js.publish(msg.subject, msg.data, timeout=timeout_s, headers=headers)
    except Exception as exc:
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay_s)
        raise BusError(f"hand-back of a work item failed: {exc}") from exc
    await msg.ack_sync(timeout=timeout_s)


def delivery_attempt(msg: Msg) -> int:
    """1 on the first delivery, n on the n-th redelivery."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1


async def close(nc: NATS | None) -> None:
    if nc is None or nc.is_closed:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), timeout=5)
    with contextlib.suppress(Exception):
        await nc.close()


__all__ = [
    "NATS",
    "JetStreamContext",
    "Msg",
    "NatsSecurity",
    "connect",
    "delivery_attempt",
    "ensure_consumer",
    "ensure_topology",
    "fetch",
    "keep_in_progress",
    "publish_event",
    "recorder_consumer_spec",
    "work_consumer_spec",
]
