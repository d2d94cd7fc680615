"""`rollout export --consumer NAME [--follow]`: each new trajectory written to a file exactly once per consumer.

A delivery is one file, ``<consumer>.<n>.<end position>.<ext>`` (n = the consumer's delivery number), written to
``<file>.partial``, fsynced and renamed, and then the cursor advances in the read's transaction. A crash between
the rename and the commit leaves file n in place with the cursor still at n - 1: on start (and before every
read) the exporter finds it and advances the cursor to the end position in its name instead of reading again.
So every trajectory lands in exactly one file of the consumer's output directory, across kills and restarts
(keep the output directory with the consumer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import structlog

from rollout_ledger.services.exporter.cursor import Cursors, Position, Read
from rollout_ledger.services.exporter.export import shape_and_file_type
from rollout_ledger.services.exporter.records import Unit
from rollout_ledger.services.exporter.rows import Chunk
from rollout_ledger.services.exporter.selection import Selection
from rollout_ledger.services.exporter.writers import AtomicWriter

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
                 start: str = "earliest") -> None:
        self.shape, self.ext = shape_and_file_type(fmt, file_type)
        self.fmt = fmt
        self.sel = sel
        self.out_dir = out_dir
        self.unit = unit
        self.batch_size = batch_size
        self.cursors = Cursors.open(database_url, consumer, start)
        self.conn: psycopg.Connection[Any] = self.cursors.conn
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(f"{consumer}.*.partial"):
            stale.unlink()

    def close(self) -> None:
        self.conn.close()

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
        return True

    def step(self, before_commit: Callable[[Path], None] | None = None) -> tuple[Path | None, int] | None:
        """One read: None when nothing is new; else (file or None when nothing was selected, records)."""
        self.recover()
        with self.conn.transaction():
            read = self.cursors.read(self.sel, self.batch_size)
            if read is None:
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
        log.info("export_delivered", consumer=self.cursors.consumer, entries=read.entries, records=count,
                 file=str(delivered) if delivered else None, position=str(read.end))
        return delivered, count

    def run(self, follow: bool, stop: threading.Event, poll_s: float = 1.0,
            echo: Callable[[str], None] | None = None) -> FollowResult:
        """Deliver until nothing is new (or, with ``follow``, until ``stop`` is set)."""
        result = FollowResult([], 0)
        while not stop.is_set():
            got = self.step()
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
