"""Reads selected trajectories out of Postgres into ``Chunk``s: ``selection.stream_query`` through ADBC, streamed
for a one-shot export (``stream``) or taken whole, in the snapshot of a consumer's transaction (``fetch``)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Collection, Generator, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import adbc_driver_postgresql.dbapi as adbc
import numpy as np
import orjson
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from psycopg.types.json import set_json_loads

from rollout_ledger.client.rows import JSON_FIELDS, PACKED, Chunk, by_code
from rollout_ledger.client.selection import (
    KEY_COLUMNS,
    PACKED_FIELDS,
    PAIR_FIELDS,
    Scope,
    Selection,
    stream_query,
)
from rollout_ledger.shared.errors import SchemaError, StoreError
from rollout_ledger.shared.kit.settings import libpq_database_url

BATCH_BYTES = 4 << 20
"""About how many bytes of rows the driver decodes into one Arrow batch (then cut into chunks)."""
CHUNK = 2000
"""Rows per chunk of a one-shot export by default (``ROLLOUT_EXPORT_CHUNK``): per-chunk work is a few dozen numpy
and Arrow calls, which cost as much as the rows' own at 500 rows."""


def libpq_url(database_url: str) -> str:
    """A SQLAlchemy-style DSN (``postgresql+psycopg://``) as libpq wants it (several hosts in the netloc)."""
    return libpq_database_url(database_url)


def connect(database_url: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    try:
        conn = psycopg.connect(libpq_url(database_url), autocommit=autocommit, application_name="rollout-exporter")
    except psycopg.Error as exc:
        raise StoreError(f"cannot connect to Postgres: {exc}") from exc
    set_json_loads(orjson.loads, conn)
    return conn


def _rendered(query: str, params: dict[str, Any]) -> str:
    """``query`` with its ``%(name)s`` parameters as SQL literals (quoted by psycopg): ADBC streams a result
    through ``COPY``, which takes no bound parameters."""
    return query % {name: sql.Literal(value).as_string(None) for name, value in params.items()}


def _adbc_uri(database_url: str) -> str:
    parts = urlsplit(libpq_url(database_url))
    query = "&".join(p for p in (parts.query, "application_name=rollout-exporter") if p)
    return urlunsplit(parts._replace(query=query))


def _packed(col: pa.Array, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """A ``bytea`` column of packed little-endian values -> (the rows' values laid end to end, each row's byte
    length), read in place from the Arrow buffers (a NULL reads as empty)."""
    width = np.int64 if pa.types.is_large_binary(col.type) else np.int32
    offsets = np.frombuffer(col.buffers()[1], width)[col.offset:col.offset + len(col) + 1]
    data = col.buffers()[2]
    raw = np.frombuffer(data, np.uint8)[offsets[0]:offsets[-1]] if data is not None else np.empty(0, np.uint8)
    sizes = np.diff(offsets).astype(np.int64)
    if np.any(sizes % dtype.itemsize):
        raise SchemaError(f"packed array is not a whole number of {dtype.itemsize}-byte values")
    return raw.view(dtype).astype(dtype.newbyteorder("="), copy=False), sizes


def _pairs(col: pa.Array, what: str) -> tuple[np.ndarray, np.ndarray]:
    """An ``int4[]`` column (a 2-D array arrives flattened) -> (its values laid end to end, NULL elements as -1;
    each row's number of values, a NULL array counting none)."""
    counts = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
    values = pc.fill_null(pc.list_flatten(col), -1).to_numpy().astype(np.int64)
    if len(values) != int(counts.sum()):
        raise SchemaError(f"{what}: {len(values)} values for {int(counts.sum())} announced")
    return values, counts


def _parsed(texts: pa.Array) -> list[Any]:
    """A column of JSON texts parsed, each distinct text once (a group's members repeat their task): rows with the
    same text share one value, which readers must not change. The distinct texts are found by Arrow (no Python
    string per row)."""
    encoded = pc.dictionary_encode(texts)
    values = [*map(orjson.loads, encoded.dictionary.to_pylist()), None]  # the last one: NULL
    codes = pc.fill_null(encoded.indices, pa.scalar(len(values) - 1, encoded.indices.type))
    return by_code(values, codes.to_numpy())


def arrow_chunk(batch: pa.RecordBatch, names: tuple[str, ...], reward_source: str) -> Chunk:
    """A ``Chunk`` of a batch of ``stream_query`` rows (``KEY_COLUMNS``, then the fields ``names``), column by
    column: packed arrays read in place, ``int4[]`` spans flattened, scalar fields kept as Arrow arrays, jsonb
    parsed (``_parsed``)."""
    columns: dict[str, Any] = {}
    for name in (*KEY_COLUMNS, *names):
        if name in PACKED_FIELDS or name in PAIR_FIELDS:
            continue
        col = batch.column(name)
        if name in JSON_FIELDS:
            columns[name] = _parsed(col.storage if isinstance(col, pa.ExtensionArray) else col)
        else:
            columns[name] = col
    columns["reward_source"] = pa.array([reward_source] * batch.num_rows, pa.string())
    token_ids, tok_sizes = _packed(batch.column("token_ids"), PACKED["token_ids"])
    sampled, lp_sizes = _packed(batch.column("logprobs"), PACKED["logprobs"])
    lengths = pc.fill_null(batch.column("num_tokens"), 0).to_numpy().astype(np.int64)
    if np.any(tok_sizes != 4 * lengths):
        raise SchemaError("a trajectory's packed token_ids and num_tokens disagree in length")
    ranges, range_values = _pairs(batch.column("action_ranges"), "action_ranges")
    versions, version_counts = _pairs(batch.column("range_versions"), "action_versions")
    segments, segment_values = _pairs(batch.column("segments"), "segments")
    if np.any(range_values % 2) or np.any(segment_values % 2) or np.any(range_values // 2 != version_counts):
        raise SchemaError("action ranges, their versions or segments are not [start, end) pairs")
    pairs = ranges.reshape(-1, 2)
    row = np.repeat(np.arange(batch.num_rows), range_values // 2)
    if np.any(np.bincount(row, pairs[:, 1] - pairs[:, 0], batch.num_rows) * 4 != lp_sizes):
        raise SchemaError("a trajectory's packed sampled logprobs and action ranges disagree in length")
    return Chunk.build(columns, token_ids, sampled, lengths, pairs, range_values // 2, versions,
                       segments.reshape(-1, 2), segment_values // 2)


def connect_arrow(database_url: str) -> adbc.Connection:
    """An ADBC connection (autocommit: transactions are explicit) for ``stream`` and ``fetch``."""
    try:
        return adbc.connect(_adbc_uri(database_url), autocommit=True)
    except adbc.Error as exc:
        raise StoreError(f"cannot connect to Postgres: {exc}") from exc


def _batches(cur: adbc.Cursor, query: str) -> Iterator[pa.RecordBatch]:
    """The query's rows as Arrow record batches of about ``BATCH_BYTES`` (a failure is a ``StoreError``)."""
    cur.adbc_statement.set_options(**{"adbc.postgresql.batch_size_hint_bytes": str(BATCH_BYTES)})
    try:
        cur.execute(query)
        yield from cur.fetch_record_batch()
    except adbc.Error as exc:
        raise StoreError(f"the export query failed: {exc}") from exc


def rechunked(batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The batches' rows as record batches of exactly ``rows`` rows (the last may be shorter). The driver cuts its
    batches by bytes, so slicing each alone left a short chunk at the end of nearly every batch (rows of ~1.8 kB:
    2,370 a batch, cut into 2,000 + 370), and a chunk's fixed cost is about that of 500 rows' work. A chunk within
    one batch is a zero-copy slice of it; one that spans two is copied together."""
    pending: list[pa.RecordBatch] = []
    have = 0
    for batch in batches:
        at = 0
        while at < batch.num_rows:
            take = min(rows - have, batch.num_rows - at)
            pending.append(batch.slice(at, take))
            have += take
            at += take
            if have == rows:
                yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)
                pending, have = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)


def _command(cur: adbc.Cursor, command: str) -> None:
    """A statement without rows (``execute`` would describe it first: seven times as long)."""
    try:
        cur.adbc_statement.set_sql_query(command)
        cur.adbc_statement.execute_update()
    except adbc.Error as exc:
        raise StoreError(f"{command.split()[0]} failed: {exc}") from exc


def fetch(conn: psycopg.Connection[Any], arrow: adbc.Connection, sel: Selection, scope: Scope | None = None,
          fields: Collection[str] | None = None) -> Chunk:
    """Every selected row within ``scope``, as one ``Chunk`` (a consumer read: bounded by the read's size), in the
    snapshot of ``conn``'s open transaction (a consumer reads its feed entries and their rows in one snapshot):
    ``stream_query`` runs on the ADBC connection ``arrow`` in a REPEATABLE READ transaction that imports that
    snapshot (``pg_export_snapshot``)."""
    query, params, names = stream_query(sel, fields, scope)
    snapshot = conn.execute("SELECT pg_export_snapshot()").fetchone()
    assert snapshot is not None
    with arrow.cursor() as cur:
        _command(cur, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            _command(cur, sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot[0])).as_string(None))
            got = list(_batches(cur, _rendered(query, params)))
        except BaseException:
            with contextlib.suppress(StoreError):  # the error that ended the read is the one to report
                _command(cur, "ROLLBACK")
            raise
        _command(cur, "ROLLBACK")
    if not any(b.num_rows for b in got):
        return Chunk.empty()
    batch = pa.Table.from_batches(got).combine_chunks().to_batches()[0]
    return arrow_chunk(batch, names, str(sel.reward) if sel.reward else "rollout")


_DONE = object()


def stream(database_url: str, sel: Selection, chunk: int = CHUNK,
           fields: Collection[str] | None = None) -> Generator[Chunk, None, None]:
    """Selected rows in chunks of at most ``chunk``: ``selection.stream_query`` (one statement, one snapshot), in
    export order.

    The query runs through ADBC's PostgreSQL driver, which reads it as ``COPY ... TO STDOUT (FORMAT binary)`` and
    decodes the rows into Arrow record batches in C (no Python object per field: a row of psycopg cost more
    client CPU than the Parquet encoding of it). Postgres sends rows while they are consumed (TCP's flow control
    bounds what is in flight). A reader thread decodes and assembles the next chunks while the caller maps and
    writes the one before (the driver reads without the GIL, so Postgres, the reader and the writer work at the
    same time); at most two chunks wait for the caller, so memory stays bounded by the chunk size and the
    driver's batch (``BATCH_BYTES``).
    """
    query, params, names = stream_query(sel, fields)
    text = _rendered(query, params)
    source = str(sel.reward) if sel.reward else "rollout"
    chunks: queue.Queue[Any] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            with connect_arrow(database_url) as conn, conn.cursor() as cur:
                for batch in rechunked(_batches(cur, text), chunk):
                    if not put(arrow_chunk(batch, names, source)):
                        return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)

    reader = threading.Thread(target=read, name="rl-export-reader", daemon=True)
    reader.start()
    try:
        while True:
            item = chunks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()
