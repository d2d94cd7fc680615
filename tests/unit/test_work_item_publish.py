"""The scheduler's publish of work items through its producer (a ``FakeProducer``; the real one on real NATS in
tests/integration/test_scheduler_api.py and test_outbox.py): each item to its env's route with its id, the acked ones
reported, a refused or unacked one counted as failed (for the outbox), a closed connection stopping the rest, and
with tracing on, each item's headers carrying its own root span."""

from __future__ import annotations

from rollout_ledger.services.scheduler.planning import BatchRunSpec, PlannedEpisode
from rollout_ledger.services.scheduler.work_items import publish_work_items, work_item
from rollout_ledger.shared.events import EpisodeRequested, SamplingParams, decode_as
from rollout_ledger.shared.subjects import work_subject
from tests.fakes import FakeProducer

SPEC = BatchRunSpec(env="arithmetic", group_size=1, max_turns=1, sampling=SamplingParams(max_tokens=4))


def items(n: int) -> list[EpisodeRequested]:
    return [work_item(PlannedEpisode(f"b.{i}.0", "b", f"b.{i}", i, 0, "arithmetic", {"i": i}), SPEC, "scheduler/s")
            for i in range(n)]


async def test_each_item_goes_to_its_envs_route_and_the_acked_are_reported() -> None:
    producer = FakeProducer()
    result = await publish_work_items(producer, items(3), 5.0, {"arithmetic": "builtin"})
    assert (result.acked, result.failed, result.error) == (["b.0.0", "b.1.0", "b.2.0"], 0, None)
    assert [s.subject for s in producer.sent] == [work_subject("builtin")] * 3
    assert [s.event_id for s in producer.sent] == [f"b.{i}.0:requested" for i in range(3)]
    assert decode_as(producer.sent[1].data, EpisodeRequested).task == {"i": 1}
    assert all(s.headers is None for s in producer.sent), "tracing off: no headers of its own"


async def test_refused_and_unacked_items_are_failed_for_the_outbox() -> None:
    producer = FakeProducer(refuse={"b.1.0:requested"}, silent={"b.2.0:requested"})
    result = await publish_work_items(producer, items(4), 0.05, {})
    assert result.acked == ["b.0.0", "b.3.0"] and result.failed == 2
    assert result.error is not None
    assert [s.subject for s in producer.sent] == [work_subject("arithmetic")] * 4, "no route: the env's own"


async def test_a_closed_connection_stops_the_rest() -> None:
    producer = FakeProducer(closed=True)
    result = await publish_work_items(producer, items(3), 5.0, {})
    assert (result.acked, result.failed, producer.sent) == ([], 3, [])
    assert result.error is not None and "ConnectionClosedError" in result.error


async def test_with_tracing_each_item_carries_its_own_root_span() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rollout_ledger.shared.kit.tracing import TRACEPARENT_HEADER, Tracing

    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter("scheduler", exporter, batch=False)
    producer = FakeProducer(refuse={"b.1.0:requested"})
    await publish_work_items(producer, items(2), 5.0, {}, tracing)
    parents = [s.headers[TRACEPARENT_HEADER] for s in producer.sent if s.headers]
    assert len(parents) == 2 and parents[0].split("-")[1] != parents[1].split("-")[1], "a trace per episode"
    spans = {s.attributes["rollout.episode_id"]: s for s in exporter.get_finished_spans()}
    assert spans["b.0.0"].status.is_ok and not spans["b.1.0"].status.is_ok
