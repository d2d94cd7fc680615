"""The scheduler's Prometheus metrics, in a registry of their own created per app."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class SchedulerMetrics:
    """Counters, histograms and gauges of one scheduler app."""

    registry: CollectorRegistry
    batches_submitted: Counter
    episodes_submitted: Counter
    episodes_published: Counter
    episodes_republished: Counter
    publish_failures: Counter
    episodes_admitted: Counter
    admission_passes: Counter
    """Admission passes this scheduler ran (each under the per-batch locks shared with the other replicas)."""
    http_requests: Counter
    http_latency: Histogram
    policy_announced: Gauge
    """The newest announced policy version (admission's ``current``)."""
    policy_serving: Gauge
    """The lowest version a live inference worker serves (admission's ``serving``)."""
    policy_staleness: Gauge
    """``current - serving``: versions behind the announced one a starting episode is generated."""
    inference_workers_live: Gauge
    """Inference workers with a live report in ``rl_policy_workers``."""
    episodes_waiting: Gauge
    """Episodes of bounded batches held ``waiting`` for admission."""
    admission_stalled: Gauge
    """Seconds episodes have waited with none admitted (0 when none waits or the last pass admitted some)."""
    work_waiting: Gauge
    """Work items on the queue not yet delivered to an env worker, by ``route``."""
    work_unacked: Gauge
    """Work items delivered to an env worker and not acked yet (running or held), by ``route``."""
    env_workers_live: Gauge
    """Env workers with a live entry in ``rl_env_workers`` that serve the ``route``."""


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
        admission_passes=Counter(
            "rollout_admission_passes", "Admission passes run by this scheduler (admitting or not)", registry=registry
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
        policy_announced=Gauge("rollout_policy_version_announced", "The newest announced policy version",
                               registry=registry),
        policy_serving=Gauge("rollout_policy_version_serving_min", "The lowest policy version a live inference "
                             "worker serves (the announced one when none reports)", registry=registry),
        policy_staleness=Gauge("rollout_policy_staleness_versions", "Announced policy version minus the lowest one a "
                               "live inference worker serves", registry=registry),
        inference_workers_live=Gauge("rollout_inference_workers_live", "Inference workers whose policy report in "
                                     "rl_policy_workers has not expired", registry=registry),
        episodes_waiting=Gauge("rollout_episodes_waiting", "Episodes of bounded batches waiting for admission",
                               registry=registry),
        admission_stalled=Gauge("rollout_admission_stalled_seconds", "Seconds episodes have been waiting while "
                                "admission admitted none (0 when none waits)", registry=registry),
        work_waiting=Gauge("rollout_work_queue_waiting", "Work items not yet delivered to an env worker, by route",
                           ["route"], registry=registry),
        work_unacked=Gauge("rollout_work_queue_unacked", "Work items delivered to an env worker and not acked yet "
                           "(running, or held by the policy gate), by route", ["route"], registry=registry),
        env_workers_live=Gauge("rollout_env_workers_live", "Live env workers (rl_env_workers) serving the route",
                               ["route"], registry=registry),
    )
