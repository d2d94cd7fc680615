"""The exporter's Prometheus metrics (`rollout export --consumer NAME --follow`), in a registry of its own built
per process (no module-level globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class ExportMetrics:
    """Every metric a following consumer exports; build with ``ExportMetrics.create(consumer)``."""

    registry: CollectorRegistry
    reads: Counter
    deliveries: Counter
    records: Counter
    read_seconds: Histogram
    last_step: Gauge
    last_delivery: Gauge

    @classmethod
    def create(cls, consumer: str, registry: CollectorRegistry | None = None) -> ExportMetrics:
        reg = registry or CollectorRegistry()
        labels = {"consumer": consumer}
        return cls(
            registry=reg,
            reads=Counter("rollout_export_reads", "Reads of the feed, by outcome (empty: nothing new; delivered: a "
                          "file written; nothing_selected: new entries, none selected; recovered: a file written "
                          "before a crash taken over)", ["consumer", "outcome"], registry=reg),
            deliveries=Counter("rollout_export_deliveries", "Delivery files written and committed",
                               ["consumer"], registry=reg).labels(**labels),
            records=Counter("rollout_export_records", "Records delivered (in committed files)", ["consumer"],
                            registry=reg).labels(**labels),
            read_seconds=Histogram("rollout_export_read_seconds", "Time of one read: query, file, commit",
                                   ["consumer"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                   registry=reg).labels(**labels),
            last_step=Gauge("rollout_export_last_read_timestamp_seconds", "When the last read finished",
                            ["consumer"], registry=reg).labels(**labels),
            last_delivery=Gauge("rollout_export_last_delivery_timestamp_seconds",
                                "When the last delivery was committed", ["consumer"], registry=reg).labels(**labels),
        )
