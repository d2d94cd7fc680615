"""The recorder's Prometheus metrics, in a registry of its own built per process (no module-level globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DEAD_LETTER_CLASSES = ("schema", "undecodable", "unexpected_type", "out_of_place", "non_finite_reward",
                       "unknown_episode", "unauthorised_cancel", "incomplete", "inconsistent", "token_mismatch",
                       "store_rejected", "advisory", "work_queue", "rejected_work")
"""The ``reason_class`` values of ``rollout_dead_letters`` the recorder uses, exported at 0 from the start: a series
that first appears at 1 hides that first dead letter from ``increase()``, which the RolloutDeadLettersRising alert
uses (a class missing here only loses its first dead letter per process to the alert)."""


@dataclass(frozen=True)
class RecorderMetrics:
    """Every metric the recorder exports; build with ``RecorderMetrics.create()``."""

    registry: CollectorRegistry
    events_processed: Counter
    dead_letters: Counter
    lag_seconds: Gauge
    pending: Gauge
    batch_seconds: Histogram
    trajectories_written: Counter
    store_retries: Counter
    terminal_naks: Counter
    newer_contract: Counter
    attempt_failures: Counter
    """Failed attempts newly stored in ``attempt_failures`` (labels ``failure_class``, ``retried``)."""

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RecorderMetrics:
        reg = registry or CollectorRegistry()
        dead_letters = Counter("rollout_dead_letters", "Messages stored in dead_letters, by reason class",
                               ["reason_class"], registry=reg)
        for reason_class in DEAD_LETTER_CLASSES:
            dead_letters.labels(reason_class=reason_class)
        return cls(
            registry=reg,
            events_processed=Counter("rollout_events_processed", "Events written to Postgres and acked, by type",
                                     ["type"], registry=reg),
            dead_letters=dead_letters,
            lag_seconds=Gauge("rollout_recorder_lag_seconds",
                              "Now minus the producer time of the newest event processed", registry=reg),
            pending=Gauge("rollout_recorder_pending", "Events on the stream not yet delivered to the recorder",
                          registry=reg),
            batch_seconds=Histogram("rollout_recorder_batch_seconds", "Time to write and ack one fetched batch",
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                    registry=reg),
            trajectories_written=Counter("rollout_trajectories_written", "Trajectories inserted or replaced",
                                         registry=reg),
            store_retries=Counter("rollout_recorder_store_retries", "Batch writes retried because Postgres failed",
                                  registry=reg),
            terminal_naks=Counter("rollout_recorder_terminal_naks",
                                  "Terminal events handed back because their turns were not all stored yet",
                                  registry=reg),
            newer_contract=Counter("rollout_recorder_newer_contract",
                                   "Events of a newer contract major handed back for an upgraded recorder (parked)",
                                   registry=reg),
            attempt_failures=Counter("rollout_attempt_failures",
                                     "Failed episode attempts stored in attempt_failures, by failure class (infra, "
                                     "inference, env, agent, timeout) and whether another attempt followed",
                                     ["failure_class", "retried"], registry=reg),
        )
