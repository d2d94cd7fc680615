"""Reads selected trajectories out of Postgres: connections, and a server-side cursor streamed in ``Chunk``s."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Collection, Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import orjson
import psycopg
from psycopg import Pipeline, sql
from psycopg.types.json import set_json_loads

from rollout_ledger.services.exporter.rows import PACKED, Chunk
from rollout_ledger.services.exporter.selection import (
    PACKED_FIELDS,
    PAIR_FIELDS,
    SERIAL_READ,
    Scope,
    Selection,
    build_query,
    rows_query,
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
    return assemble(keys, row, names, sel)


def _ints(text: str | None, counts: list[int] | None, what: str) -> tuple[np.ndarray, np.ndarray]:
    per_row = np.array(counts or [], np.int64)
    values = np.fromstring(text or "", dtype=np.int64, sep=",")
    if len(values) != int(per_row.sum()):
        raise SchemaError(f"{what}: {len(values)} values for {int(per_row.sum())} announced")
    return values, per_row


def assemble(keys: list[tuple[Any, ...]], row: tuple[Any, ...] | None, names: tuple[str, ...],
             sel: Selection) -> Chunk:
    """A ``Chunk`` of the one row ``rows_query`` returns for ``keys`` (already in their order), with the keys'
    reward, advantage and group size. A key without its stored row (or of another attempt) means the read left
    its snapshot."""
    if not keys:
        return Chunk.empty()
    values: dict[str, Any] = {}
    at = 0
    for name in names:
        width = 2 if name in PACKED_FIELDS or name in PAIR_FIELDS else 1
        values[name] = row[at:at + width] if row is not None and width == 2 else (row[at] if row else None)
        at += width
    ids = [k[0] for k in keys]
    if values["episode_id"] != ids or values["attempt"] != [k[1] for k in keys]:
        raise StoreError("a trajectory changed during the read (not in one snapshot?)", retryable=True)
    columns = {name: list(v) for name, v in values.items() if name not in PACKED_FIELDS and name not in PAIR_FIELDS}
    columns.update(reward=[k[2] for k in keys], advantage=[k[3] for k in keys], group_size=[k[4] for k in keys],
                   reward_source=[str(sel.reward) if sel.reward else "rollout"] * len(keys))
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


def stream(database_url: str, sel: Selection, chunk: int = 500,
           fields: Collection[str] | None = None, lookups: int = 2) -> Iterator[Chunk]:
    """Selected rows in chunks of ``chunk``: keys from a server-side cursor, each chunk's rows by index lookups
    (one row of arrays per chunk, ``selection.rows_query``) on ``lookups`` more connections that share the first
    one's REPEATABLE READ snapshot (``pg_export_snapshot``), taking chunks in turn.

    A reader thread fetches and unpacks chunks while the caller maps and writes the one before; each lookup
    connection runs in pipeline mode with one query in flight, so Postgres looks up the next chunks while this one
    is assembled (Postgres, the reader and the writer work at the same time); at most ``lookups`` chunks are in
    flight and two wait for the caller, so memory stays bounded by the chunk size.
    """
    query, params = build_query(sel)
    rows_sql, names = rows_query(fields)
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
            with ExitStack() as stack:
                kconn = stack.enter_context(connect(database_url))
                rconns = [stack.enter_context(connect(database_url)) for _ in range(lookups)]
                for conn in (kconn, *rconns):
                    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                    stack.enter_context(conn.transaction())
                row = kconn.execute("SELECT pg_export_snapshot()").fetchone()
                for conn in rconns:
                    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(row[0] if row else "")))
                    conn.execute(SERIAL_READ)
                pipes = [(conn, stack.enter_context(conn.pipeline())) for conn in rconns]
                keys = stack.enter_context(kconn.cursor(name="rl_export_keys"))
                keys.itersize = chunk
                keys.execute(query, params)
                pending: deque[tuple[psycopg.Cursor[Any], Pipeline, list[tuple[Any, ...]]]] = deque()
                sent = 0
                while not stop.is_set():
                    batch = keys.fetchmany(chunk)
                    if batch:  # sent now: Postgres looks it up while earlier chunks are assembled
                        conn, pipe = pipes[sent % len(pipes)]
                        cur = conn.cursor(binary=True)
                        cur.execute(rows_sql, {"ids": [k[0] for k in batch]})
                        pending.append((cur, pipe, batch))
                        sent += 1
                    if pending and (len(pending) > len(pipes) - 1 or not batch):
                        cur, pipe, done_keys = pending.popleft()
                        pipe.sync()
                        if not put(assemble(done_keys, cur.fetchone(), names, sel)):
                            return
                    if not batch and not pending:
                        break
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
