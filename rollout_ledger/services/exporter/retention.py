"""Retention of ``trajectory_feed``: deletes the entries no consumer can need any more (``rollout feed prune``).

Design note. The feed (see ``cursor.py``) gains one entry per trajectory version and nothing else removes any.
A prune deletes, in short transactions of at most ``batch`` entries each, entries ``e`` that satisfy all of

  (H) ``e <= H``, where ``H`` is the smallest position in ``export_cursors`` (no consumer: no bound), and
  (X) ``e.xid < xmin`` of the prune transaction's snapshot, and
  (D) ``e`` is *dead*: no trajectory row for ``e.episode_id``, or the stored row has another ``attempt``, or a
      later feed entry announces the same (episode, attempt) again;
      or, only with ``older_than``, ``e.logged_at`` is older than that (*aged*).

Each transaction is REPEATABLE READ, so ``H``, ``xmin``, the feed and the trajectories are read in one snapshot
``S_p``. Why this never breaks exactly-once delivery:

1. Registered consumers. A read takes entries ``> P`` only (``P``: its consumer's position in the read's
   snapshot), and the group check of ``complete_groups`` looks at entries ``> end > P``. A position only moves
   forward (a compare-and-set from the position read to a later end, or ``recover`` to the end in a file name),
   and one process per consumer reads (advisory lock), so the position the prune sees is at most the ``P`` any
   read of that consumer in flight started from (an advance commits only when that read ends). So ``e <= H <= P``
   is never looked at by that consumer again, whatever ``e`` was. A read whose snapshot predates the prune's
   commit still sees the deleted rows (MVCC); one that starts later sees none of them: never a mix.
2. New consumers (``--start earliest`` starts at (0, 0), below every entry; a consumer created while a prune runs
   is one of these too). Only (D) protects them, so only dead entries are claimed to be harmless:
   - Every version stored in ``S_p`` keeps an entry: for each trajectory ``(x, a)`` the latest ``(x, a)`` entry
     is not dead. Later versions are announced by entries written after ``S_p``: their writers were running at
     ``S_p`` or started later, so their ``xid >= xmin`` (X) puts them after every deleted entry.
   - A dead entry ``(x, a)`` delivers nothing that is not delivered again later: in any snapshot that sees the
     prune, the stored version of ``x`` is either the one of ``S_p`` (not ``a``, or ``a`` announced again by
     the later entry that is kept) or a newer one announced by an entry after it. The recorder only ever raises
     ``attempt``, so in practice a dead entry delivers nothing at all.
   - ``complete_groups`` delivers a group in the read that takes its latest feed entry. A group with a stored
     trajectory keeps at least that member's kept entry, so one read still takes its latest remaining entry:
     deleting a dead entry at most moves the group's one delivery to that read (completeness is checked
     there, as for any read).
   - Why "later entry for the same episode" alone is not dead: ``(xid, seq)`` order is not commit order. A
     transaction with a smaller xid can replace a trajectory after a younger one did, so the newest version's
     entry can come *before* an entry of an older version. Deleting the earlier one of the two would lose the
     stored version for new consumers (``tests/integration/test_export_retention.py`` builds this case).
   - ``--start latest`` positions after the last readable entry that is still there: nothing in between remains.
3. Aged entries (``older_than``) obey (H) and (X), so registered consumers are unaffected (1.); a new consumer
   starting at ``earliest`` no longer gets those trajectories from the feed (the one-shot ``rollout export``
   still reads every stored trajectory from ``trajectories``). With no consumer registered at all, (H) is no
   bound: dead entries go (harmless, 2.) and, with ``older_than``, every old entry.

Prunes are serialised by a session advisory lock (a second one raises ``RetentionError``). The prune's own
transactions hold back every reader's xmin while they run, which is why each handles one window of entries.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, replace
from typing import Any

import psycopg
import structlog

from rollout_ledger.client.cursor import Position
from rollout_ledger.client.selection import BeyondStaleness, RewardChoice, Selection, _filters
from rollout_ledger.client.source import connect
from rollout_ledger.shared.errors import RolloutError

log = structlog.get_logger("rollout.exporter")

_NO_BOUND = 2**63 - 1
_LOCK = "rollout-feed-prune"
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class RetentionError(RolloutError):
    """The feed could not be pruned (another prune holds the lock, or a bad retention period)."""


@dataclass(frozen=True)
class PruneResult:
    """What one prune deleted (or, with ``dry_run``, would delete)."""

    dead: int
    """Entries that could deliver nothing any more (superseded versions, trajectories gone, repeats)."""
    aged: int
    """Entries still announcing a stored trajectory, deleted because they were older than ``older_than``."""
    horizon: Position | None
    """The slowest consumer's position when the prune ended (None: no consumer registered)."""
    holder: str | None
    """The consumer at ``horizon``: the one that holds retention back."""
    consumers: int
    remaining: int
    """Entries left in the feed."""
    dry_run: bool = False

    @property
    def deleted(self) -> int:
        return self.dead + self.aged


@dataclass(frozen=True)
class ConsumerLag:
    """A consumer's cursor and what lies after it in the feed (``consumers``)."""

    consumer: str
    position: Position
    deliveries: int
    delivered: int
    behind: int
    """Feed entries after the cursor that the consumer would read into its selection: each announces a trajectory
    (not a group marker) inside the selection's row filters (``lag_query``)."""
    updated_at: dt.datetime
    entries: int
    """Every feed entry after the cursor, inside the selection or not (what retention must keep for it)."""
    selection: Selection | None
    """The selection the consumer was last served with (``export_cursors.selection``); None: none stored yet (it
    has never advanced), so ``behind`` counts every entry that announces a trajectory."""


def parse_age(text: str) -> dt.timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` as a positive ``timedelta``."""
    m = _AGE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise RetentionError(f"retention period {text!r} must be a positive number with s, m, h, d or w (e.g. 7d)")
    return dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


_WINDOW = """
SELECT w.xid, w.seq,
    (t.episode_id IS NULL OR t.attempt <> w.attempt OR EXISTS (
        SELECT 1 FROM trajectory_feed l WHERE l.group_id = w.group_id AND l.episode_id = w.episode_id
        AND l.attempt = w.attempt AND (l.xid, l.seq) > (w.xid, w.seq))) AS dead,
    (%(age_s)s::float8 IS NOT NULL AND w.logged_at < now() - make_interval(secs => %(age_s)s::float8)) AS aged
FROM (SELECT xid, seq, episode_id, attempt, group_id, logged_at FROM trajectory_feed
      WHERE (xid, seq) > (%(axid)s, %(aseq)s) AND (xid, seq) <= (%(hxid)s, %(hseq)s) AND xid < %(xmin)s
      ORDER BY xid, seq LIMIT %(limit)s) w
LEFT JOIN trajectories t ON t.episode_id = w.episode_id
ORDER BY w.xid, w.seq
"""


def _horizon(conn: psycopg.Connection[Any]) -> tuple[Position | None, str | None, int]:
    row = conn.execute("SELECT consumer, xid, seq, count(*) OVER () FROM export_cursors "
                       "ORDER BY xid, seq, consumer LIMIT 1").fetchone()
    if row is None:
        return None, None, 0
    return Position(int(row[1]), int(row[2])), str(row[0]), int(row[3])


def prune(database_url: str, *, older_than: dt.timedelta | None = None, batch: int = 10_000,
          dry_run: bool = False) -> PruneResult:
    """Delete the feed entries every consumer has passed that are dead (and, with ``older_than``, old ones).

    Needs DELETE on ``trajectory_feed`` (``DATABASE_URL``; the read-only role cannot). Safe while consumers
    read and while the recorder writes; see the module's design note for why.
    """
    if batch < 1:
        raise RetentionError(f"batch must be at least 1, got {batch}")
    age_s = older_than.total_seconds() if older_than is not None else None
    conn = connect(database_url)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with conn.transaction():
            got = conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (_LOCK,)).fetchone()
        if not got or not got[0]:
            raise RetentionError("another `rollout feed prune` is running on this database")
        dead = aged = 0
        after = Position(0, 0)
        while True:
            with conn.transaction():
                xmin_row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
                xmin = int(xmin_row[0]) if xmin_row else 0
                horizon, _, _ = _horizon(conn)
                bound = horizon or Position(_NO_BOUND, _NO_BOUND)
                window = conn.execute(_WINDOW, {
                    "axid": after.xid, "aseq": after.seq, "hxid": bound.xid, "hseq": bound.seq,
                    "xmin": xmin, "limit": batch, "age_s": age_s}).fetchall()
                if not window:
                    break
                doomed = [int(seq) for _, seq, is_dead, is_aged in window if is_dead or is_aged]
                dead += sum(1 for row in window if row[2])
                aged += sum(1 for row in window if row[3] and not row[2])
                if doomed and not dry_run:
                    conn.execute("DELETE FROM trajectory_feed WHERE seq = ANY(%s)", (doomed,))
                after = Position(int(window[-1][0]), int(window[-1][1]))
            if len(window) < batch:
                break
        with conn.transaction():
            horizon, holder, consumers = _horizon(conn)
            remaining_row = conn.execute("SELECT count(*) FROM trajectory_feed").fetchone()
        result = PruneResult(dead, aged, horizon, holder, consumers, int(remaining_row[0]) if remaining_row else 0,
                             dry_run)
    finally:
        conn.close()  # also releases the session lock
    log.info("feed_pruned", dead=result.dead, aged=result.aged, dry_run=dry_run, consumers=result.consumers,
             horizon=str(result.horizon) if result.horizon else None, holder=result.holder,
             remaining=result.remaining)
    return result


_MARKER = 0
"""``trajectory_feed.attempt`` of a group marker (migration 0007): it announces no trajectory."""


def stored_selection(doc: Any) -> Selection | None:
    """The selection ``Cursors.advance`` stored (``Selection.as_json``), read back: row filters, group filters and
    the reward (the advantage shapes values, not what is selected: left at its default). None when nothing is
    stored yet, or when this version cannot read what is."""
    if doc is None:
        return None

    def when(key: str) -> dt.datetime | None:
        value = doc.get(key)
        return dt.datetime.fromisoformat(value) if value is not None else None

    try:
        return Selection(
            batch_ids=tuple(doc.get("batch_ids") or ()), envs=tuple(doc.get("envs") or ()),
            statuses=tuple(doc.get("statuses") or ()), reward_min=doc.get("reward_min"),
            reward_max=doc.get("reward_max"), since=when("since"), until=when("until"), version=doc.get("version"),
            max_staleness=doc.get("max_staleness"), complete_groups=bool(doc.get("complete_groups")),
            drop_uniform=bool(doc.get("drop_uniform")), single_segment=bool(doc.get("single_segment")),
            reward=RewardChoice.parse(doc.get("reward") or ""),
            beyond_staleness=BeyondStaleness(doc.get("beyond_staleness") or BeyondStaleness.INCLUDE))
    except (AttributeError, TypeError, ValueError) as exc:
        log.warning("consumer_selection_unreadable", selection=doc, error=str(exc))
        return None


def lag_query(sel: Selection | None) -> tuple[str, dict[str, Any]]:
    """ONE query for a consumer with selection ``sel`` at the cursor ``%(cursor_xid)s``, ``%(cursor_seq)s``:
    ``entries``, every feed entry after the cursor, and ``behind``, those of them the consumer would read into its
    selection: entries that announce a trajectory (not group markers), of the selection's batches (the feed
    carries ``batch_id``), whose episode's stored trajectory passes the selection's other row filters (env,
    status, reward range, time range, weight-version window, single segment, a re-score to exist), built by the same
    ``selection._filters`` as a read's query. The group filters (complete groups, uniform rewards) are not
    applied: a read decides them per group when it takes the group's latest entry (a group still incomplete is
    delivered when its last member lands), so ``behind`` counts entries, not the records still to come.

    Cost: one range scan of the feed's position index after the cursor, plus, only with row filters beyond the
    batch, one primary-key lookup per entry of the selection's batches: never a scan of the store, so a consumer
    that is caught up costs about nothing, selective or not.
    """
    params: dict[str, Any] = {}
    conds = [f"f.attempt <> {_MARKER}"]
    if sel is not None:
        if sel.batch_ids:
            conds.append("f.batch_id = ANY(%(batch_ids)s)")
            params["batch_ids"] = list(sel.batch_ids)
        rest = _filters(replace(sel, batch_ids=()))
        if rest.where or rest.reward_join:
            conds.append(f"EXISTS (SELECT 1 FROM trajectories t JOIN episodes e ON e.id = t.episode_id "
                         f"{rest.reward_join} WHERE t.episode_id = f.episode_id AND "
                         f"{' AND '.join(rest.where) or 'TRUE'})")
            params.update(rest.params)
    query = (f"SELECT count(*) AS entries, count(*) FILTER (WHERE {' AND '.join(conds)}) AS behind "
             "FROM trajectory_feed f WHERE (f.xid, f.seq) > (%(cursor_xid)s, %(cursor_seq)s)")
    return query, params


def consumers(database_url: str) -> list[ConsumerLag]:
    """Every consumer's cursor, slowest first (the first one holds `rollout feed prune` back), with the feed
    entries after it and how many of them are inside the selection it was last served with (``lag_query``), all in
    one snapshot."""
    conn = connect(database_url)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    out: list[ConsumerLag] = []
    try:
        with conn.transaction():
            rows = conn.execute(
                "SELECT consumer, xid, seq, deliveries, delivered, updated_at, selection "
                "FROM export_cursors ORDER BY xid, seq, consumer").fetchall()
            for consumer, xid, seq, deliveries, delivered, updated_at, doc in rows:
                sel = stored_selection(doc)
                query, params = lag_query(sel)
                counts = conn.execute(query, {**params, "cursor_xid": xid, "cursor_seq": seq}).fetchone()
                entries, behind = (int(counts[0]), int(counts[1])) if counts else (0, 0)
                out.append(ConsumerLag(str(consumer), Position(int(xid), int(seq)), int(deliveries), int(delivered),
                                       behind, updated_at, entries, sel))
    finally:
        conn.close()
    return out
