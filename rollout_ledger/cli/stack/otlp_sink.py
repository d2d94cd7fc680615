"""A local OTLP/HTTP trace receiver: what tests and benchmarks point ``ROLLOUT_TRACING_ENDPOINT`` at to see the spans
the services export, without a collector.

It answers ``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``, plain, gzip or deflate) on a loopback port
from a thread of its own and keeps every span as a ``SpanRecord`` (ids in hex, the service from the resource);
``GET /stats`` answers how many it holds. It is no collector: nothing is forwarded, kept on disk or bounded beyond
``max_spans``. ``python -m rollout_ledger.cli.stack.otlp_sink`` runs one in a process of its own (its endpoint on
the first line of stdout) until stdin closes: a benchmark's receiver whose CPU is not the benchmark's.
"""

from __future__ import annotations

import gzip
import json
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class SpanRecord:
    """One received span."""

    trace_id: str
    """32 hex digits."""
    span_id: str
    """16 hex digits."""
    parent_span_id: str
    """16 hex digits; empty for a trace's root."""
    name: str
    service: str
    """The resource's ``service.name``."""
    kind: str
    """``SPAN_KIND_SERVER``, ``SPAN_KIND_CONSUMER``, ..."""
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def decode_spans(body: bytes) -> list[SpanRecord]:
    """The spans of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(SpanRecord(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                    name=span.name, service=service, kind=Span.SpanKind.Name(span.kind),
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                    error=span.status.code == Status.STATUS_CODE_ERROR,
                    attributes={kv.key: _value(kv.value) for kv in span.attributes}))
    return out


class OtlpSink:
    """Receives spans on ``http://127.0.0.1:<port>`` until stopped (a context manager)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_spans: int = 5_000_000) -> None:
        self.max_spans = max_spans
        self._spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self.requests = 0
        """Export requests received (a malformed one included)."""
        self.rejected = 0
        """Requests answered 400 (not a decodable ``ExportTraceServiceRequest``)."""
        self.received = 0
        """Spans received (kept or not)."""
        sink = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"spans": sink.received, "requests": sink.requests,
                                   "rejected": sink.rejected}).encode()
                self.send_response(200 if self.path.rstrip("/") == "/stats" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    spans = decode_spans(body) if self.path.rstrip("/") == TRACES_PATH else None
                except Exception:  # not OTLP: answered 400, as a collector would
                    spans = None
                sink._received(spans)
                if spans is None:
                    self.send_response(400 if self.path.rstrip("/") == TRACES_PATH else 404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return  # quiet: one line per export would drown the test's output

        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)

    def _received(self, spans: list[SpanRecord] | None) -> None:
        with self._lock:
            self.requests += 1
            if spans is None:
                self.rejected += 1
                return
            self.received += len(spans)
            room = self.max_spans - len(self._spans)
            self._spans.extend(spans[:max(0, room)])

    @property
    def endpoint(self) -> str:
        """The base URL to give ``ROLLOUT_TRACING_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def spans(self) -> list[SpanRecord]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def traces(self) -> dict[str, list[SpanRecord]]:
        """Spans received so far, by trace id."""
        out: dict[str, list[SpanRecord]] = {}
        for span in self.spans():
            out.setdefault(span.trace_id, []).append(span)
        return out

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def start(self) -> OtlpSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[SpanRecord]:
        return iter(self.spans())


def main() -> None:
    """Serve on a free loopback port (printed) until stdin closes, keeping counts only."""
    with OtlpSink(max_spans=0) as sink:
        print(sink.endpoint, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
