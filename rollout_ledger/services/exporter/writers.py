"""Atomic Parquet / JSONL export files (written to ``<name>.partial``, fsynced, renamed) and the writing of chunks
into them: Parquet takes each chunk as one columnar table (``tables.table``), gathered into row groups of about
``row_group_bytes`` of Arrow data, JSONL record by record, read off the same table (``tables.records``); records
built per trajectory (ATIF documents) are written as JSONL by ``write_jsonl``."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_ledger.client.records import SCHEMAS, Unit
from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.tables import records, table
from rollout_ledger.services.exporter.settings import ExporterSettings

FILE_TYPES = ("parquet", "jsonl")
ROW_GROUP_BYTES: int = ExporterSettings.model_fields["export_row_group_mb"].default << 20
"""Arrow bytes gathered into one Parquet row group by default (``ROLLOUT_EXPORT_ROW_GROUP_MB``)."""


def jsonl_line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


class AtomicWriter:
    """Writes the records of ``shape`` chunk by chunk to ``path`` via ``path.partial``; ``commit()`` fsyncs and
    renames (all or nothing)."""

    def __init__(self, path: Path, file_type: str, shape: str, unit: Unit = Unit.SEGMENT,
                 background: bool = False, row_group_bytes: int = ROW_GROUP_BYTES) -> None:
        if file_type not in FILE_TYPES:
            raise ValueError(f"unknown file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
        if shape not in SCHEMAS:
            raise ValueError(f"unknown record shape {shape!r}; known: {', '.join(SCHEMAS)}")
        self.path = path
        self.tmp = path.with_name(path.name + ".partial")
        self.file_type = file_type
        self.shape = shape
        self.unit = unit
        self.count = 0
        self.row_group_bytes = row_group_bytes
        self._group: list[pa.Table] = []
        self._group_bytes = 0
        self._pq: pq.ParquetWriter | None = None
        self._fh: Any = None
        path.parent.mkdir(parents=True, exist_ok=True)
        if file_type == "jsonl":
            self._fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit()/abort()
        else:
            self._pq = pq.ParquetWriter(str(self.tmp), SCHEMAS[shape])
        self._rows: _RowGroups | None = _RowGroups(self._pq) if background and self._pq is not None else None

    def write(self, chunk: Chunk) -> int:
        """Append a chunk's records (Parquet: its columnar table joins the row group being filled); returns how
        many."""
        if self._pq is not None:
            t = table(chunk, self.shape, self.unit)
            if t.num_rows:
                self._group.append(t)
                self._group_bytes += t.nbytes
                if self._group_bytes >= self.row_group_bytes:
                    self._flush()
            n = t.num_rows
        else:
            recs = records(chunk, self.shape, self.unit)
            self._fh.write(b"".join(jsonl_line(r) for r in recs))
            n = len(recs)
        self.count += n
        return n

    def _flush(self) -> None:
        """Write the gathered tables as one row group."""
        if not self._group or self._pq is None:
            return
        t = pa.concat_tables(self._group) if len(self._group) > 1 else self._group[0]
        self._group, self._group_bytes = [], 0
        if self._rows is not None:
            self._rows.put(t)
        else:
            self._pq.write_table(t, row_group_size=t.num_rows)

    def commit(self, metadata: dict[str, str] | None = None) -> Path:
        self._flush()
        if self._rows is not None:
            self._rows.finish()
            self._rows = None
        if self._pq is not None:
            if metadata:
                self._pq.add_key_value_metadata(metadata)
            self._pq.close()
            self._pq = None
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        else:
            with open(self.tmp, "rb") as fh:
                os.fsync(fh.fileno())
        return _rename_durably(self.tmp, self.path)

    def abort(self) -> None:
        self._group, self._group_bytes = [], 0
        if self._rows is not None:
            self._rows.cancel()
            self._rows = None
        if self._pq is not None:
            self._pq.close()
            self._pq = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.tmp.unlink(missing_ok=True)


def _rename_durably(tmp: Path, path: Path) -> Path:
    """Rename the fsynced ``tmp`` to ``path`` and fsync the directory (the rename survives a crash)."""
    tmp.replace(path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


class _RowGroups:
    """Parquet row groups written by a thread of their own: ``write_table`` releases the GIL while it encodes, so
    the next group's tables are built meanwhile (at most one group waits: memory stays bounded by the group)."""

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self._writer = writer
        self._queue: queue.Queue[pa.Table | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rl-export-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (t := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._writer.write_table(t, row_group_size=t.num_rows)
                except BaseException as exc:  # raised in the caller's thread by put()/finish()
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, t: pa.Table) -> None:
        self._raise()
        self._queue.put(t)

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def cancel(self) -> None:
        self._error = self._error or RuntimeError("cancelled")
        self._queue.put(None)
        self._thread.join()


def write_file(path: Path, file_type: str, shape: str, chunks: Iterable[Chunk], unit: Unit = Unit.SEGMENT,
               metadata: dict[str, str] | None = None, row_group_bytes: int = ROW_GROUP_BYTES) -> tuple[Path, int]:
    """Write the records of every chunk atomically (Parquet row groups on a writer thread); returns the path and
    the number of records."""
    writer = AtomicWriter(path, file_type, shape, unit, background=True, row_group_bytes=row_group_bytes)
    try:
        for chunk in chunks:
            writer.write(chunk)
        return writer.commit(metadata), writer.count
    except BaseException:
        writer.abort()
        raise


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> tuple[Path, int]:
    """Write records built elsewhere (ATIF documents: ``atif.document``) as JSONL, one per line, atomically as
    ``AtomicWriter`` does (``path.partial``, fsync, rename; nothing at ``path`` when a record fails); returns the path
    and the number of records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    count = 0
    try:
        with open(tmp, "wb") as fh:
            for record in records:
                fh.write(jsonl_line(record))
                count += 1
            fh.flush()
            os.fsync(fh.fileno())
        return _rename_durably(tmp, path), count
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
