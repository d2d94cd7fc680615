"""Reads selected trajectories out of Postgres: connections, and a server-side cursor streamed in chunks."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from rollout_ledger.services.exporter.rows import decode_rows
from rollout_ledger.services.exporter.selection import ROWS_QUERY, Scope, Selection, build_query
from rollout_ledger.shared.errors import StoreError
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


def _raw_rows(conn: psycopg.Connection[Any], keys: list[tuple[Any, ...]], sel: Selection) -> list[dict[str, Any]]:
    """The stored rows of ``keys`` (``KEY_COLUMNS``), in the keys' order, arrays still ``array_send`` bytes."""
    if not keys:
        return []
    with conn.cursor(binary=True, row_factory=dict_row) as cur:
        cur.execute(ROWS_QUERY, {"ids": [k[0] for k in keys]})
        by_id = {r["episode_id"]: r for r in cur.fetchall()}
    source = str(sel.reward) if sel.reward else "rollout"
    ordered = []
    for eid, attempt, reward, advantage, group_size in keys:
        row = by_id.get(eid)
        if row is None or row["attempt"] != attempt:
            raise StoreError(f"trajectory {eid} changed during the read (not in one snapshot?)", retryable=True)
        row.update(reward=reward, advantage=advantage, group_size=group_size, reward_source=source)
        ordered.append(row)
    return ordered


def fetch(conn: psycopg.Connection[Any], sel: Selection, scope: Scope | None = None) -> list[dict[str, Any]]:
    """Every selected row within ``scope``, decoded (a cursor read: bounded by the read's size).

    Call in a REPEATABLE READ transaction (keys and rows must come from one snapshot).
    """
    query, params = build_query(sel, scope)
    keys = conn.execute(query, params).fetchall()
    return decode_rows(_raw_rows(conn, keys, sel))


_DONE = object()


def stream(database_url: str, sel: Selection, chunk: int = 500) -> Iterator[list[dict[str, Any]]]:
    """Selected rows in chunks of ``chunk``: keys from a server-side cursor, each chunk's arrays by index lookups,
    all in one REPEATABLE READ snapshot.

    A reader thread fetches the next chunk while the caller decodes and writes this one (Postgres and the writer
    work at the same time); at most two chunks wait in between, so memory stays bounded by the chunk size.
    """
    query, params = build_query(sel)
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
            with connect(database_url) as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                with conn.transaction(), conn.cursor(name="rl_export_keys") as keys:
                    keys.itersize = chunk
                    keys.execute(query, params)
                    while not stop.is_set() and (batch := keys.fetchmany(chunk)):
                        if not put(_raw_rows(conn, batch, sel)):
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
            yield decode_rows(item)
    finally:
        stop.set()
        reader.join()
