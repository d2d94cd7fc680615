"""Reads archived periods back: the filesystem of an archive URL, its manifest, and the archived trajectories of a
selection as ``Chunk``s (what `rollout export` and ``TrajectoryReader.archived`` add to what Postgres still holds).

`rollout archive` (``services/exporter/archive.py``) writes each period's trajectories in the shape a one-shot
export reads (``selection.stream_query``'s ``KEY_COLUMNS`` and every row field, with the default selection's reward
and advantage), so a chunk of archived rows is built by the same ``source.arrow_chunk`` as a chunk of live rows.
The ``archives`` table (migration 0016) says which periods were archived, where, and which batches they hold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.selection import KEY_COLUMNS, Selection, stream_query
from rollout_ledger.client.source import CHUNK, arrow_chunk, connect, rechunked
from rollout_ledger.shared.errors import RolloutError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAJECTORIES = "trajectories"
"""The manifest's name for the archived trajectories (export-shaped rows, not the table's columns)."""
ENDPOINT_ENV = "ROLLOUT_ARCHIVE_S3_ENDPOINT"
"""An S3-compatible endpoint (``http://host:port``) for ``s3://`` archive URLs (else AWS's own)."""


class ArchiveError(RolloutError):
    """An archive could not be written, verified or read (a bad URL, a missing or altered file, a selection the
    archived rows cannot answer)."""


@dataclass(frozen=True)
class Location:
    """An archive URL opened as a pyarrow filesystem and a root path inside it."""

    fs: pafs.FileSystem
    root: str
    url: str

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"


def open_location(url: str, endpoint: str | None = None) -> Location:
    """``file:///abs/path`` or ``s3://bucket/prefix`` (``endpoint``, else ``ROLLOUT_ARCHIVE_S3_ENDPOINT``, for an
    S3-compatible server; credentials from the usual ``AWS_*`` variables)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if not parts.path.startswith("/") or parts.netloc not in ("", "localhost"):
            raise ArchiveError(f"archive URL {url!r}: a file URL needs an absolute path (file:///abs/path)")
        return Location(pafs.LocalFileSystem(), parts.path, url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ArchiveError(f"archive URL {url!r}: an S3 URL needs a bucket (s3://bucket/prefix)")
        endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
        options: dict[str, Any] = {}
        if endpoint:
            ep = urlsplit(endpoint)
            if ep.scheme not in ("http", "https") or not ep.netloc:
                raise ArchiveError(f"S3 endpoint {endpoint!r} must be http(s)://host[:port]")
            options.update(endpoint_override=ep.netloc, scheme=ep.scheme)
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
        if region:
            options["region"] = region
        return Location(pafs.S3FileSystem(**options), f"{parts.netloc}{parts.path}".rstrip("/"), url)
    raise ArchiveError(f"archive URL {url!r}: use file:///abs/path or s3://bucket/prefix")


def sha256(loc: Location, name: str) -> str:
    digest = hashlib.sha256()
    with loc.fs.open_input_stream(loc.path(name)) as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(loc: Location) -> dict[str, Any]:
    try:
        with loc.fs.open_input_stream(loc.path(MANIFEST)) as f:
            doc = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"cannot read the manifest at {loc.url_of(MANIFEST)}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise ArchiveError(f"{loc.url_of(MANIFEST)} is not an archive manifest")
    return doc


def _plain(sel: Selection) -> bool:
    """Only row filters an archived row answers by itself (batch, env, status, time range)."""
    return replace(sel, batch_ids=(), envs=(), statuses=(), since=None, until=None) == Selection()


def _filtered(table: pa.Table, sel: Selection) -> pa.Table:
    mask = pa.array([True] * table.num_rows)
    for column, values in (("batch_id", sel.batch_ids), ("env", sel.envs), ("status", sel.statuses)):
        if values:
            mask = pc.and_(mask, pc.is_in(table.column(column), pa.array(list(values), pa.string())))
    for bound, op in ((sel.since, pc.greater_equal), (sel.until, pc.less)):
        if bound is not None:
            mask = pc.and_(mask, op(table.column("created_at"), pa.scalar(bound, table.column("created_at").type)))
    return table.filter(mask)


def archived_periods(database_url: str, sel: Selection) -> list[tuple[str, dict[str, Any]]]:
    """(URL, tables) of every archived period that may hold trajectories of ``sel`` (by its batches), oldest
    first."""
    with connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT url, tables FROM archives WHERE %(b)s::text[] = '{}' OR batch_ids && %(b)s::text[] "
            "ORDER BY period_start", {"b": list(sel.batch_ids)}).fetchall()
    return [(str(url), dict(tables)) for url, tables in rows]


def archived_chunks(database_url: str, sel: Selection, fields: tuple[str, ...] | None = None,
                    chunk: int = CHUNK, endpoint: str | None = None) -> Iterator[Chunk]:
    """The archived trajectories ``sel`` selects, in chunks of at most ``chunk`` rows, period by period (each in
    (group, episode) order), streamed from the file (memory bounded by the chunk). Each file is checked against its
    manifest's checksum before it is read. Archived rows answer batch, env, status and time filters only (reward,
    advantage and group filters are SQL over rows no longer in Postgres): such a selection naming archived batches
    is an ``ArchiveError``; one over the whole store leaves the archived periods out (logged)."""
    periods = archived_periods(database_url, sel)
    if periods and not _plain(sel):
        if sel.batch_ids:
            raise ArchiveError("archived periods hold trajectories of these batches; only batch, env, status and "
                               "time filters can be applied to archived rows (export those with a plain selection)")
        log.warning("%d archived periods left out: the selection's reward, advantage or group filters need SQL "
                    "over stored rows", len(periods))
        return
    _, _, names = stream_query(Selection(), fields)
    for url, _tables in periods:
        loc = open_location(url, endpoint)
        manifest = read_manifest(loc)
        entry = manifest["files"].get(TRAJECTORIES)
        if entry is None:
            continue
        if sha256(loc, entry["path"]) != entry["sha256"]:
            raise ArchiveError(f"{loc.url_of(entry['path'])} does not match its manifest's checksum")
        try:
            source = pq.ParquetFile(loc.fs.open_input_file(loc.path(entry["path"])))
        except OSError as exc:
            raise ArchiveError(f"cannot read {loc.url_of(entry['path'])}: {exc}") from exc
        if not source.metadata.num_rows:
            continue
        keep = [c for c in source.schema_arrow.names if c in (*KEY_COLUMNS, *names)]
        needed = sorted({*keep, "batch_id", "env", "status", "created_at"} & set(source.schema_arrow.names))
        selected = (_filtered(pa.Table.from_batches([b]), sel).select(keep).to_batches()
                    for b in source.iter_batches(batch_size=chunk, columns=needed))
        for batch in rechunked((b for got in selected for b in got), chunk):
            yield arrow_chunk(batch, names, "rollout")
