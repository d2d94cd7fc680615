"""The recorder's Prometheus metrics, in a registry of its own built per process (no module-level globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RecorderMetrics:
        reg = registry or CollectorRegistry()
        return cls(
            registry=reg,
            events_processed=Counter("rollout_events_processed", "Events written to Postgres and acked, by type",
                                     ["type"], registry=reg),
            dead_letters=Counter("rollout_dead_letters", "Messages stored in dead_letters, by reason class",
                                 ["reason_class"], registry=reg),
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
        )
