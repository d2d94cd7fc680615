"""Streams a batch's trajectories out of Postgres in chunks and writes them as JSONL or Parquet."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import create_engine, select

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.exporter.records import openrlhf_record
from rollout_ledger.shared.db import episodes, trajectories

FILE_FORMATS = ("jsonl", "parquet")


@dataclass
class ExportResult:
    path: Path
    records: int


def iter_rows(database_url: str, batch_id: str, chunk: int = 500) -> Iterator[dict[str, Any]]:
    """Trajectory rows of a batch joined with their episode, streamed with a server-side cursor."""
    engine = create_engine(sync_url(database_url))
    query = (
        select(trajectories, episodes.c.task, episodes.c.prompt_text)
        .join(episodes, episodes.c.id == trajectories.c.episode_id)
        .where(trajectories.c.batch_id == batch_id)
        .order_by(trajectories.c.group_id, trajectories.c.episode_id)
    )
    try:
        with engine.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=chunk).execute(query)
            for row in result:
                yield dict(row._mapping)
    finally:
        engine.dispose()


def export_batch(database_url: str, batch_id: str, out_dir: Path, file_format: str = "jsonl",
                 chunk: int = 500) -> ExportResult:
    """Write one OpenRLHF-shaped record per trajectory of ``batch_id`` to ``out_dir/<batch_id>.<format>``."""
    if file_format not in FILE_FORMATS:
        raise ValueError(f"unknown format {file_format!r}; known: {', '.join(FILE_FORMATS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{batch_id}.{file_format}"
    tmp = path.with_suffix(path.suffix + ".partial")
    count = 0
    records = (openrlhf_record(row) for row in iter_rows(database_url, batch_id, chunk))
    if file_format == "jsonl":
        with open(tmp, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec, separators=(",", ":")))
                fh.write("\n")
                count += 1
    else:
        writer: pq.ParquetWriter | None = None
        buf: list[dict[str, Any]] = []
        try:
            for rec in records:
                buf.append(_parquet_row(rec))
                count += 1
                if len(buf) >= chunk:
                    writer = _write_chunk(writer, tmp, buf)
                    buf = []
            if buf or writer is None:
                writer = _write_chunk(writer, tmp, buf)
        finally:
            if writer is not None:
                writer.close()
    tmp.replace(path)
    return ExportResult(path, count)


PARQUET_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("group_id", pa.string()), ("batch_id", pa.string()), ("env", pa.string()),
    ("attempt", pa.int32()), ("prompt", pa.string()), ("label", pa.string()),
    ("observation_tokens", pa.list_(pa.int32())), ("action_ranges", pa.list_(pa.list_(pa.int32()))),
    ("rollout_log_probs", pa.list_(pa.float32())), ("truncated", pa.bool_()), ("reward", pa.float64()),
    ("status", pa.string()), ("extra_logs", pa.string()),
])


def _parquet_row(rec: dict[str, Any]) -> dict[str, Any]:
    row = {k: rec[k] for k in PARQUET_SCHEMA.names if k != "extra_logs"}
    row["extra_logs"] = json.dumps(rec["extra_logs"])
    return row


def _write_chunk(writer: pq.ParquetWriter | None, path: Path, rows: list[dict[str, Any]]) -> pq.ParquetWriter:
    table = pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA)
    if writer is None:
        writer = pq.ParquetWriter(str(path), PARQUET_SCHEMA)
    writer.write_table(table)
    return writer
