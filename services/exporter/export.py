"""One-shot export: a selection's trajectories streamed out of Postgres into one Parquet or JSONL file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout_ledger.client.records import FIELDS, FORMATS, Unit
from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import CHUNK, stream
from rollout_ledger.services.exporter.writers import FILE_TYPES, ROW_GROUP_BYTES, write_file

FILE_FORMATS = FILE_TYPES


@dataclass
class ExportResult:
    path: Path
    records: int


def shape_and_file_type(fmt: str, file_type: str | None) -> tuple[str, str]:
    """``--format`` (+ ``--file-type``) -> (record shape, file type): ``parquet``/``jsonl`` are the full record."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt in FILE_TYPES:
        if file_type not in (None, fmt):
            raise ValueError(f"format {fmt} is a file type already; drop --file-type {file_type}")
        return "full", fmt
    ft = file_type or "parquet"
    if ft not in FILE_TYPES:
        raise ValueError(f"unknown file type {ft!r}; known: {', '.join(FILE_TYPES)}")
    return fmt, ft


def export(database_url: str, sel: Selection, path: Path, fmt: str = "openrlhf", file_type: str | None = None,
           unit: Unit = Unit.SEGMENT, chunk: int = CHUNK, row_group_bytes: int = ROW_GROUP_BYTES) -> ExportResult:
    """Write every selected trajectory as ``fmt`` records to ``path`` (atomically; memory bounded by ``chunk``
    and ``row_group_bytes``)."""
    shape, ft = shape_and_file_type(fmt, file_type)
    out, count = write_file(path, ft, shape, stream(database_url, sel, chunk, FIELDS[shape]), unit,
                            metadata={"rollout_ledger.format": fmt}, row_group_bytes=row_group_bytes)
    return ExportResult(out, count)


def export_batch(database_url: str, batch_id: str, out_dir: Path, file_format: str = "jsonl",
                 chunk: int = CHUNK, fmt: str = "openrlhf") -> ExportResult:
    """One batch as ``fmt`` records in ``out_dir/<batch_id>.<file_format>`` (what `rollout demo` writes)."""
    if file_format not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_format!r}; known: {', '.join(FILE_TYPES)}")
    return export(database_url, Selection(batch_ids=(batch_id,)), out_dir / f"{batch_id}.{file_format}", fmt,
                  file_format, chunk=chunk)
