"""The pure parts of the dashboard's new metrics: ``rollout_ready`` follows /readyz, dead letters are exported at 0
per class from the start, the queue gauges' route labels and their replacement per read, and the scheduler's one
new NATS grant (listing the work consumers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rollout_ledger.services.recorder.metrics import DEAD_LETTER_CLASSES, RecorderMetrics
from rollout_ledger.services.scheduler.metrics import create_metrics
from rollout_ledger.services.scheduler.queue_gauges import LEGACY_ROUTE, RouteQueue, route_of_subject, set_queue_gauges
from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.kit.runtime import Health, ops_app
from rollout_ledger.shared.subjects import WORK_STREAM, WORK_SUBJECT, route_token, work_consumer, work_subject

API = "$JS.API"


def test_ready_gauge_follows_readiness() -> None:
    registry = CollectorRegistry()
    health = Health()
    ops_app("x", health, registry)

    def ready() -> float | None:
        return registry.get_sample_value("rollout_ready")

    assert ready() == 0, "not ready before the service says so"
    health.ready = True
    assert ready() == 1
    up = {"ok": True}
    health.checks["nats"] = lambda: up["ok"]
    up["ok"] = False
    assert ready() == 0, "a failing readiness check"
    up["ok"] = True
    health.draining = True
    assert ready() == 0, "draining"


def test_route_labels_of_work_subjects() -> None:
    assert route_of_subject(WORK_SUBJECT) == LEGACY_ROUTE
    for route in ("arithmetic", "rg:leg_counting", "remote:a.b c"):
        assert route_of_subject(work_subject(route)) == route
        assert route_token(route) in work_consumer(route)
    assert route_of_subject("rl.events.turn.generated") is None
    assert route_of_subject(f"{WORK_SUBJECT}.a.b") is None, "a route is one token"


def test_queue_gauges_are_replaced_per_read() -> None:
    metrics = create_metrics()
    set_queue_gauges(metrics, {"a": RouteQueue(5, 2), "gone": RouteQueue(1, 0)}, {"a": 3})
    set_queue_gauges(metrics, {"a": RouteQueue(4, 1)}, {"b": 1})

    def value(name: str, route: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"route": route})

    assert (value("rollout_work_queue_waiting", "a"), value("rollout_work_queue_unacked", "a")) == (4, 1)
    assert value("rollout_env_workers_live", "a") == 0, "no live worker serves a now"
    assert (value("rollout_work_queue_waiting", "b"), value("rollout_env_workers_live", "b")) == (0, 1)
    assert value("rollout_work_queue_waiting", "gone") is None, "a route with nothing left drops out"


def test_only_the_scheduler_lists_the_work_consumers() -> None:
    subject = f"{API}.CONSUMER.LIST.{WORK_STREAM}"
    assert {u for u in nats_auth.USERS if nats_auth.may_publish(u, subject)} == {nats_auth.SCHEDULER}
    assert not nats_auth.may_publish(nats_auth.SCHEDULER, f"{API}.CONSUMER.MSG.NEXT.{WORK_STREAM}.{work_consumer('a')}")


def test_dead_letter_classes_start_at_zero() -> None:
    """So ``increase()`` (the RolloutDeadLettersRising alert) sees a class's first dead letter."""
    registry = RecorderMetrics.create().registry
    for reason_class in DEAD_LETTER_CLASSES:
        assert registry.get_sample_value("rollout_dead_letters_total", {"reason_class": reason_class}) == 0
