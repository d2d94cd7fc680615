"""Tracing: one OpenTelemetry tracer per service from its settings, W3C trace context in NATS message headers, spans.

Design note. One episode is one trace. The scheduler's publish of an episode's work item is the trace's root; the
env worker continues it from the work item's headers (a span per attempt, a child per turn and per env step); the
inference worker's generation span is a child of the turn, its context carried in the request's headers; every
event on RL_EVENTS carries the context of the span that published it, and the recorder's write of the episode's
events joins the trace from there. ``traceparent`` / ``tracestate`` (https://www.w3.org/TR/trace-context/) ride
beside ``Nats-Msg-Id`` in the NATS headers, so a redelivery, a hand-back or a retry keeps the trace.

Tracing is off unless an OTLP/HTTP endpoint is configured (``ROLLOUT_TRACING_ENDPOINT`` or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``). Off, ``Tracing.off()`` neither extracts, injects nor starts anything: every
helper returns at its first test (docs/tracing.md measures both). On, spans are batched by the SDK's
``BatchSpanProcessor`` and exported from its thread; a collector that is down costs dropped spans, never a turn.

A message's trace headers are input like any other: a missing, oversized or malformed ``traceparent`` is ignored
(the message is handled as if it had none), never an error.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracer,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from rollout_ledger.shared.kit.settings import BaseServiceSettings

TRACEPARENT_HEADER = "traceparent"
"""W3C trace context: version, trace id, parent span id and flags (``00-<32 hex>-<16 hex>-<2 hex>``)."""
TRACESTATE_HEADER = "tracestate"
"""W3C vendor-specific trace state, passed on as it came."""

_MAX_TRACEPARENT = 128
"""A ``traceparent`` longer than this is not one (a version-00 value is 55 characters): ignored unparsed."""
_MAX_TRACESTATE = 512
"""W3C allows 32 list members; a longer ``tracestate`` is dropped (the ``traceparent`` is still used)."""

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
"""W3C ``traceparent``: version, trace id, parent id, flags; a later version may append fields (version 00 not)."""
_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()
"""What ``Tracing.span`` returns when there is nothing to record (stateless, so one serves every caller)."""


_H = TypeVar("_H", bound=MutableMapping[str, str])

INSTRUMENTATION = "rollout_ledger"
"""Name of the tracer (the instrumentation scope of every span)."""


class _Attached:
    """Makes an (unsampled) remote context current for a block, so that what the block publishes carries it on."""

    __slots__ = ("context", "token")

    def __init__(self, context: Context) -> None:
        self.context = context

    def __enter__(self) -> None:
        self.token = context_api.attach(self.context)

    def __exit__(self, *exc: object) -> None:
        context_api.detach(self.token)


class Tracing:
    """A service's tracer and the helpers that carry its context over NATS; ``enabled`` False: all no-ops."""

    def __init__(self, tracer: Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self.provider = provider
        """The SDK provider that exports (None: nothing to flush)."""
        self.enabled = provider is not None

    @classmethod
    def off(cls) -> Tracing:
        """Tracing that does nothing (the default of every component that takes a ``Tracing``)."""
        return cls(NoOpTracer())

    @classmethod
    def with_exporter(cls, service: str, exporter: SpanExporter, *, instance: str = "", sample_ratio: float = 1.0,
                      batch: bool = True) -> Tracing:
        """Tracing of ``service`` into ``exporter`` (batched in the SDK's export thread unless ``batch`` is False)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attributes = {"service.name": service, "service.namespace": "rollout-ledger"}
        if instance:
            attributes["service.instance.id"] = instance
        provider = TracerProvider(resource=Resource.create(attributes),
                                  sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider.get_tracer(INSTRUMENTATION), provider)

    # --- context over NATS ------------------------------------------------------------------------------
    def inject(self, headers: _H, span: Span | None = None) -> _H:
        """Write the trace context of ``span`` (default: the current span) into ``headers`` (kept: ``Nats-Msg-Id``
        and the rest) and return them; nothing is written when tracing is off or there is no span."""
        if self.enabled:
            span_ctx = (span if span is not None else trace.get_current_span()).get_span_context()
            if span_ctx.is_valid:
                headers[TRACEPARENT_HEADER] = \
                    f"00-{span_ctx.trace_id:032x}-{span_ctx.span_id:016x}-{int(span_ctx.trace_flags):02x}"
                if span_ctx.trace_state:
                    headers[TRACESTATE_HEADER] = span_ctx.trace_state.to_header()
        return headers

    def extract(self, headers: Mapping[str, str] | None) -> Context | None:
        """The trace context a message's headers carry; None when tracing is off, or the headers carry none or
        a malformed one (the message is then handled as if it had no headers)."""
        if not self.enabled or not headers:
            return None
        return context_from_headers(headers)

    # --- spans ------------------------------------------------------------------------------------------
    def span(self, name: str, *, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
             attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Span | None]:
        """A span made current for the ``with`` block (a child of the current span, or of ``parent``: an extracted
        context, or an empty ``Context()`` for a new trace); when tracing is off, a shared no-op context manager.
        An exception leaving the block is recorded on the span and sets its status to error.

        Within a trace not sampled (``tracing_sample_ratio``) no span is made, at a fraction of a span's cost: the
        parent stays current, so what the block publishes carries the unsampled context on and downstream services
        make none either."""
        if not self.enabled:
            return _OFF
        above = trace.get_current_span(parent).get_span_context()
        if above.is_valid and not above.trace_flags.sampled:
            return _OFF if parent is None else _Attached(parent)
        return self.tracer.start_as_current_span(name, context=parent, kind=kind,
                                                 attributes=dict(attributes) if attributes else None)

    def root(self, name: str, *, kind: SpanKind = SpanKind.PRODUCER,
             attributes: Mapping[str, Any] | None = None) -> Span | None:
        """Start the root span of a new trace, not made current (the caller ends it); None when tracing is off."""
        if not self.enabled:
            return None
        return self.tracer.start_span(name, context=Context(), kind=kind,
                                      attributes=dict(attributes) if attributes else None)

    def record(self, name: str, *, parent: Context, start_ns: int, end_ns: int | None = None,
               kind: SpanKind = SpanKind.CONSUMER, attributes: Mapping[str, Any] | None = None,
               error: str | None = None) -> None:
        """A span of work already done (from ``start_ns``, ended now or at ``end_ns``), a child of ``parent``: what
        joins a message's trace to a batch's work; nothing when tracing is off."""
        if not self.enabled or not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
            return
        span = self.tracer.start_span(name, context=parent, kind=kind, start_time=start_ns,
                                      attributes=dict(attributes) if attributes else None)
        end_span(span, error, end_ns)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is buffered (at most ``timeout_s``) and stop the export thread (a process's last step)."""
        if self.provider is not None:
            with contextlib.suppress(Exception):  # an unreachable collector must not fail a clean stop
                self.provider.force_flush(int(timeout_s * 1000))
            with contextlib.suppress(Exception):
                self.provider.shutdown()


def end_span(span: Span, error: str | None = None, end_time_ns: int | None = None) -> None:
    """End ``span``, its status an error with the message ``error`` when one is given."""
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_time_ns)


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The remote span context in ``headers`` as a parent ``Context``; None for none, an oversized or malformed one
    (parsed as W3C Trace Context level 1 says: lower-case hex, no all-zero id, version ``ff`` invalid, version
    ``00`` without further fields)."""
    try:
        value = headers.get(TRACEPARENT_HEADER)
        if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT:
            return None
        match = _TRACEPARENT.fullmatch(value)
        if match is None:
            return None
        version, trace_hex, span_hex, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest):
            return None
        trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
        if not trace_id or not span_id:
            return None
        state = headers.get(TRACESTATE_HEADER)
        trace_state = TraceState.from_header([state]) if isinstance(state, str) and state \
            and len(state) <= _MAX_TRACESTATE else None
        span_ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(flags, 16)),
                               trace_state=trace_state)
    except Exception:  # hostile input: whatever the parse chokes on is no trace context
        return None
    return trace.set_span_in_context(NonRecordingSpan(span_ctx))


def trace_id_of(context: Context | None, sampled_only: bool = False) -> str | None:
    """The 32-hex trace id of ``context`` (of the current span when None); None without a valid span (or, with
    ``sampled_only``, a span of a trace not sampled)."""
    span_ctx = trace.get_current_span(context).get_span_context()
    if not span_ctx.is_valid or (sampled_only and not span_ctx.trace_flags.sampled):
        return None
    return format(span_ctx.trace_id, "032x")


def add_trace_ids(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: ``trace_id`` and ``span_id`` of the current span on every line logged inside one."""
    span_ctx = trace.get_current_span().get_span_context()
    if span_ctx.is_valid:
        event.setdefault("trace_id", format(span_ctx.trace_id, "032x"))
        event.setdefault("span_id", format(span_ctx.span_id, "016x"))
    return event


def traces_endpoint(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base ``endpoint`` (``http://collector:4318`` ->
    ``http://collector:4318/v1/traces``); a URL that names the path already is kept."""
    endpoint = endpoint.strip()
    if endpoint.rstrip("/").endswith("/v1/traces"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


def setup_tracing(settings: BaseServiceSettings, service: str) -> Tracing:
    """The service's ``Tracing`` from its settings: off without ``tracing_endpoint``; else OTLP/HTTP (protobuf) to
    it, batched, ``service.name`` = ``service``, a ratio of traces sampled at their root (``tracing_sample_ratio``)
    and followed downstream. The caller calls ``shutdown`` when the process stops."""
    if not settings.tracing_endpoint:
        return Tracing.off()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=traces_endpoint(settings.tracing_endpoint),
                                timeout=settings.tracing_export_timeout_s)
    return Tracing.with_exporter(service, exporter, instance=settings.worker_id,
                                 sample_ratio=settings.tracing_sample_ratio)


__all__ = [
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
    "Context",
    "Span",
    "SpanKind",
    "Tracing",
    "add_trace_ids",
    "context_from_headers",
    "end_span",
    "setup_tracing",
    "trace_id_of",
    "traces_endpoint",
]
