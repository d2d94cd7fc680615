"""Trace context in NATS headers (rollout_ledger/shared/kit/tracing.py) and the recorder's spans per batch
(recorder/traces.py).

Spans go to the SDK's in-memory exporter (the real SDK, synchronous export); messages are real ``nats.aio.msg.Msg``
objects with the headers a producer would have sent, hostile ones included.
"""

from __future__ import annotations

import pytest
import structlog
from nats.aio.msg import Msg
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rollout_ledger.cli.stack.otlp_sink import OtlpSink
from rollout_ledger.services.recorder.recording import Action, BatchOutcome, Delivery
from rollout_ledger.services.recorder.traces import BatchTraces
from rollout_ledger.shared.events import EpisodeStarted, StepCompleted
from rollout_ledger.shared.kit.settings import BaseServiceSettings
from rollout_ledger.shared.kit.tracing import (
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    Tracing,
    add_trace_ids,
    setup_tracing,
    trace_id_of,
    traces_endpoint,
)
from rollout_ledger.shared.subjects import MSG_ID_HEADER

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(spans: InMemorySpanExporter) -> Tracing:
    return Tracing.with_exporter("test-service", spans, instance="w-1", batch=False)


def _msg(headers: dict[str, str] | None, data: bytes = b"x") -> Msg:
    return Msg(_client=None, subject="rl.events.step.completed", data=data, headers=headers)  # type: ignore[arg-type]


def test_off_is_inert() -> None:
    off = Tracing.off()
    headers = {MSG_ID_HEADER: "ep:a1:s0"}
    assert off.inject(headers) is headers and headers == {MSG_ID_HEADER: "ep:a1:s0"}
    assert off.extract({TRACEPARENT_HEADER: VALID}) is None
    with off.span("turn") as span:
        assert span is None
        assert off.inject({}) == {}
    assert off.root("episode.publish") is None
    off.record("recorder.write", parent=Context(), start_ns=0)
    off.shutdown()


def test_settings_turn_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("ROLLOUT_TRACING_ENDPOINT", raising=False)
    assert not setup_tracing(BaseServiceSettings(), "scheduler").enabled
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    on = setup_tracing(BaseServiceSettings(), "scheduler")
    try:
        assert on.enabled
        assert on.provider is not None
        assert on.provider.resource.attributes["service.name"] == "scheduler"
    finally:
        on.shutdown(timeout_s=0.1)
    assert traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_endpoint("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_endpoint("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_inject_keeps_msg_id_and_extract_continues_the_trace(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    with tracing.span("turn") as span:
        assert span is not None
        headers = tracing.inject({MSG_ID_HEADER: "ep:a1:t0:r1"})
    ctx = span.get_span_context()
    assert headers[MSG_ID_HEADER] == "ep:a1:t0:r1"
    version, trace_id, span_id, flags = headers[TRACEPARENT_HEADER].split("-")
    assert (version, trace_id, span_id) == ("00", f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    parent = tracing.extract(headers)
    assert parent is not None and trace_id_of(parent) == f"{ctx.trace_id:032x}"
    with tracing.span("generation", parent=parent):
        pass
    turn, generation = spans.get_finished_spans()
    assert generation.context.trace_id == turn.context.trace_id
    assert generation.parent is not None and generation.parent.span_id == turn.context.span_id
    assert generation.parent.is_remote


def test_root_span_starts_a_new_trace_whatever_is_current(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    with tracing.span("http request"):
        root = tracing.root("episode.publish", attributes={"rollout.episode_id": "b.0.0"})
    assert root is not None
    headers = tracing.inject({MSG_ID_HEADER: "b.0.0:requested"}, root)
    root.end()
    request, published = spans.get_finished_spans()
    assert published.parent is None and published.context.trace_id != request.context.trace_id
    assert headers[TRACEPARENT_HEADER].split("-")[2] == f"{published.context.span_id:016x}"


def test_no_span_no_header(tracing: Tracing) -> None:
    assert tracing.inject({MSG_ID_HEADER: "x"}) == {MSG_ID_HEADER: "x"}


@pytest.mark.parametrize("headers", [
    None,
    {},
    {MSG_ID_HEADER: "ep:a1:s0"},
    {TRACEPARENT_HEADER: ""},
    {TRACEPARENT_HEADER: "garbage"},
    {TRACEPARENT_HEADER: "00-00000000000000000000000000000000-b7ad6b7169203331-01"},  # all-zero trace id
    {TRACEPARENT_HEADER: "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"},  # all-zero span id
    {TRACEPARENT_HEADER: "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},  # forbidden version
    {TRACEPARENT_HEADER: "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"},  # upper case
    {TRACEPARENT_HEADER: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"},  # no flags
    {TRACEPARENT_HEADER: VALID + "-" + "a" * 10_000},  # oversized
    {TRACEPARENT_HEADER: "00-\u00e9\u00e9-\x00-01"},
    {TRACEPARENT_HEADER: b"not a str"},
    {"TRACEPARENT": VALID},  # W3C names are lower case; nats-py keeps the case it received
])
def test_missing_or_malformed_context_is_ignored(tracing: Tracing, headers: dict[str, str] | None) -> None:
    assert tracing.extract(headers) is None
    with tracing.span("episode", parent=tracing.extract(headers)) as span:  # a message without one: a new trace
        assert span is not None and span.get_span_context().is_valid


def test_an_oversized_tracestate_is_dropped_not_the_trace(tracing: Tracing) -> None:
    parent = tracing.extract({TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "k=" + "v" * 5000})
    assert trace_id_of(parent) == "0af7651916cd43dd8448eb211c80319c"
    parent = tracing.extract({TRACEPARENT_HEADER: VALID, TRACESTATE_HEADER: "vendor=abc"})
    with tracing.span("episode", parent=parent):
        headers = tracing.inject({})
    assert headers[TRACESTATE_HEADER] == "vendor=abc"  # passed on as it came


def test_log_lines_inside_a_span_carry_its_trace_id(tracing: Tracing) -> None:
    assert "trace_id" not in add_trace_ids(None, "info", {"event": "outside"})
    with tracing.span("episode") as span:
        assert span is not None
        line = add_trace_ids(None, "info", {"event": "inside"})
        with structlog.testing.capture_logs(processors=[add_trace_ids]) as logs:
            structlog.get_logger().info("episode.end")
    assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert line["span_id"] == f"{span.get_span_context().span_id:016x}"
    assert logs[0]["trace_id"] == line["trace_id"]


def _delivery(msg: Msg, event: EpisodeStarted | StepCompleted | None, seq: int) -> Delivery:
    return Delivery(stream_seq=seq, subject=msg.subject, deliveries=1, payload=msg.data,
                    headers=dict(msg.headers) if msg.headers else None, event=event)


def _started(ep: str) -> EpisodeStarted:
    return EpisodeStarted(event_id=f"{ep}:a1:started", episode_id=ep, batch_id="b", attempt=1, seq=0,
                          produced_by="test", env="fixed-turns", worker_id="w", prompt_token_ids=[1, 2, 3],
                          prompt_text="p", messages=[])


def test_the_recorder_joins_each_episodes_trace_once_per_batch(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    parents = {}
    for ep in ("b.0.0", "b.1.0"):
        with tracing.span("episode", attributes={"ep": ep}):
            parents[ep] = tracing.inject({MSG_ID_HEADER: f"{ep}:a1:started"})
    spans.clear()
    msgs = [_msg(parents["b.0.0"]), _msg({MSG_ID_HEADER: "old"}), _msg(parents["b.1.0"]), _msg(parents["b.0.0"]),
            _msg({MSG_ID_HEADER: "hostile", TRACEPARENT_HEADER: "00-zz"}), _msg(None)]
    batch = [_delivery(m, _started(ep) if ep else None, i)
             for i, (m, ep) in enumerate(zip(msgs, ["b.0.0", "", "b.1.0", "b.0.0", "", ""], strict=True))]
    traces = BatchTraces.of(tracing, msgs, start_ns=1)
    assert len(traces.groups) == 2
    traces.record(batch, BatchOutcome(actions=[Action.ACK, Action.ACK, Action.ACK, Action.TERM, Action.TERM,
                                               Action.ACK]))
    written = {str(dict(s.attributes or {})["rollout.episode_id"]): s for s in spans.get_finished_spans()}
    assert set(written) == {"b.0.0", "b.1.0"}
    for ep, span in written.items():
        header = parents[ep][TRACEPARENT_HEADER].split("-")
        assert f"{span.context.trace_id:032x}" == header[1]
        assert span.parent is not None and f"{span.parent.span_id:016x}" == header[2]
        assert span.name == "recorder.write" and span.start_time == 1
    assert dict(written["b.0.0"].attributes or {})["rollout.events"] == 2
    assert written["b.1.0"].status.status_code.name == "UNSET"
    assert written["b.0.0"].status.status_code.name == "ERROR"  # one of its events was dead-lettered
    assert BatchTraces.of(Tracing.off(), msgs, start_ns=1).groups == {}


def test_the_sink_decodes_what_the_sdk_exports() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    with OtlpSink() as sink:
        tracing = Tracing.with_exporter("svc", OTLPSpanExporter(endpoint=traces_endpoint(sink.endpoint)),
                                        batch=False)
        with tracing.span("episode", attributes={"rollout.episode_id": "b.0.0"}), tracing.span("turn"):
            pass
        tracing.shutdown()
        got = {s.name: s for s in sink.spans()}
    assert set(got) == {"episode", "turn"}
    assert got["turn"].parent_span_id == got["episode"].span_id and got["episode"].parent_span_id == ""
    assert got["turn"].trace_id == got["episode"].trace_id and got["turn"].service == "svc"
    assert got["episode"].attributes == {"rollout.episode_id": "b.0.0"}
    assert sink.rejected == 0


def test_a_later_version_may_append_fields(tracing: Tracing) -> None:
    parent = tracing.extract({TRACEPARENT_HEADER: VALID.replace("00-", "01-", 1) + "-what-comes-later"})
    assert trace_id_of(parent) == "0af7651916cd43dd8448eb211c80319c"
    assert tracing.extract({TRACEPARENT_HEADER: VALID + "-x"}) is None  # not in version 00


def test_an_unsampled_trace_makes_no_span_and_carries_its_context_on(tracing: Tracing,
                                                                      spans: InMemorySpanExporter) -> None:
    unsampled = VALID[:-2] + "00"
    parent = tracing.extract({TRACEPARENT_HEADER: unsampled, MSG_ID_HEADER: "x"})
    assert parent is not None
    with tracing.span("episode", parent=parent) as span:
        assert span is None
        with tracing.span("turn") as turn:
            assert turn is None
            headers = tracing.inject({MSG_ID_HEADER: "ep:a1:s0"})
    assert headers[TRACEPARENT_HEADER] == unsampled  # downstream services see the decision and record nothing
    tracing.record("recorder.write", parent=parent, start_ns=1)
    assert BatchTraces.of(tracing, [_msg(headers)], start_ns=1).groups == {}
    assert spans.get_finished_spans() == ()


def test_sampling_is_decided_at_the_root(spans: InMemorySpanExporter) -> None:
    never = Tracing.with_exporter("scheduler", spans, sample_ratio=0.0, batch=False)
    root = never.root("episode.publish")
    assert root is not None and not root.is_recording()
    headers = never.inject({MSG_ID_HEADER: "b.0.0:requested"}, root)
    assert int(headers[TRACEPARENT_HEADER].rsplit("-", 1)[1], 16) & 1 == 0  # not sampled
    root.end()
    assert spans.get_finished_spans() == ()
