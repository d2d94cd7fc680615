"""Atomic Parquet / JSONL export files (written to ``<name>.partial``, fsynced, renamed) and the writing of chunks
into them: Parquet takes each chunk as one columnar table (``tables.table``), JSONL record by record
(``records.records``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from rollout_ledger.services.exporter.records import SCHEMAS, Unit, records
from rollout_ledger.services.exporter.rows import Chunk
from rollout_ledger.services.exporter.tables import table

FILE_TYPES = ("parquet", "jsonl")


def jsonl_line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


class AtomicWriter:
    """Writes the records of ``shape`` chunk by chunk to ``path`` via ``path.partial``; ``commit()`` fsyncs and
    renames (all or nothing)."""

    def __init__(self, path: Path, file_type: str, shape: str, unit: Unit = Unit.SEGMENT) -> None:
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
        self._pq: pq.ParquetWriter | None = None
        self._fh: Any = None
        path.parent.mkdir(parents=True, exist_ok=True)
        if file_type == "jsonl":
            self._fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit()/abort()
        else:
            self._pq = pq.ParquetWriter(str(self.tmp), SCHEMAS[shape])

    def write(self, chunk: Chunk) -> int:
        """Append a chunk's records (Parquet: one row group of the columnar table); returns how many."""
        if self._pq is not None:
            t = table(chunk, self.shape, self.unit)
            if t.num_rows:
                self._pq.write_table(t)
            n = t.num_rows
        else:
            recs = [rec for row in chunk for rec in records(row, self.shape, self.unit)]
            self._fh.write(b"".join(jsonl_line(r) for r in recs))
            n = len(recs)
        self.count += n
        return n

    def commit(self, metadata: dict[str, str] | None = None) -> Path:
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
        self.tmp.replace(self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return self.path

    def abort(self) -> None:
        if self._pq is not None:
            self._pq.close()
            self._pq = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.tmp.unlink(missing_ok=True)


def write_file(path: Path, file_type: str, shape: str, chunks: Iterable[Chunk], unit: Unit = Unit.SEGMENT,
               metadata: dict[str, str] | None = None) -> tuple[Path, int]:
    """Write the records of every chunk atomically; returns the path and the number of records."""
    writer = AtomicWriter(path, file_type, shape, unit)
    try:
        for chunk in chunks:
            writer.write(chunk)
        return writer.commit(metadata), writer.count
    except BaseException:
        writer.abort()
        raise
