"""Reads selected trajectories out of Postgres: connections, a one-shot export's single query streamed into
``Chunk``s through ADBC (``stream``), and a consumer read's rows looked up by key (``read_chunk``)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Collection, Iterator, Sequence
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

from rollout_ledger.services.exporter.rows import JSON_FIELDS, PACKED, Chunk
from rollout_ledger.services.exporter.selection import (
    KEY_COLUMNS,
    PACKED_FIELDS,
    PAIR_FIELDS,
    SERIAL_READ,
    Scope,
    Selection,
    build_query,
    rows_query,
    stream_query,
)
from rollout_ledger.shared.errors import SchemaError, StoreError
from rollout_ledger.shared.settings import normalize_database_url

BATCH_BYTES = 4 << 20
"""About how many bytes of rows the driver decodes into one Arrow batch (then cut into chunks)."""
CHUNK = 2000
"""Rows per chunk of a one-shot export by default (``ROLLOUT_EXPORT_CHUNK``): per-chunk work is a few dozen numpy
and Arrow calls, which cost as much as the rows' own at 500 rows."""


def libpq_url(database_url: str) -> str:
    """A SQLAlchemy-style DSN (``postgresql+psycopg://``) as libpq wants it."""
    return normalize_database_url(database_url).replace("postgresql+psycopg://", "postgresql://", 1)


def connect(database_url: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    try:
        conn = psycopg.connect(libpq_url(database_url), autocommit=autocommit, application_name="rollout-exporter")
    except psycopg.Error as exc:
        raise StoreError(f"cannot connect to Postgres: {exc}") from exc
    set_json_loads(orjson.loads, conn)
    return conn


def read_chunk(conn: psycopg.Connection[Any], keys: list[tuple[Any, ...]], sel: Selection,
               fields: Collection[str] | None = None) -> Chunk:
    """The stored rows of ``keys`` (``KEY_COLUMNS``), in the keys' order, as a ``Chunk``; ``fields``: the row
    fields to read (all when None; see ``selection.rows_query``)."""
    query, names = rows_query(fields)
    row: tuple[Any, ...] | None = None
    if keys:
        with conn.cursor(binary=True) as cur:
            cur.execute(SERIAL_READ)
            cur.execute(query, {"ids": [k[0] for k in keys]})
            row = cur.fetchone()
    return assemble(list(zip(*keys, strict=True)), row, names, sel)


def _ints(text: str | None, counts: list[int] | None, what: str) -> tuple[np.ndarray, np.ndarray]:
    per_row = np.array(counts or [], np.int64)
    values = np.fromstring(text or "", dtype=np.int64, sep=",")
    if len(values) != int(per_row.sum()):
        raise SchemaError(f"{what}: {len(values)} values for {int(per_row.sum())} announced")
    return values, per_row


def assemble(keys: Sequence[Sequence[Any]], row: Sequence[Any] | None, names: tuple[str, ...],
             sel: Selection) -> Chunk:
    """A ``Chunk`` of the one row ``rows_query`` returns (or ``rows_of`` makes of streamed rows) for the keys
    (``KEY_COLUMNS``, one sequence each, in export order), with the keys' reward, advantage and group size. A key
    without its stored row (or of another attempt) means the read left its snapshot."""
    if not keys or not keys[0]:
        return Chunk.empty()
    values: dict[str, Any] = {}
    at = 0
    for name in names:
        width = 2 if name in PACKED_FIELDS or name in PAIR_FIELDS else 1
        values[name] = row[at:at + width] if row is not None and width == 2 else (row[at] if row else None)
        at += width
    ids, attempts, rewards, advantages, sizes = (list(k) for k in keys)
    if values["episode_id"] != ids or values["attempt"] != attempts:
        raise StoreError("a trajectory changed during the read (not in one snapshot?)", retryable=True)
    columns = {name: list(v) for name, v in values.items() if name not in PACKED_FIELDS and name not in PAIR_FIELDS}
    columns.update(reward=rewards, advantage=advantages, group_size=sizes,
                   reward_source=[str(sel.reward) if sel.reward else "rollout"] * len(ids))
    (tok_bytes, tok_sizes), (lp_bytes, lp_sizes) = values["token_ids"], values["logprobs"]
    token_ids = np.frombuffer(tok_bytes or b"", PACKED["token_ids"]).astype(np.int32, copy=False)
    logprobs = np.frombuffer(lp_bytes or b"", PACKED["logprobs"]).astype(np.float32, copy=False)
    lengths = np.array(columns["num_tokens"], np.int64)
    if tok_sizes != lp_sizes or np.any(np.array(tok_sizes, np.int64) != 4 * lengths):
        raise SchemaError("a trajectory's packed token_ids, logprobs and num_tokens disagree in length")
    ranges, range_values = _ints(values["action_ranges"][0], values["action_ranges"][1], "action_ranges")
    versions, version_counts = _ints(values["range_versions"][0], values["range_versions"][1], "action_versions")
    segments, segment_values = _ints(values["segments"][0], values["segments"][1], "segments")
    if np.any(range_values % 2) or np.any(segment_values % 2) or np.any(range_values // 2 != version_counts):
        raise SchemaError("action ranges, their versions or segments are not [start, end) pairs")
    return Chunk.build(columns, token_ids, logprobs, lengths, ranges.reshape(-1, 2), range_values // 2, versions,
                       segments.reshape(-1, 2), segment_values // 2)


def fetch(conn: psycopg.Connection[Any], sel: Selection, scope: Scope | None = None,
          fields: Collection[str] | None = None) -> Chunk:
    """Every selected row within ``scope`` (a cursor read: bounded by the read's size).

    Call in a REPEATABLE READ transaction (keys and rows must come from one snapshot).
    """
    query, params = build_query(sel, scope)
    keys = conn.execute(query, params).fetchall()
    return read_chunk(conn, keys, sel, fields)


_DONE = object()


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
    offsets = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
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


def _parsed(texts: list[str | None]) -> list[Any]:
    """JSON texts parsed, each distinct text once (a group's members repeat their task): rows with the same text
    share one value, which readers must not change."""
    memo: dict[str | None, Any] = {None: None}
    out = []
    for t in texts:
        v = memo.get(t, memo)
        if v is memo:
            v = memo[t] = orjson.loads(t)  # type: ignore[arg-type]
        out.append(v)
    return out


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
            columns[name] = _parsed((col.storage if isinstance(col, pa.ExtensionArray) else col).to_pylist())
        else:
            columns[name] = col
    columns["reward_source"] = pa.array([reward_source] * batch.num_rows, pa.string())
    token_ids, tok_sizes = _packed(batch.column("token_ids"), PACKED["token_ids"])
    logprobs, lp_sizes = _packed(batch.column("logprobs"), PACKED["logprobs"])
    lengths = pc.fill_null(batch.column("num_tokens"), 0).to_numpy().astype(np.int64)
    if np.any(tok_sizes != lp_sizes) or np.any(tok_sizes != 4 * lengths):
        raise SchemaError("a trajectory's packed token_ids, logprobs and num_tokens disagree in length")
    ranges, range_values = _pairs(batch.column("action_ranges"), "action_ranges")
    versions, version_counts = _pairs(batch.column("range_versions"), "action_versions")
    segments, segment_values = _pairs(batch.column("segments"), "segments")
    if np.any(range_values % 2) or np.any(segment_values % 2) or np.any(range_values // 2 != version_counts):
        raise SchemaError("action ranges, their versions or segments are not [start, end) pairs")
    return Chunk.build(columns, token_ids, logprobs, lengths, ranges.reshape(-1, 2), range_values // 2, versions,
                       segments.reshape(-1, 2), segment_values // 2)


_DONE = object()


def stream(database_url: str, sel: Selection, chunk: int = CHUNK,
           fields: Collection[str] | None = None) -> Iterator[Chunk]:
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
            with contextlib.ExitStack() as stack:
                try:
                    conn = stack.enter_context(adbc.connect(_adbc_uri(database_url), autocommit=True))
                except adbc.Error as exc:
                    raise StoreError(f"cannot connect to Postgres: {exc}") from exc
                cur = stack.enter_context(conn.cursor())
                cur.adbc_statement.set_options(**{"adbc.postgresql.batch_size_hint_bytes": str(BATCH_BYTES)})
                try:
                    cur.execute(text)
                    for batch in cur.fetch_record_batch():
                        for at in range(0, batch.num_rows, chunk):
                            if not put(arrow_chunk(batch.slice(at, chunk), names, source)):
                                return
                except adbc.Error as exc:
                    raise StoreError(f"the export query failed: {exc}") from exc
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
