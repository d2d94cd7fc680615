"""``TrajectoryReader``: a consumer's new trajectories as Arrow tables / numpy, exactly once (no torch).

    from rollout_ledger.client.reader import TrajectoryReader, Selection

    with TrajectoryReader(DATABASE_URL, consumer="grpo-run-7", fmt="slime",
                          selection=Selection(complete_groups=True, statuses=("completed", "truncated"))) as reader:
        for batch in reader.batches(follow=True):
            train_step(batch.table)          # or batch.numpy()
            batch.ack()                      # the cursor advances here, in Postgres

A batch is delivered again until it is acknowledged (a trainer that dies before ``ack()`` gets it again on
restart), and never after: ``ack()`` is a compare-and-set on the position the batch was read from. Trajectories
of archived periods (`rollout archive`) come from ``reader.archived()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa

from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
from rollout_ledger.client.archived import archived_chunks
from rollout_ledger.client.cursor import CursorError, Cursors, Read
from rollout_ledger.client.records import FIELDS, SCHEMAS, Unit
from rollout_ledger.client.selection import RewardChoice, Selection
from rollout_ledger.client.tables import table

__all__ = ["AdvantageKind", "AdvantageSpec", "Batch", "CursorError", "RewardChoice", "Selection",
           "TrajectoryReader", "Unit"]


@dataclass
class Batch:
    """One delivery: its records as an Arrow table; ``ack()`` once trained on."""

    table: pa.Table
    read: Read
    _reader: TrajectoryReader = field(repr=False)
    acked: bool = False

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def numpy(self) -> dict[str, Any]:
        """Columns as numpy: scalar columns as arrays, ragged token columns as lists of arrays."""
        out: dict[str, Any] = {}
        for name in self.table.column_names:
            col = self.table.column(name).combine_chunks()
            if pa.types.is_list(col.type) and pa.types.is_primitive(col.type.value_type):
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy(zero_copy_only=False)
                out[name] = [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]
            elif pa.types.is_list(col.type):
                out[name] = col.to_pylist()
            else:
                out[name] = col.to_numpy(zero_copy_only=False)
        return out

    def ack(self) -> None:
        """Advance the consumer's cursor past this batch (idempotent)."""
        if not self.acked:
            self._reader._ack(self)
            self.acked = True


class TrajectoryReader:
    """Reads a consumer's feed in batches of at most ``batch_size`` feed entries."""

    def __init__(self, database_url: str, consumer: str, selection: Selection | None = None, fmt: str = "full",
                 unit: Unit = Unit.SEGMENT, batch_size: int = 256, start: str = "earliest") -> None:
        if fmt not in SCHEMAS:
            raise ValueError(f"unknown record shape {fmt!r}; known: {', '.join(SCHEMAS)}")
        self.database_url = database_url
        self.sel = selection or Selection()
        self.shape = fmt
        self.unit = unit
        self.batch_size = batch_size
        self.cursors = Cursors.open(database_url, consumer, start)
        self.conn: psycopg.Connection[Any] = self.cursors.conn
        self._pending: Batch | None = None

    def __enter__(self) -> TrajectoryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.cursors.close()

    def next_batch(self) -> Batch | None:
        """The next unacknowledged batch, or None when nothing new is readable."""
        if self._pending is not None and not self._pending.acked:
            raise CursorError("acknowledge the previous batch (batch.ack()) before reading the next one")
        while True:
            with self.conn.transaction():
                read = self.cursors.read(self.sel, self.batch_size)
            if read is None:
                return None
            got = table(read.rows, self.shape, self.unit)
            if got.num_rows:
                self._pending = Batch(got, read, self)
                return self._pending
            with self.conn.transaction():  # entries that selected nothing: step over them
                self.cursors.advance(read, 0, delivery=False, sel=self.sel)

    def read_groups(self, groups: int, timeout_s: float | None = None, poll_s: float = 0.5,
                    stop: threading.Event | None = None, scan: int = 100_000) -> Batch | None:
        """One batch of exactly ``groups`` complete groups (the selection needs ``complete_groups``), the groups
        in the order they completed; waits for them (None past ``timeout_s`` or once ``stop`` is set; nothing is
        taken then). Acknowledge it as any batch. ``scan``: feed entries looked at per try."""
        if groups < 1:
            raise ValueError(f"groups must be at least 1, got {groups}")
        if self._pending is not None and not self._pending.acked:
            raise CursorError("acknowledge the previous batch (batch.ack()) before reading the next one")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stop = stop or threading.Event()
        while True:
            with self.conn.transaction():
                read = self.cursors.read_groups(self.sel, groups, scan)
                if read is not None and len(read.rows) == 0:  # a window that selects nothing: step over it
                    self.cursors.advance(read, 0, delivery=False, sel=self.sel)
                    continue
            if read is not None:
                self._pending = Batch(table(read.rows, self.shape, self.unit), read, self)
                return self._pending
            if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            stop.wait(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def batches(self, follow: bool = False, poll_s: float = 1.0,
                stop: threading.Event | None = None) -> Iterator[Batch]:
        """Batches until nothing is new (or, with ``follow``, until ``stop`` is set)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            batch = self.next_batch()
            if batch is None:
                if not follow:
                    return
                stop.wait(poll_s)
                continue
            yield batch

    def archived(self, selection: Selection | None = None, chunk: int = 2000) -> Iterator[pa.Table]:
        """The trajectories of archived periods (`rollout archive`) that ``selection`` (default: the reader's)
        takes, as tables of this reader's shape, period by period; no cursor moves. Every registered consumer had
        passed an archived period's feed entries before it was archived, so this is for history: a consumer that
        starts at ``earliest`` after an archive reads the archived trajectories here, then the feed. Batch, env,
        status and time filters only (``client/archived.py``)."""
        sel = selection or self.sel
        for got in archived_chunks(self.database_url, sel, FIELDS[self.shape], chunk):
            yield table(got, self.shape, self.unit)

    def _ack(self, batch: Batch) -> None:
        with self.conn.transaction():
            self.cursors.advance(batch.read, len(batch), delivery=True, sel=self.sel)
