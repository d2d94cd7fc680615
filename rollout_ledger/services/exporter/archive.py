"""`rollout archive`: moves whole old periods (monthly partitions of turns, steps, the feed and trajectories) to
Parquet files with a manifest, verifies them, then drops the partitions.

Design note. A period ``[lo, hi)`` (one month, or the first partition 0016 and 0018 made of the tables they found)
is archived when ``hi <= now - older_than`` and in this order, so that a crash at any point loses nothing:

1. Check the feed cursors (``retention.py``'s rule (H)): every entry of the period's feed partition must be at or
   below the slowest consumer's position, else the period is skipped and the consumer that holds it is named. A
   registered consumer never looks at an entry ``<= H`` again, so it cannot miss what the archive takes; a new
   consumer starting at ``earliest`` no longer gets those entries from the feed (as with ``feed prune
   --older-than``) and reads the archived trajectories with ``TrajectoryReader.archived`` instead.
   The period's trajectories (their episodes were created in it) must be passed too: the latest feed entry of
   each may sit in a later feed partition (a replacement logged later).
2. Write one Parquet file per partition of turns, steps and the feed (every column as stored) and
   ``trajectories.parquet``: the trajectories partition's rows in the shape a one-shot export reads
   (``client/archived.py``).
3. Write ``manifest.json`` (period, schema revision, per file: path, rows, bytes, sha256, columns; the batches and
   the partitions), then read every file back and check rows and checksums against it.
4. One transaction: lock the period's partitions against writes (``SHARE``: writers of other months go on), count
   their rows again (a row that arrived since step 2 aborts it), delete the archived trajectory versions (one
   replaced since step 2 aborts it), detach the partitions (the only moment writers of the parent tables wait: a
   catalog change), record the period in ``archives`` and drop the detached tables. Waiting longer than
   ``LOCK_TIMEOUT_S`` for a lock keeps the period.

A crash before step 4 commits leaves every row in Postgres (the files are written again by the next run); after
it, the rows are in the verified files and ``archives`` says where. Runs are serialised by an advisory lock.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import structlog

from rollout_ledger.client.archived import (
    MANIFEST,
    TRAJECTORIES,
    ArchiveError,
    Location,
    open_location,
    read_manifest,
    sha256,
)
from rollout_ledger.client.cursor import Position
from rollout_ledger.client.selection import Selection, stream_query
from rollout_ledger.client.source import _batches, _rendered, connect, connect_arrow
from rollout_ledger.shared.db import SCHEMA_REVISION
from rollout_ledger.shared.errors import StoreError

log = structlog.get_logger("rollout.exporter")

PARTITIONED = {"turns": "produced_at", "steps": "produced_at", "trajectory_feed": "logged_at",
               "trajectories": "episode_created_at"}
"""The partitioned tables and their partition keys (migrations 0016 and 0018)."""
SCHEMA = "rl_partitions"
FORMAT = "rollout-ledger-archive/1"
_LOCK = "rollout-archive"
LOCK_TIMEOUT_S = 10
"""How long the final transaction waits for the tables (a busy recorder): past it the period is kept, "run
again"."""
_BOUND = re.compile(r"FROM \((MINVALUE|'[^']+')\) TO \('([^']+)'\)")
_MIN = dt.datetime.min.replace(tzinfo=dt.UTC)


@dataclass(frozen=True)
class Partition:
    table: str
    name: str
    lo: dt.datetime | None
    """None: from MINVALUE (the first partition, the table 0016 found)."""
    hi: dt.datetime


@dataclass
class PeriodResult:
    """What happened to one period."""

    lo: dt.datetime | None
    hi: dt.datetime
    url: str
    rows: dict[str, int] = field(default_factory=dict)
    archived: bool = False
    skipped: str | None = None
    """Why the period stayed (a consumer holds it, or rows changed while it was written)."""

    @property
    def label(self) -> str:
        return f"[{self.lo.isoformat() if self.lo else 'MINVALUE'}, {self.hi.isoformat()})"


def partitions(conn: psycopg.Connection[Any]) -> list[Partition]:
    """Every bounded partition of the partitioned tables (the default partitions are not archived by period)."""
    conn.execute("SET LOCAL timezone = 'UTC'")
    rows = conn.execute(
        "SELECT p.relname, c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
        "WHERE p.relname = ANY(%s) AND p.relnamespace = 'public'::regnamespace", (list(PARTITIONED),)).fetchall()
    out = []
    for table, name, bound in rows:
        m = _BOUND.search(str(bound))
        if m is None:
            continue  # DEFAULT
        lo = None if m.group(1) == "MINVALUE" else dt.datetime.fromisoformat(m.group(1).strip("'"))
        out.append(Partition(str(table), str(name), lo, dt.datetime.fromisoformat(m.group(2))))
    return out


def _folder(lo: dt.datetime | None, hi: dt.datetime) -> str:
    return f"{lo:%Y-%m}" if lo is not None else f"before-{hi:%Y-%m}"


def _horizon(conn: psycopg.Connection[Any]) -> tuple[Position | None, str | None]:
    row = conn.execute("SELECT consumer, xid, seq FROM export_cursors ORDER BY xid, seq, consumer LIMIT 1").fetchone()
    return (Position(int(row[1]), int(row[2])), str(row[0])) if row else (None, None)


def _held_by(conn: psycopg.Connection[Any], feed: Partition | None, lo: dt.datetime | None,
             hi: dt.datetime) -> str | None:
    """Why the period must stay for a consumer (None: every consumer has passed it)."""
    horizon, holder = _horizon(conn)
    if horizon is None:
        return None
    if feed is not None:
        behind = conn.execute(f"SELECT count(*) FROM {SCHEMA}.{feed.name} WHERE (xid, seq) > (%s, %s)",
                              (horizon.xid, horizon.seq)).fetchone()
        if behind and behind[0]:
            return f"consumer {holder} at {horizon} has not passed {behind[0]} of its feed entries"
    # the latest feed entry of each trajectory of the period (it may sit in a later partition)
    behind = conn.execute(
        "SELECT count(*) FROM trajectories t WHERE t.episode_created_at >= %s AND t.episode_created_at < %s "
        "AND EXISTS ("
        "SELECT 1 FROM trajectory_feed f WHERE f.episode_id = t.episode_id AND f.attempt = t.attempt "
        "AND (f.xid, f.seq) > (%s, %s))", (lo or _MIN, hi, horizon.xid, horizon.seq)).fetchone()
    if behind and behind[0]:
        return f"consumer {holder} at {horizon} has not passed {behind[0]} of its trajectories"
    return None


def _write(loc: Location, name: str, batches: Iterator[pa.RecordBatch]) -> tuple[int, list[str]]:
    """Stream ``batches`` into ``name`` (Parquet, zstd); returns rows written and the column names (a period
    without rows gets a file without columns: the manifest says 0 rows)."""
    rows = 0
    writer: pq.ParquetWriter | None = None
    try:
        for batch in batches:
            if writer is None:
                writer = pq.ParquetWriter(loc.path(name), batch.schema, filesystem=loc.fs, compression="zstd")
            writer.write_batch(batch)
            rows += batch.num_rows
        if writer is None:
            writer = pq.ParquetWriter(loc.path(name), pa.schema([]), filesystem=loc.fs, compression="zstd")
        names = list(writer.schema.names)
    finally:
        if writer is not None:
            writer.close()
    return rows, names


def _select(database_url: str, query: str) -> Iterator[pa.RecordBatch]:
    with connect_arrow(database_url) as conn, conn.cursor() as cur:
        yield from _batches(cur, query)


def _write_period(database_url: str, loc: Location, parts: list[Partition], lo: dt.datetime | None,
                  hi: dt.datetime) -> dict[str, Any]:
    """Steps 2 and 3: the files, the manifest, the check; returns the manifest."""
    loc.fs.create_dir(loc.root, recursive=True)
    files: dict[str, Any] = {}
    for part in parts:
        if part.table == TRAJECTORIES:
            continue  # written below, in the shape a reader reads
        name = f"{part.table}.parquet"
        rows, columns = _write(loc, name, _select(database_url, f"SELECT * FROM {SCHEMA}.{part.name}"))
        files[part.table] = {"path": name, "rows": rows, "columns": columns, "partition": f"{SCHEMA}.{part.name}"}
    query, params, _ = stream_query(Selection(), partition=(lo, hi))
    episodes: list[str] = []
    batch_ids: set[str] = set()

    def traj() -> Iterator[pa.RecordBatch]:
        for batch in _select(database_url, _rendered(query, params)):
            episodes.extend(batch.column("episode_id").to_pylist())
            batch_ids.update(batch.column("batch_id").to_pylist())
            yield batch

    rows, columns = _write(loc, f"{TRAJECTORIES}.parquet", traj())
    files[TRAJECTORIES] = {"path": f"{TRAJECTORIES}.parquet", "rows": rows, "columns": columns,
                           "shape": "export rows: selection.stream_query KEY_COLUMNS + every row field"}
    for entry in files.values():
        entry["sha256"] = sha256(loc, entry["path"])
        entry["bytes"] = loc.fs.get_file_info(loc.path(entry["path"])).size
    manifest = {
        "format": FORMAT, "schema_revision": SCHEMA_REVISION,
        "period": {"start": lo.isoformat() if lo else None, "end": hi.isoformat()},
        "tables": {t: files[t]["rows"] for t in files}, "files": files, "batch_ids": sorted(batch_ids),
        "episodes": len(episodes), "written_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    with loc.fs.open_output_stream(loc.path(MANIFEST)) as f:
        f.write(json.dumps(manifest, indent=1).encode())
    _verify(loc, manifest)
    return manifest


def _verify(loc: Location, manifest: dict[str, Any]) -> None:
    """Every file of the manifest as written: its rows (Parquet footer) and checksum (the bytes)."""
    if read_manifest(loc) != manifest:
        raise ArchiveError(f"{loc.url_of(MANIFEST)} does not read back as written")
    for table, entry in manifest["files"].items():
        meta = pq.read_metadata(loc.path(entry["path"]), filesystem=loc.fs)
        if meta.num_rows != entry["rows"] or sha256(loc, entry["path"]) != entry["sha256"]:
            raise ArchiveError(f"{loc.url_of(entry['path'])} ({table}) does not match the manifest")


def _drop(conn: psycopg.Connection[Any], loc: Location, parts: list[Partition], lo: dt.datetime | None,
          hi: dt.datetime, manifest: dict[str, Any]) -> None:
    """Step 4, in one transaction (``_Changed``: rows changed since the files were written; rolled back)."""
    with conn.transaction():
        # Writers of the parent are held only by the detach at the end (metadata, short); the row counts run while
        # only the period's own partitions refuse writes (SHARE: none should come).
        conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_S}s'")
        for part in parts:
            conn.execute(f"LOCK TABLE {SCHEMA}.{part.name} IN SHARE MODE")
            n = conn.execute(f"SELECT count(*) FROM {SCHEMA}.{part.name}").fetchone()
            if n is None or n[0] != manifest["files"][part.table]["rows"]:
                raise _Changed(f"{part.table}: {n[0] if n else 0} rows now, {manifest['files'][part.table]['rows']} "
                               "archived")
        ids: list[str] = []
        attempts: list[int] = []
        if manifest["files"][TRAJECTORIES]["rows"]:
            table = pq.read_table(loc.path(manifest["files"][TRAJECTORIES]["path"]), filesystem=loc.fs,
                                  columns=["episode_id", "attempt"])
            ids, attempts = table.column("episode_id").to_pylist(), table.column("attempt").to_pylist()
        deleted = conn.execute(
            "DELETE FROM trajectories t USING unnest(%s::text[], %s::int4[]) AS a(episode_id, attempt) "
            "WHERE t.episode_id = a.episode_id AND t.attempt = a.attempt AND t.episode_created_at >= %s "
            "AND t.episode_created_at < %s",
            (ids, attempts, lo or _MIN, hi)).rowcount
        if deleted != len(ids):
            raise _Changed(f"trajectories: {deleted} of {len(ids)} archived versions still stored as archived")
        for part in parts:
            conn.execute(f"ALTER TABLE {part.table} DETACH PARTITION {SCHEMA}.{part.name}")
        conn.execute(
            "INSERT INTO archives (period_start, period_end, url, manifest, tables, batch_ids, schema_revision) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (lo or _MIN, hi, loc.url, loc.url_of(MANIFEST), json.dumps(manifest["tables"]), manifest["batch_ids"],
             manifest["schema_revision"]))
        for part in parts:
            conn.execute(f"DROP TABLE {SCHEMA}.{part.name}")


class _Changed(Exception):
    """Rows arrived in a period while it was written: the transaction is rolled back."""


def archive(database_url: str, older_than: dt.timedelta, to: str, *, endpoint: str | None = None,
            dry_run: bool = False, months_ahead: int = 3) -> list[PeriodResult]:
    """Archive every period that ended more than ``older_than`` ago to ``to``/<period>/ (see the module's note);
    first makes sure ``months_ahead`` monthly partitions exist. Needs the owner's DSN (it detaches and drops
    partitions)."""
    if older_than <= dt.timedelta(0):
        raise ArchiveError("older_than must be positive")
    open_location(to, endpoint)  # a bad URL fails before anything else
    conn = connect(database_url, autocommit=True)
    results: list[PeriodResult] = []
    try:
        got = conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (_LOCK,)).fetchone()
        if not got or not got[0]:
            raise ArchiveError("another `rollout archive` is running on this database")
        if not dry_run:
            conn.execute("SELECT rl_ensure_partitions(%s, 0)", (months_ahead,))
        with conn.transaction():
            cutoff_row = conn.execute("SELECT now() - %s::interval", (older_than,)).fetchone()
            assert cutoff_row is not None
            cutoff: dt.datetime = cutoff_row[0]
            found = partitions(conn)
        periods: dict[tuple[dt.datetime | None, dt.datetime], list[Partition]] = {}
        for part in found:
            if part.hi <= cutoff:
                periods.setdefault((part.lo, part.hi), []).append(part)
        for (lo, hi), parts in sorted(periods.items(), key=lambda kv: kv[0][1]):
            loc = open_location(f"{to.rstrip('/')}/{_folder(lo, hi)}", endpoint)
            res = PeriodResult(lo, hi, loc.url)
            results.append(res)
            feed = next((p for p in parts if p.table == "trajectory_feed"), None)
            with conn.transaction():
                done = conn.execute("SELECT url FROM archives WHERE period_start = %s", (lo or _MIN,)).fetchone()
                res.skipped = (f"already archived to {done[0]}: rows that arrived later stay (archive them by hand)"
                               if done else _held_by(conn, feed, lo, hi))
            if res.skipped or dry_run:
                continue
            try:
                manifest = _write_period(database_url, loc, parts, lo, hi)
            except OSError as exc:
                raise ArchiveError(f"cannot write the archive of {res.label} at {loc.url}: {exc}") from exc
            res.rows = dict(manifest["tables"])
            try:
                _drop(conn, loc, parts, lo, hi, manifest)
                res.archived = True
            except _Changed as exc:
                res.skipped = f"rows changed while it was written ({exc}); run again"
            except psycopg.errors.LockNotAvailable:
                res.skipped = f"the tables stayed busy for {LOCK_TIMEOUT_S} s; run again"
            log.info("period_archived" if res.archived else "period_kept", period=res.label, url=res.url,
                     rows=res.rows, reason=res.skipped)
    except psycopg.Error as exc:
        raise StoreError(f"archive failed in Postgres: {exc}") from exc
    finally:
        conn.close()
    return results
