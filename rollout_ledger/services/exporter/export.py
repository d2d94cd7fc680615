"""One-shot export: a selection's trajectories streamed out of Postgres into one Parquet or JSONL file (a trainer
shape or the full record, by chunk; ATIF, one validated document per trajectory), followed by those of archived
periods (``client/archived.py``: what `rollout archive` moved to Parquet)."""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_ledger.client.archived import ArchiveError, archived_chunks, archived_periods
from rollout_ledger.client.records import DOCUMENT_FORMATS, FIELDS, FORMATS, Unit
from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import CHUNK, connect, stream
from rollout_ledger.services.exporter.writers import FILE_TYPES, ROW_GROUP_BYTES, write_file, write_jsonl

FILE_FORMATS = FILE_TYPES


@dataclass
class ExportResult:
    path: Path
    records: int


def shape_and_file_type(fmt: str, file_type: str | None) -> tuple[str, str]:
    """``--format`` (+ ``--file-type``) -> (record shape, file type): ``parquet``/``jsonl`` are the full record; a
    document format (``atif``) is its own shape, JSONL only."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt in FILE_TYPES:
        if file_type not in (None, fmt):
            raise ValueError(f"format {fmt} is a file type already; drop --file-type {file_type}")
        return "full", fmt
    if fmt in DOCUMENT_FORMATS:
        if file_type not in (None, "jsonl"):
            raise ValueError(f"format {fmt} is written as JSONL only (one JSON document per trajectory per line); "
                             f"drop --file-type {file_type}")
        return fmt, "jsonl"
    ft = file_type or "parquet"
    if ft not in FILE_TYPES:
        raise ValueError(f"unknown file type {ft!r}; known: {', '.join(FILE_TYPES)}")
    return fmt, ft


def atif_documents(database_url: str, chunks: Iterable[Chunk]) -> Generator[dict[str, Any], None, None]:
    """The validated ATIF document of every trajectory of ``chunks`` (read with ``atif.ROW_FIELDS``), in order: each
    chunk's kept turns in one query, then ``atif.document`` per trajectory (a ``SchemaError`` naming the first
    trajectory that cannot be mapped or does not validate)."""
    # imported here: only this format needs the ``atif`` package (a base dependency, for the exporter alone)
    from rollout_ledger.services.exporter.atif import document
    from rollout_ledger.services.exporter.kept_turns import kept_turns

    with connect(database_url, autocommit=True) as conn:
        for chunk in chunks:
            kept = kept_turns(conn, chunk)
            for row in chunk:
                yield document(row, kept.get((row["episode_id"], int(row["attempt"])), []))


def export(database_url: str, sel: Selection, path: Path, fmt: str = "openrlhf", file_type: str | None = None,
           unit: Unit = Unit.SEGMENT, chunk: int = CHUNK, row_group_bytes: int = ROW_GROUP_BYTES) -> ExportResult:
    """Write every selected trajectory as ``fmt`` records to ``path`` (atomically; memory bounded by ``chunk``
    and ``row_group_bytes``). ``atif`` writes one document per trajectory whatever ``unit``."""
    shape, ft = shape_and_file_type(fmt, file_type)
    if shape == "atif":
        from rollout_ledger.services.exporter.atif import ROW_FIELDS

        if sel.batch_ids and archived_periods(database_url, sel):  # over the whole store: what Postgres holds
            raise ArchiveError("ATIF needs each trajectory's recorded turns, and archived periods hold trajectories "
                               "of these batches: export them in a record format (their turns are in the "
                               "archive's turns.parquet)")
        chunks = stream(database_url, sel, chunk, ROW_FIELDS)
        docs = atif_documents(database_url, chunks)
        try:
            out, count = write_jsonl(path, docs)
        finally:  # an export that failed closes its connections now, not when its traceback is dropped
            docs.close()
            chunks.close()
        return ExportResult(out, count)
    live = stream(database_url, sel, chunk, FIELDS[shape])
    every: Iterator[Chunk] = itertools.chain(live, archived_chunks(database_url, sel, FIELDS[shape], chunk))
    try:
        out, count = write_file(path, ft, shape, every, unit, metadata={"rollout_ledger.format": fmt},
                                row_group_bytes=row_group_bytes)
    finally:
        live.close()
    return ExportResult(out, count)


def export_batch(database_url: str, batch_id: str, out_dir: Path, file_format: str = "jsonl",
                 chunk: int = CHUNK, fmt: str = "openrlhf") -> ExportResult:
    """One batch as ``fmt`` records in ``out_dir/<batch_id>.<file_format>`` (what `rollout demo` writes)."""
    if file_format not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_format!r}; known: {', '.join(FILE_TYPES)}")
    return export(database_url, Selection(batch_ids=(batch_id,)), out_dir / f"{batch_id}.{file_format}", fmt,
                  file_format, chunk=chunk)
