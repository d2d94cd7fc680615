"""Reads selected trajectories out of Postgres: connections, and a server-side cursor streamed in ``Chunk``s."""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads

from rollout_ledger.services.exporter.rows import PACKED, Chunk, unpack
from rollout_ledger.services.exporter.selection import Scope, Selection, build_query, rows_query
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
    """The stored rows of ``keys`` (``KEY_COLUMNS``), in the keys' order, as a ``Chunk`` (arrays unpacked);
    ``fields``: the row fields to read (all when None; see ``selection.rows_query``)."""
    query, names = rows_query(fields)
    rows: list[tuple[Any, ...]] = []
    if keys:
        with conn.cursor(binary=True) as cur:
            cur.execute(query, {"ids": [k[0] for k in keys]})
            rows = cur.fetchall()
    return assemble(keys, rows, names, sel)


def assemble(keys: list[tuple[Any, ...]], rows: list[tuple[Any, ...]], names: tuple[str, ...],
             sel: Selection) -> Chunk:
    """A ``Chunk`` of ``rows`` (``rows_query``'s, any order) in the order of ``keys``, with the keys' reward,
    advantage and group size; a key whose row is missing or of another attempt means the read left its snapshot."""
    at = {name: i for i, name in enumerate(names)}
    by_id = {r[0]: r for r in rows}
    ordered = []
    attempt_at = at["attempt"]
    for eid, attempt, *_ in keys:
        row = by_id.get(eid)
        if row is None or row[attempt_at] != attempt:
            raise StoreError(f"trajectory {eid} changed during the read (not in one snapshot?)", retryable=True)
        ordered.append(row)
    cols = list(zip(*ordered, strict=True)) if ordered else [()] * len(names)
    columns = {name: list(col) for name, col in zip(names, cols, strict=True) if name not in PACKED}
    columns.update(reward=[k[2] for k in keys], advantage=[k[3] for k in keys], group_size=[k[4] for k in keys],
                   reward_source=[str(sel.reward) if sel.reward else "rollout"] * len(keys))
    token_ids, lengths = unpack(cols[at["token_ids"]], PACKED["token_ids"])
    logprobs, lp_lengths = unpack(cols[at["logprobs"]], PACKED["logprobs"])
    if not np.array_equal(lengths, lp_lengths) or lengths.tolist() != columns["num_tokens"]:
        raise SchemaError("a trajectory's packed token_ids, logprobs and num_tokens disagree in length")
    return Chunk.build(columns, token_ids, logprobs, lengths)


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
           fields: Collection[str] | None = None) -> Iterator[Chunk]:
    """Selected rows in chunks of ``chunk``: keys from a server-side cursor, each chunk's rows by index lookups on
    a second connection that shares the first one's REPEATABLE READ snapshot (``pg_export_snapshot``).

    A reader thread fetches and unpacks the next chunk while the caller maps and writes this one, and the rows
    connection runs in pipeline mode one query ahead, so Postgres looks up chunk n + 1 while chunk n is assembled
    (Postgres, the reader and the writer work at the same time); at most two chunks wait in between, so memory
    stays bounded by the chunk size.
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
            with connect(database_url) as kconn, connect(database_url) as rconn:
                for conn in (kconn, rconn):
                    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                with kconn.transaction(), rconn.transaction():
                    row = kconn.execute("SELECT pg_export_snapshot()").fetchone()
                    rconn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(row[0] if row else "")))
                    with kconn.cursor(name="rl_export_keys") as keys, rconn.pipeline() as pipeline:
                        keys.itersize = chunk
                        keys.execute(query, params)
                        pending: tuple[psycopg.Cursor[Any], list[tuple[Any, ...]]] | None = None
                        while not stop.is_set():
                            batch = keys.fetchmany(chunk)
                            cur = None
                            if batch:  # sent now: the server runs it while the chunk before is assembled
                                cur = rconn.cursor(binary=True)
                                cur.execute(rows_sql, {"ids": [k[0] for k in batch]})
                            if pending is not None:
                                done, done_keys = pending
                                if not put(assemble(done_keys, done.fetchall(), names, sel)):
                                    return
                            if cur is None:
                                break
                            pipeline.sync()
                            pending = (cur, batch)
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
