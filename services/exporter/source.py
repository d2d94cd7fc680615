"""Reads selected trajectories out of Postgres: connections, a one-shot export's server-side cursor streamed in
``Chunk``s (``stream``), and a consumer read's rows looked up by key (``read_chunk``)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads

from rollout_ledger.services.exporter.rows import PACKED, Chunk
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


def rows_of(rows: Sequence[Sequence[Any]], names: tuple[str, ...]) -> tuple[list[Sequence[Any]], tuple[Any, ...]]:
    """Rows of ``stream_query`` -> (their key columns, the one-row-per-chunk layout ``rows_query`` returns), so
    that ``assemble`` reads both alike: packed bytes joined with each row's byte length, pair fields' texts joined
    with each row's count, every other field as one list."""
    cols: list[Sequence[Any]] = list(zip(*rows, strict=True))
    out: list[Any] = []
    at = len(KEY_COLUMNS)
    for name in names:
        if name in PACKED_FIELDS:
            out += [b"".join(cols[at]), [len(v) for v in cols[at]]]
        elif name in PAIR_FIELDS:
            out += [",".join(v for v in cols[at] if v), list(cols[at + 1])]
            at += 1
        else:
            out.append(list(cols[at]))
        at += 1
    return cols[:len(KEY_COLUMNS)], tuple(out)


_DONE = object()


def stream(database_url: str, sel: Selection, chunk: int = 500,
           fields: Collection[str] | None = None) -> Iterator[Chunk]:
    """Selected rows in chunks of ``chunk``: ``selection.stream_query`` through a cursor (one connection, one
    snapshot), in export order.

    The query is DECLAREd (Postgres plans a cursor for its first rows: the streaming plan of ``stream_query``)
    and read with one ``FETCH ALL`` in libpq's chunked-rows mode: Postgres sends rows while they are consumed
    (no round trip per chunk; TCP's flow control bounds what is in flight). A reader thread parses and assembles
    the next chunks while the caller maps and writes the one before (psycopg waits without the GIL, so
    Postgres, the reader and the writer work at the same time); at most two chunks wait for the caller, so
    memory stays bounded by the chunk size.
    """
    query, params, names = stream_query(sel, fields)
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
        conn: psycopg.Connection[Any] | None = None
        rows: Iterator[Any] | None = None
        try:
            conn = connect(database_url)
            conn.execute(sql.SQL("DECLARE rl_export NO SCROLL CURSOR FOR {}").format(sql.SQL(query)), params)
            rows = conn.cursor().stream("FETCH ALL FROM rl_export", binary=True, size=chunk)
            batch: list[Any] = []
            for r in rows:
                batch.append(r)
                if len(batch) == chunk:
                    done, batch = batch, []
                    if not put(assemble(*rows_of(done, names), names, sel)):
                        return
            if batch and not put(assemble(*rows_of(batch, names), names, sel)):
                return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)
        finally:  # the connection first: closing an unfinished stream would read every remaining row
            if conn is not None:
                conn.close()
            if rows is not None:
                with contextlib.suppress(psycopg.Error):
                    rows.close()  # type: ignore[attr-defined]

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
