"""Consumer cursors over ``trajectory_feed``: what a consumer has been delivered, kept in Postgres.

Design note. The recorder upserts trajectories (a higher attempt replaces a row) and its transactions commit in
any order, so neither ``trajectories.created_at`` nor a sequence number assigned at insert can be a position: a
reader that has passed sequence 12 would skip a sequence-11 row that commits a moment later. Instead, triggers
on ``trajectories`` append one ``trajectory_feed`` entry per trajectory written or replaced, in the writer's own
transaction, stamped with that transaction's id (``xid``, 64-bit, never wraps). A read takes only entries with
``xid`` below the xmin of its snapshot: every transaction below xmin has ended, so no entry at or below the
position can appear later. Entries are ordered by ``(xid, seq)`` and the position is the last ``(xid, seq)``
taken. The cost: an entry becomes readable once every transaction older than its writer has ended (a long
transaction anywhere on the server delays delivery; it never loses or repeats it).

A read runs in one REPEATABLE READ snapshot (the feed entries and the trajectory rows agree); the exporter
process holds a session advisory lock per consumer (one live reader per consumer). The cursor advances with a
compare-and-set on the position it read from, in the read's transaction (``rollout export --follow``) or when
the trainer acknowledges the batch (``api.TrajectoryReader``).

Unit of delivery: a trajectory version (episode, attempt), taken if it is still the stored version when read; a
replaced trajectory is delivered again (its new attempt). With ``complete_groups`` a group is delivered in the
read that takes the group's latest feed entry, if it is complete then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import adbc_driver_postgresql.dbapi as adbc
import orjson
import psycopg
from psycopg import sql

from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.selection import Scope, Selection
from rollout_ledger.client.source import connect, connect_arrow, fetch
from rollout_ledger.shared.errors import RolloutError

STARTS = ("earliest", "latest")
"""Where a new consumer starts: the whole feed, or what lands from now on."""

KEEPALIVE = {"tcp_keepalives_idle": 10, "tcp_keepalives_interval": 5, "tcp_keepalives_count": 3}
"""Server-side TCP keepalives of a consumer's session: when the exporter's node is lost, Postgres ends the session
(and frees the consumer's advisory lock for the replacement pod) about 25 s later, not after the OS default of
two hours."""

CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


class CursorError(RolloutError):
    """A consumer cursor could not be used or advanced (busy elsewhere, moved under us, bad name)."""


@dataclass(frozen=True, order=True)
class Position:
    """A point in the feed: the last (xid, seq) taken."""

    xid: int
    seq: int

    def __str__(self) -> str:
        return f"{self.xid}-{self.seq}"

    @classmethod
    def parse(cls, text: str) -> Position:
        xid, _, seq = text.partition("-")
        return cls(int(xid), int(seq))


@dataclass
class CursorState:
    consumer: str
    position: Position
    deliveries: int
    delivered: int


@dataclass
class Read:
    """One read of a consumer's feed: the entries after ``start`` up to ``end`` and the rows they deliver."""

    start: Position
    end: Position
    entries: int
    rows: Chunk = field(default_factory=Chunk.empty)
    deliveries: int = 0
    """The consumer's delivery count before this read."""


def check_consumer(name: str) -> str:
    if not CONSUMER_NAME.match(name):
        raise CursorError(f"consumer name {name!r} must match {CONSUMER_NAME.pattern}")
    return name


_FEED = (
    "SELECT xid, seq, episode_id, attempt, group_id FROM trajectory_feed "
    "WHERE (xid, seq) > (%(xid)s, %(seq)s) AND xid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint "
    "ORDER BY xid, seq LIMIT %(limit)s"
)

_LATER_IN_GROUP = (
    "SELECT DISTINCT group_id FROM trajectory_feed WHERE group_id = ANY(%(groups)s) "
    "AND (xid, seq) > (%(xid)s, %(seq)s)"
)


class Cursors:
    """A consumer's cursor on one connection (REPEATABLE READ, not autocommit; the caller owns transactions)."""

    def __init__(self, conn: psycopg.Connection[Any], consumer: str, arrow: adbc.Connection) -> None:
        self.conn = conn
        self.consumer = check_consumer(consumer)
        self.arrow = arrow
        """Reads the rows, in the snapshot of ``conn``'s transaction (``source.fetch``)."""

    def close(self) -> None:
        """Close both connections (the consumer's advisory lock goes with ``conn``)."""
        try:
            self.arrow.close()
        finally:
            self.conn.close()

    @classmethod
    def open(cls, database_url: str, consumer: str, start: str = "earliest") -> Cursors:
        """A claimed cursor on a new REPEATABLE READ connection (closed again when the claim fails)."""
        check_consumer(consumer)
        conn = connect(database_url)
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        try:
            with conn.transaction():
                for name, value in KEEPALIVE.items():
                    conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), value))
            cursors = cls(conn, consumer, connect_arrow(database_url))
        except BaseException:
            conn.close()
            raise
        try:
            cursors.claim(start)
        except BaseException:
            cursors.close()
            raise
        return cursors

    def claim(self, start: str = "earliest") -> None:
        """Take the consumer's session advisory lock (one live reader per consumer) and make sure its row exists.

        A new consumer starts at the beginning of the feed (``earliest``) or after what is readable now
        (``latest``: the last entry below the snapshot's xmin, so a transaction still open is not skipped).
        An existing consumer keeps its position either way.
        """
        if start not in STARTS:
            raise CursorError(f"start must be one of {', '.join(STARTS)}, got {start!r}")
        with self.conn.transaction():
            got = self.conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                                    (f"rollout-export:{self.consumer}",)).fetchone()
            if not got or not got[0]:
                raise CursorError(f"consumer {self.consumer!r} is being read by another process")
            if start == "latest":
                self.conn.execute(
                    "INSERT INTO export_cursors (consumer, xid, seq) SELECT %s, coalesce(max(xid), 0), "
                    "coalesce((array_agg(seq ORDER BY xid DESC, seq DESC))[1], 0) FROM trajectory_feed "
                    "WHERE xid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ON CONFLICT DO NOTHING",
                    (self.consumer,))
            else:
                self.conn.execute("INSERT INTO export_cursors (consumer) VALUES (%s) ON CONFLICT DO NOTHING",
                                  (self.consumer,))

    def state(self) -> CursorState:
        row = self.conn.execute("SELECT xid, seq, deliveries, delivered FROM export_cursors WHERE consumer = %s",
                                (self.consumer,)).fetchone()
        if row is None:
            raise CursorError(f"consumer {self.consumer!r} has no cursor (claim() first)")
        return CursorState(self.consumer, Position(int(row[0]), int(row[1])), int(row[2]), int(row[3]))

    def _entries(self, pos: Position, limit: int) -> list[Any]:
        """The next feed entries after ``pos`` (at most ``limit``): (xid, seq, episode_id, attempt, group_id)."""
        return self.conn.execute(_FEED, {"xid": pos.xid, "seq": pos.seq, "limit": limit}).fetchall()

    def _later_in(self, groups: list[str], end: Position) -> set[str]:
        """Those of ``groups`` with a feed entry after ``end`` (not complete as of ``end``)."""
        rows = self.conn.execute(_LATER_IN_GROUP, {"groups": groups, "xid": end.xid, "seq": end.seq}).fetchall()
        return {r[0] for r in rows}

    def read(self, sel: Selection, limit: int) -> Read | None:
        """The next feed entries (at most ``limit``) and the rows they deliver; None when nothing is new.

        Call inside a transaction; the rows are read in the same snapshot as the feed entries.
        """
        state = self.state()
        pos = state.position
        entries = self._entries(pos, limit)
        if not entries:
            return None
        end = Position(int(entries[-1][0]), int(entries[-1][1]))
        groups = sorted({e[4] for e in entries})
        if sel.complete_groups:
            later = self._later_in(groups, end)
            scope = Scope(groups=[g for g in groups if g not in later])
        else:
            scope = Scope(groups=groups, rows=[(e[2], int(e[3])) for e in entries])
        rows = fetch(self.conn, self.arrow, sel, scope) if scope.groups else Chunk.empty()
        return Read(pos, end, len(entries), rows, state.deliveries)

    def read_groups(self, sel: Selection, groups: int, limit: int) -> Read | None:
        """The feed entries up to the one that completes the ``groups``-th complete group the selection delivers,
        and exactly those groups' rows; None when fewer are readable among the next ``limit`` entries (nothing is
        taken: a later read finds them with the rest). Groups that complete earlier and select nothing are stepped
        over; groups that complete later stay for the next read. A read of no rows (``rows`` empty) only steps over
        a full window's leading entries that select nothing: advance past it without a delivery and read again.
        Call inside a transaction."""
        if not sel.complete_groups:
            raise CursorError("reading whole groups needs a selection with complete_groups")
        state = self.state()
        pos = state.position
        entries = self._entries(pos, limit)
        if not entries:
            return None
        end = Position(int(entries[-1][0]), int(entries[-1][1]))
        last = {e[4]: i for i, e in enumerate(entries)}  # each group's latest entry in this read
        later = self._later_in(sorted(last), end)
        complete = sorted((i, g) for g, i in last.items() if g not in later)
        if not complete:
            return None
        # which of them the selection delivers (a narrow read: group ids only), in the order they completed
        narrow = fetch(self.conn, self.arrow, sel, Scope(groups=[g for _, g in complete]), fields=("group_id",))
        delivered = set(narrow.values("group_id")) if len(narrow) else set()
        chosen = [(i, g) for i, g in complete if g in delivered][:groups]
        if len(chosen) < groups:
            if len(entries) < limit:
                return None
            # a full window without enough: step over its leading entries of groups that completed and select
            # nothing (other batches, filtered out), so a consumer far behind still gets to its groups
            done = {g for _, g in complete} - delivered
            skip = next((k for k, e in enumerate(entries) if e[4] not in done), len(entries))
            if skip == 0:
                return None
            return Read(pos, Position(int(entries[skip - 1][0]), int(entries[skip - 1][1])), skip, Chunk.empty(),
                        state.deliveries)
        cut = chosen[-1][0]
        rows = fetch(self.conn, self.arrow, sel, Scope(groups=[g for _, g in chosen]))
        return Read(pos, Position(int(entries[cut][0]), int(entries[cut][1])), cut + 1, rows, state.deliveries)

    def advance(self, read: Read, records: int, *, delivery: bool, sel: Selection | None = None) -> None:
        """Move the cursor from ``read.start`` to ``read.end`` (compare-and-set; raises ``CursorError`` if moved)."""
        cur = self.conn.execute(
            "UPDATE export_cursors SET xid = %s, seq = %s, deliveries = deliveries + %s, "
            "delivered = delivered + %s, selection = coalesce(%s::jsonb, selection), updated_at = now() "
            "WHERE consumer = %s AND xid = %s AND seq = %s AND deliveries = %s",
            (read.end.xid, read.end.seq, 1 if delivery else 0, records,
             orjson.dumps(sel.as_json()).decode() if sel else None, self.consumer, read.start.xid, read.start.seq,
             read.deliveries))
        if cur.rowcount != 1:
            raise CursorError(f"consumer {self.consumer!r} moved since this batch was read; not advanced")
