"""Records -> Arrow tables, and atomic Parquet / JSONL files (written to ``<name>.partial``, fsynced, renamed)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

FILE_TYPES = ("parquet", "jsonl")


def _json_text(v: Any) -> Any:
    if isinstance(v, dict | list):
        return orjson.dumps(v, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
    return v


def _list_column(values: Sequence[Any], typ: pa.ListType) -> pa.Array:
    """A ``list<number>`` column from numpy arrays in one concatenation (no per-element Python)."""
    value_type = typ.value_type
    if not values or not all(isinstance(v, np.ndarray) for v in values):
        return pa.array([None if v is None else list(v) for v in values], type=typ)
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values).astype(value_type.to_pandas_dtype(), copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def to_table(records: Sequence[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """An Arrow table of ``records`` with ``schema`` (dict and list-of-dict fields become JSON text)."""
    columns: list[pa.Array] = []
    for f in schema:
        values = [r[f.name] for r in records]
        if pa.types.is_list(f.type) and (pa.types.is_integer(f.type.value_type)
                                         or pa.types.is_floating(f.type.value_type)):
            columns.append(_list_column(values, f.type))
        elif pa.types.is_string(f.type) and any(isinstance(v, dict | list) for v in values):
            columns.append(pa.array([_json_text(v) for v in values], type=f.type))
        else:
            columns.append(pa.array(values, type=f.type))
    return pa.Table.from_arrays(columns, schema=schema)


def jsonl_line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


class AtomicWriter:
    """Writes chunks of records to ``path`` via ``path.partial``; ``commit()`` fsyncs and renames (all or nothing)."""

    def __init__(self, path: Path, file_type: str, schema: pa.Schema) -> None:
        if file_type not in FILE_TYPES:
            raise ValueError(f"unknown file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
        self.path = path
        self.tmp = path.with_name(path.name + ".partial")
        self.file_type = file_type
        self.schema = schema
        self.count = 0
        self._pq: pq.ParquetWriter | None = None
        self._fh: Any = None
        path.parent.mkdir(parents=True, exist_ok=True)
        if file_type == "jsonl":
            self._fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit()/abort()
        else:
            self._pq = pq.ParquetWriter(str(self.tmp), schema)

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if self._fh is not None:
            self._fh.write(b"".join(jsonl_line(r) for r in records))
        elif self._pq is not None and records:
            self.write_table(to_table(records, self.schema))
            return
        self.count += len(records)

    def write_table(self, table: pa.Table) -> None:
        """One Parquet row group per chunk (buffering bigger row groups measured no faster, and costs memory)."""
        if self._pq is None:
            self.write(table.to_pylist())
            return
        self._pq.write_table(table)
        self.count += table.num_rows

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


def write_file(path: Path, file_type: str, schema: pa.Schema, chunks: Iterable[Sequence[dict[str, Any]]],
               metadata: dict[str, str] | None = None) -> tuple[Path, int]:
    """Write every chunk atomically; returns the path and the number of records."""
    writer = AtomicWriter(path, file_type, schema)
    try:
        for chunk in chunks:
            writer.write(chunk)
        return writer.commit(metadata), writer.count
    except BaseException:
        writer.abort()
        raise
