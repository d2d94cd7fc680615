"""A chunk of selected trajectories held by column (``Chunk``): each per-token array of the whole chunk is one flat
numpy array with row offsets; every other field is a list with one value per row.

Reading: ``selection.rows_query`` returns ``token_ids`` and ``logprobs`` as the packed little-endian copies
(``trajectories.token_ids_le`` / ``logprobs_le``, migration 0005): a chunk's values are joined into one buffer and
read with ``numpy.frombuffer`` (no byte swap, no per-element work on either side; ``int4[]`` would cost the server
one send call per element). ``loss_mask`` and ``weight_versions`` are not read at all: ``rebuild_sampled`` derives
them for the whole chunk from ``action_ranges`` and one weight version per range (``range_versions``), because
``recorder/assembly.py`` writes ``loss_mask`` 1 exactly on the action ranges and 0 elsewhere, and
``weight_versions`` the turn's version on its range and -1 elsewhere.

A ``Chunk`` is also a sequence of row dicts (arrays as views into the flat arrays) for per-row code: the
``records.py`` mappers, JSONL, re-scoring. ``tables.py`` builds Arrow tables from the columns directly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, overload

import numpy as np

from rollout_ledger.shared.errors import SchemaError

ARRAYS = ("token_ids", "loss_mask", "logprobs", "weight_versions")
"""The per-token arrays of a row, aligned position by position."""

PACKED = {"token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4")}
"""The arrays read as packed little-endian bytes, and their element type."""


def unpack(raws: Sequence[bytes | memoryview | None], dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Packed little-endian values of a chunk's rows -> (one flat array, each row's length)."""
    width = dtype.itemsize
    views = [b"" if r is None else r for r in raws]
    sizes = np.fromiter(map(len, views), np.int64, len(views))
    if np.any(sizes % width):
        raise SchemaError(f"packed array is not a whole number of {width}-byte values")
    flat = np.frombuffer(b"".join(views), dtype) if views else np.empty(0, dtype)
    return flat.astype(dtype.newbyteorder("="), copy=False), sizes // width


def flat_ranges(lengths: np.ndarray, ranges: Sequence[Sequence[Sequence[int]]],
                versions: Sequence[Sequence[int | None]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every action range of a chunk of rows laid end to end, checked: (start, end, weight version) as arrays in
    chunk positions (a range without a version gets -1)."""
    n = len(lengths)
    if len(ranges) != n or len(versions) != n:
        raise SchemaError("rebuild_sampled: lengths, ranges and versions differ in number of rows")
    per_row = np.fromiter(map(len, ranges), np.int64, n)
    if any(len(v) != k for v, k in zip(versions, per_row.tolist(), strict=True)):
        raise SchemaError("one weight version per action range expected")
    try:
        bounds = np.array(list(chain.from_iterable(ranges)), np.int64).reshape(-1, 2)
        # an empty range may have no version (NULL when it sits at the very end); it marks no position
        vers = np.array([-1 if v is None else v for v in chain.from_iterable(versions)], np.int32)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"action ranges or their weight versions are malformed: {exc}") from exc
    if len(bounds) != per_row.sum():
        raise SchemaError("action ranges are not [start, end) pairs")
    sizes = np.asarray(lengths, np.int64)
    ends = np.cumsum(sizes)
    starts = np.repeat(ends - sizes, per_row)
    lo, hi = bounds[:, 0], bounds[:, 1]
    if np.any(lo < 0) or np.any(hi < lo) or np.any(hi > np.repeat(sizes, per_row)):
        raise SchemaError("an action range lies outside its trajectory")
    lo, hi = lo + starts, hi + starts
    if np.any(lo[1:] < hi[:-1]):
        raise SchemaError("action ranges overlap or are out of order")
    return lo, hi, vers


def rebuild_flat(lengths: np.ndarray, ranges: Sequence[Sequence[Sequence[int]]],
                 versions: Sequence[Sequence[int | None]]) -> tuple[np.ndarray, np.ndarray]:
    """``loss_mask`` (1 on every range, 0 elsewhere) and ``weight_versions`` (the range's version on it, -1
    elsewhere) of a chunk of rows laid end to end, from each row's length, ``action_ranges`` and one version per
    range."""
    return mask_and_versions(int(np.sum(lengths)), *flat_ranges(lengths, ranges, versions))


def mask_and_versions(total: int, lo: np.ndarray, hi: np.ndarray, vers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rebuild_flat`` from ``flat_ranges``."""
    spans = hi - lo
    count = int(spans.sum())
    at = np.repeat(lo - (np.cumsum(spans) - spans), spans) + np.arange(count, dtype=np.int64)
    mask = np.zeros(total, np.int32)
    wv = np.full(total, -1, np.int32)
    mask[at] = 1
    wv[at] = np.repeat(vers, spans)
    return mask, wv


def rebuild_sampled(lengths: Sequence[int], ranges: Sequence[Sequence[Sequence[int]]],
                    versions: Sequence[Sequence[int | None]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``rebuild_flat``, cut into one array per row."""
    sizes = np.asarray(lengths, np.int64)
    mask, wv = rebuild_flat(sizes, ranges, versions)
    ends = np.cumsum(sizes)
    cuts = list(zip((ends - sizes).tolist(), ends.tolist(), strict=True))
    return [mask[a:b] for a, b in cuts], [wv[a:b] for a, b in cuts]


@dataclass(eq=False)
class Chunk(Sequence[dict[str, Any]]):
    """Selected trajectories by column: ``columns`` (one list per field: ids, scalars, ``action_ranges``,
    ``segments``, ``range_versions``, ``task``...), ``arrays`` (each of ``ARRAYS`` as one flat array of the rows
    laid end to end) and ``offsets`` (row ``i`` is ``[offsets[i], offsets[i + 1])`` of every array)."""

    columns: dict[str, list[Any]]
    arrays: dict[str, np.ndarray]
    offsets: np.ndarray
    ranges: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Every action range as ``flat_ranges`` gives it: (start, end, weight version) in chunk positions."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        row = {name: col[i] for name, col in self.columns.items()}
        row.update({name: arr[a:b] for name, arr in self.arrays.items()})
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def empty(cls) -> Chunk:
        none = np.empty(0, np.int64)
        return cls({}, {name: np.empty(0, np.float32 if name == "logprobs" else np.int32) for name in ARRAYS},
                   np.zeros(1, np.int64), (none, none, np.empty(0, np.int32)))

    @classmethod
    def build(cls, columns: dict[str, list[Any]], token_ids: np.ndarray, logprobs: np.ndarray,
              lengths: np.ndarray) -> Chunk:
        """A chunk from its per-row columns (which must hold ``action_ranges`` and ``range_versions``; missing
        ``segments`` become one segment per row) and its two flat sampled arrays: ``loss_mask`` and
        ``weight_versions`` are rebuilt."""
        n = len(lengths)
        if len(token_ids) != len(logprobs) or int(np.sum(lengths)) != len(token_ids):
            raise SchemaError("token_ids and logprobs of a trajectory differ in length")
        for name, col in columns.items():
            if len(col) != n:
                raise SchemaError(f"column {name} has {len(col)} values for {n} rows")
        lens = lengths.tolist()
        columns["action_ranges"] = [r or [] for r in columns.get("action_ranges", [None] * n)]
        columns["range_versions"] = [v or [] for v in columns.get("range_versions", [None] * n)]
        columns["segments"] = [s or [[0, k]] for s, k in zip(columns.get("segments", [None] * n), lens,
                                                             strict=True)]
        ranges = flat_ranges(lengths, columns["action_ranges"], columns["range_versions"])
        mask, wv = mask_and_versions(len(token_ids), *ranges)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(columns, {"token_ids": token_ids, "loss_mask": mask, "logprobs": logprobs,
                             "weight_versions": wv}, offsets, ranges)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> Chunk:
        """A chunk of row dicts holding numpy/list arrays (tests, examples): ``loss_mask`` and ``weight_versions``
        are taken as given, ``range_versions`` derived from them when missing."""
        names = [k for k in (rows[0] if rows else {}) if k not in ARRAYS]
        columns: dict[str, list[Any]] = {k: [r.get(k) for r in rows] for k in names}
        if "range_versions" not in columns:
            columns["range_versions"] = [
                [int(r["weight_versions"][a]) if b > a else None for a, b in r.get("action_ranges") or []]
                for r in rows]
        lengths = np.fromiter((len(r["token_ids"]) for r in rows), np.int64, len(rows))
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrays = {name: np.concatenate([np.asarray(r[name], dt) for r in rows]) if rows else np.empty(0, dt)
                  for name, dt in (("token_ids", np.int32), ("loss_mask", np.int32), ("logprobs", np.float32),
                                   ("weight_versions", np.int32))}
        n = len(rows)
        columns["action_ranges"] = [r or [] for r in columns.get("action_ranges", [None] * n)]
        columns["segments"] = [s or [[0, k]] for s, k in zip(columns.get("segments", [None] * n), lengths.tolist(),
                                                             strict=True)]
        return cls(columns, arrays, offsets, flat_ranges(lengths, columns["action_ranges"],
                                                         columns["range_versions"]))
