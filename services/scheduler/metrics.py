"""The scheduler's Prometheus metrics, in a registry of their own created per app."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram


@dataclass(frozen=True)
class SchedulerMetrics:
    """Counters and histograms of one scheduler app."""

    registry: CollectorRegistry
    batches_submitted: Counter
    episodes_submitted: Counter
    episodes_published: Counter
    episodes_republished: Counter
    publish_failures: Counter
    episodes_admitted: Counter
    http_requests: Counter
    http_latency: Histogram


def create_metrics() -> SchedulerMetrics:
    """A fresh registry with every scheduler metric registered on it."""
    registry = CollectorRegistry()
    return SchedulerMetrics(
        registry=registry,
        batches_submitted=Counter("rollout_batches_submitted", "New batches accepted", registry=registry),
        episodes_submitted=Counter("rollout_episodes_submitted", "Episodes of new batches", registry=registry),
        episodes_published=Counter(
            "rollout_episodes_published", "Work items acked by the work queue", ["source"], registry=registry
        ),
        episodes_republished=Counter(
            "rollout_outbox_republished", "Work items the outbox published after their request did not",
            registry=registry,
        ),
        publish_failures=Counter(
            "rollout_publish_failures", "Work items whose publish failed (left to the outbox)", registry=registry
        ),
        episodes_admitted=Counter(
            "rollout_episodes_admitted", "Waiting episodes admission let start (bounded batches)", registry=registry
        ),
        http_requests=Counter(
            "rollout_http_requests", "HTTP requests by route and status", ["method", "route", "status"],
            registry=registry,
        ),
        http_latency=Histogram(
            "rollout_http_request_duration_seconds", "HTTP request latency by route", ["method", "route"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        ),
    )
