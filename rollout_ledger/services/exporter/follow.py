"""`rollout export --consumer NAME [--follow]`: each new trajectory written to a file exactly once per consumer.

A delivery is one file, ``<consumer>.<n>.<end position>.<ext>`` (n = the consumer's delivery number), written to
``<file>.partial``, fsynced and renamed, and then the cursor advances in the read's transaction. A crash between
the rename and the commit leaves file n in place with the cursor still at n - 1: on start (and before every
read) the exporter finds it and advances the cursor to the end position in its name instead of reading again.
So every trajectory lands in exactly one file of the consumer's output directory, across kills and restarts
(keep the output directory with the consumer).

Following, a lost connection (a Postgres restart or failover: the DSN may list a primary and its standbys with
``target_session_attrs=read-write``) rolls the read back; the follower reconnects with backoff, to whichever host
accepts writes, and reads again from the committed cursor (the recovery above covers a file renamed before the
connection died).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import structlog

from rollout_ledger.client.cursor import Cursors, Position, Read
from rollout_ledger.client.records import DOCUMENT_FORMATS, Unit
from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.selection import Selection
from rollout_ledger.services.exporter.export import shape_and_file_type
from rollout_ledger.services.exporter.metrics import ExportMetrics
from rollout_ledger.services.exporter.settings import ExporterSettings
from rollout_ledger.services.exporter.writers import AtomicWriter
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.kit.backoff import Backoff
from rollout_ledger.shared.kit.runtime import BackgroundHttpServer, Health, ops_app

log = structlog.get_logger("rollout.exporter")


@dataclass
class FollowResult:
    files: list[Path]
    records: int


def delivery_path(out_dir: Path, consumer: str, n: int, end: Position, ext: str) -> Path:
    return out_dir / f"{consumer}.{n:06d}.{end}.{ext}"


def _count(path: Path, ext: str) -> int:
    if ext == "parquet":
        return int(pq.ParquetFile(path).metadata.num_rows)
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


class Follower:
    """Delivers a consumer's new trajectories into ``out_dir``, one file per read."""

    def __init__(self, database_url: str, consumer: str, sel: Selection, out_dir: Path, fmt: str = "openrlhf",
                 file_type: str | None = None, unit: Unit = Unit.SEGMENT, batch_size: int = 256,
                 start: str = "earliest", metrics: ExportMetrics | None = None) -> None:
        self.shape, self.ext = shape_and_file_type(fmt, file_type)
        if self.shape in DOCUMENT_FORMATS:
            raise ValueError(f"--format {fmt} is a one-shot export; a consumer delivers the record shapes")
        self.metrics = metrics
        self.last_step = time.monotonic()
        """When the last read (or the start) finished: a liveness check compares it with the clock."""
        self.fmt = fmt
        self.sel = sel
        self.out_dir = out_dir
        self.unit = unit
        self.batch_size = batch_size
        self.database_url = database_url
        self.start_at = start
        self.cursors = Cursors.open(database_url, consumer, start)
        self.conn: psycopg.Connection[Any] = self.cursors.conn
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(f"{consumer}.*.partial"):
            stale.unlink()

    def close(self) -> None:
        self.cursors.close()

    def reconnect(self, stop: threading.Event, initial_s: float = 0.5, max_s: float = 5.0) -> bool:
        """Close the connections and open (and claim) the cursor again, with backoff, until it works or ``stop``
        is set (False then). The claim's advisory lock went with the old session."""
        consumer = self.cursors.consumer
        with contextlib.suppress(Exception):  # the connections are broken already: closing may raise anything
            self.cursors.close()
        backoff = Backoff(initial_s, max_s)
        while not stop.wait(backoff.delay()):
            try:
                self.cursors = Cursors.open(self.database_url, consumer, self.start_at)
            except (StoreError, psycopg.OperationalError, psycopg.InterfaceError) as exc:
                log.warning("export_reconnect_failed", consumer=consumer, error=str(exc), tries=backoff.retries)
                continue
            self.conn = self.cursors.conn
            log.info("export_reconnected", consumer=consumer, tries=backoff.retries)
            return True
        return False

    def recover(self) -> bool:
        """Advance the cursor over a file written before a crash and not yet committed; True if there was one."""
        with self.conn.transaction():
            state = self.cursors.state()
            n = state.deliveries + 1
            found = sorted(self.out_dir.glob(f"{self.cursors.consumer}.{n:06d}.*.{self.ext}"))
            if not found:
                return False
            end = Position.parse(found[0].name.split(".")[2])
            count = _count(found[0], self.ext)
            self.cursors.advance(Read(state.position, end, 0, Chunk.empty(), state.deliveries), count, delivery=True,
                                 sel=self.sel)
        log.info("export_recovered", consumer=self.cursors.consumer, file=str(found[0]), records=count)
        self._count("recovered", count)
        return True

    def _count(self, outcome: str, records: int = 0) -> None:
        m = self.metrics
        if m is None:
            return
        m.reads.labels(self.cursors.consumer, outcome).inc()
        if outcome in ("delivered", "recovered"):
            m.deliveries.inc()
            m.records.inc(records)
            m.last_delivery.set_to_current_time()

    def step(self, before_commit: Callable[[Path], None] | None = None) -> tuple[Path | None, int] | None:
        """One read: None when nothing is new; else (file or None when nothing was selected, records)."""
        t0 = time.monotonic()
        try:
            return self._step(before_commit)
        finally:
            self.last_step = time.monotonic()
            if self.metrics is not None:
                self.metrics.read_seconds.observe(self.last_step - t0)
                self.metrics.last_step.set_to_current_time()

    def _step(self, before_commit: Callable[[Path], None] | None) -> tuple[Path | None, int] | None:
        self.recover()
        with self.conn.transaction():
            read = self.cursors.read(self.sel, self.batch_size)
            if read is None:
                self._count("empty")
                return None
            path = delivery_path(self.out_dir, self.cursors.consumer, read.deliveries + 1, read.end, self.ext)
            writer = AtomicWriter(path, self.ext, self.shape, self.unit)
            try:
                count = writer.write(read.rows)
                if count:
                    writer.commit({"rollout_ledger.format": self.fmt, "rollout_ledger.start": str(read.start),
                                   "rollout_ledger.end": str(read.end)})
                    if before_commit is not None:
                        before_commit(path)
                else:
                    writer.abort()
            except BaseException:
                writer.abort()
                raise
            self.cursors.advance(read, count, delivery=count > 0, sel=self.sel)
        delivered = path if count else None
        self._count("delivered" if count else "nothing_selected", count)
        log.info("export_delivered", consumer=self.cursors.consumer, entries=read.entries, records=count,
                 file=str(delivered) if delivered else None, position=str(read.end))
        return delivered, count

    def run(self, follow: bool, stop: threading.Event, poll_s: float = 1.0,
            echo: Callable[[str], None] | None = None) -> FollowResult:
        """Deliver until nothing is new (or, with ``follow``, until ``stop`` is set)."""
        result = FollowResult([], 0)
        while not stop.is_set():
            try:
                got = self.step()
            except (StoreError, psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if not follow or (isinstance(exc, StoreError) and not exc.retryable):
                    raise
                log.warning("export_connection_lost", consumer=self.cursors.consumer, error=str(exc))
                if not self.reconnect(stop):
                    break
                continue
            if got is None:
                if not follow:
                    break
                stop.wait(poll_s)
                continue
            path, count = got
            if path is not None:
                result.files.append(path)
                result.records += count
                if echo:
                    echo(f"{count} records -> {path}")
        return result


def _open_follower(follow: bool, stop: threading.Event, make: Callable[[], Follower]) -> Follower | None:
    """``make()``; following, a lost or refused connection (Postgres restarting, a failover under way) is tried
    again with backoff until it works or ``stop`` is set (None then)."""
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            return make()
        except (StoreError, psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if not follow or (isinstance(exc, StoreError) and not exc.retryable):
                raise
            log.warning("export_connect_failed", error=str(exc), tries=backoff.retries + 1)
        if stop.wait(backoff.delay()):
            return None


def follow_consumer(settings: ExporterSettings, database_url: str, consumer: str, sel: Selection, out_dir: Path,
                    fmt: str, file_type: str | None, unit: Unit, start: str, follow: bool,
                    echo: Callable[[str], None] | None = None) -> FollowResult:
    """`rollout export --consumer NAME [--follow]` as a process: SIGTERM/SIGINT finish the current read and stop.

    Following with ``ROLLOUT_HTTP_PORT`` set (the Deployment sets it), the process serves ``/healthz`` (503 once
    no read has finished for ``ROLLOUT_EXPORT_STALL_S``: a hung read restarts the pod), ``/readyz`` (200 once the
    cursor is open, 503 while draining) and ``/metrics`` (``metrics.ExportMetrics``); the HTTP server stops last.
    """
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve = follow and "http_port" in settings.model_fields_set
    metrics = ExportMetrics.create(consumer) if serve else None
    health = Health()
    server: BackgroundHttpServer | None = None
    if metrics is not None:
        server = BackgroundHttpServer(ops_app("exporter", health, metrics.registry), settings.http_host,
                                      settings.http_port)
        server.start()
        log.info("export_http", consumer=consumer, port=server.port)
    try:
        follower = _open_follower(follow, stop, lambda: Follower(
            database_url, consumer, sel, out_dir, fmt, file_type, unit, settings.export_batch_size, start, metrics))
        if follower is None:  # stopped while Postgres was unreachable
            return FollowResult([], 0)
        health.live["reading"] = lambda: time.monotonic() - follower.last_step < settings.export_stall_s
        health.ready = True
        try:
            return follower.run(follow, stop, settings.export_poll_s, echo=echo)
        finally:
            health.draining = True
            follower.close()
    finally:
        if server is not None:
            server.stop()
