"""A chunk of selected trajectories held by column (``Chunk``): each per-token array of the whole chunk is one flat
numpy array with row offsets, action ranges and segments are ``FlatRanges``; every other field is an Arrow array
(one value per row; as read, without a Python object per value), JSON fields a list of Python values.

Reading (``source.arrow_chunk``): ``token_ids`` come as the packed little-endian copy
(``trajectories.token_ids_le``, migration 0005), ``logprobs`` as the packed logprobs of the sampled tokens only
(``sampled_logprobs_le``, migration 0008), both read in place from the Arrow batch's buffer (no byte swap, no
per-element work on either side; ``int4[]`` would cost the server one send call per element). ``loss_mask`` and
``weight_versions`` are not read at all, and ``logprobs`` is read only where it can be nonzero: a ``Chunk``
rebuilds them for the whole chunk from the action ranges (with one weight version per range, ``action_versions``)
when first used, because ``recorder/assembly.py`` writes ``loss_mask`` 1 exactly on the action ranges and 0
elsewhere, ``weight_versions`` the turn's version on its range and -1 elsewhere, and ``logprobs`` the engine's
logprob on the ranges and 0.0 elsewhere.

A ``Chunk`` is also a sequence of row dicts (arrays as views into the flat arrays) for per-row code (re-scoring,
tests). ``tables.py`` builds every record shape from the columns directly.
``unpack`` reads packed values row by row (a plain per-row query, as ``bench/export.py``'s straight path).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, overload

import numpy as np
import pyarrow as pa

from rollout_ledger.shared.errors import SchemaError

ARRAYS = ("token_ids", "loss_mask", "logprobs", "weight_versions")
"""The per-token arrays of a row, aligned position by position."""

PACKED = {"token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4")}
"""The arrays read as packed little-endian bytes, and their element type (``logprobs``: the sampled tokens')."""

JSON_FIELDS = ("task", "drifts")
"""Row fields stored as jsonb: a ``Chunk`` holds them as Python values (``Chunk.json``)."""


def unpack(raws: Sequence[bytes | memoryview | None], dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Packed little-endian values of a chunk's rows -> (one flat array, each row's length)."""
    width = dtype.itemsize
    views = [b"" if r is None else r for r in raws]
    sizes = np.fromiter(map(len, views), np.int64, len(views))
    if np.any(sizes % width):
        raise SchemaError(f"packed array is not a whole number of {width}-byte values")
    flat = np.frombuffer(b"".join(views), dtype) if views else np.empty(0, dtype)
    return flat.astype(dtype.newbyteorder("="), copy=False), sizes // width


def _spans(lengths: np.ndarray, bounds: np.ndarray, per_row: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` pairs given per row (``bounds``: k x 2, relative to their row; ``per_row``: how many each
    row has), checked (inside the row, ordered, not overlapping) and moved to chunk positions."""
    if bounds.ndim != 2 or bounds.shape[1] != 2 or len(bounds) != int(per_row.sum()):
        raise SchemaError(f"{what} are not [start, end) pairs")
    sizes = np.asarray(lengths, np.int64)
    row = np.repeat(np.arange(len(sizes)), per_row)
    lo, hi = bounds[:, 0], bounds[:, 1]
    if np.any(lo < 0) or np.any(hi < lo) or np.any(hi > sizes[row]):
        raise SchemaError(f"an entry of {what} lies outside its trajectory")
    starts = (np.cumsum(sizes) - sizes)[row]
    lo, hi = lo + starts, hi + starts
    if np.any(lo[1:] < hi[:-1]):
        raise SchemaError(f"{what} overlap or are out of order")
    return lo, hi


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
    lo, hi = _spans(np.asarray(lengths, np.int64), bounds, per_row, "action ranges")
    return lo, hi, vers


def rebuild_flat(lengths: np.ndarray, ranges: Sequence[Sequence[Sequence[int]]],
                 versions: Sequence[Sequence[int | None]]) -> tuple[np.ndarray, np.ndarray]:
    """``loss_mask`` (1 on every range, 0 elsewhere) and ``weight_versions`` (the range's version on it, -1
    elsewhere) of a chunk of rows laid end to end, from each row's length, ``action_ranges`` and one version per
    range."""
    return mask_and_versions(int(np.sum(lengths)), *flat_ranges(lengths, ranges, versions))


def runs(total: int, lo: np.ndarray, hi: np.ndarray, inside: Any, outside: Any, dtype: Any) -> np.ndarray:
    """``total`` values: ``inside`` (one value, or one per span) on each ``[lo[k], hi[k])``, ``outside``
    elsewhere; the spans sorted and disjoint (``_spans`` checks it). One ``np.repeat`` of the alternating runs:
    no index array per position."""
    k = len(lo)
    lengths = np.empty(2 * k + 1, np.int64)
    lengths[0:-1:2] = lo - np.concatenate(([0], hi[:-1]))
    lengths[1::2] = hi - lo
    lengths[-1] = total - (int(hi[-1]) if k else 0)
    values = np.empty(2 * k + 1, dtype)
    values[0::2] = outside
    values[1::2] = inside
    return np.repeat(values, lengths)


def spread(total: int, lo: np.ndarray, hi: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``total`` float32 values: ``values`` laid on the sorted, disjoint spans ``[lo[k], hi[k])`` in order, 0.0
    elsewhere (the logprobs of a chunk from its sampled tokens' ones)."""
    out = np.zeros(total, np.float32)
    if len(values):
        out[runs(total, lo, hi, True, False, np.bool_)] = values
    return out


def sampled_of(full: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The values of ``full`` on the spans ``[lo[k], hi[k])``, in order (``spread``'s inverse on them)."""
    return full[runs(len(full), lo, hi, True, False, np.bool_)]


REBUILT = {"loss_mask": (1, 0), "weight_versions": (None, -1)}
"""The arrays rebuilt from the action ranges: (value on a range, None for the range's weight version; value
elsewhere)."""


def rebuilt(name: str, total: int, lo: np.ndarray, hi: np.ndarray, vers: np.ndarray) -> np.ndarray:
    """One of ``REBUILT`` for ``total`` positions with action ranges ``[lo, hi)`` and their versions ``vers``."""
    inside, outside = REBUILT[name]
    return runs(total, lo, hi, vers if inside is None else inside, outside, np.int32)


def mask_and_versions(total: int, lo: np.ndarray, hi: np.ndarray, vers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rebuild_flat`` from ``flat_ranges``."""
    return rebuilt("loss_mask", total, lo, hi, vers), rebuilt("weight_versions", total, lo, hi, vers)


def rebuild_sampled(lengths: Sequence[int], ranges: Sequence[Sequence[Sequence[int]]],
                    versions: Sequence[Sequence[int | None]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``rebuild_flat``, cut into one array per row."""
    sizes = np.asarray(lengths, np.int64)
    mask, wv = rebuild_flat(sizes, ranges, versions)
    ends = np.cumsum(sizes)
    cuts = list(zip((ends - sizes).tolist(), ends.tolist(), strict=True))
    return [mask[a:b] for a, b in cuts], [wv[a:b] for a, b in cuts]


def by_code(distinct: Sequence[Any], codes: np.ndarray) -> list[Any]:
    """``[distinct[c] for c in codes]`` without a Python loop over ``codes``: rows that share a value share the
    object (JSON fields parsed or dumped once per distinct value)."""
    values = np.empty(len(distinct), object)
    for i, v in enumerate(distinct):  # one by one: numpy would take a list value for a nested sequence
        values[i] = v
    return values[codes].tolist()


def offsets(counts: np.ndarray, dtype: type[np.integer[Any]] = np.int64) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: where each of ``counts`` consecutive runs starts (and the total)."""
    out: np.ndarray = np.zeros(len(counts) + 1, dtype)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass(frozen=True)
class FlatRanges:
    """``[start, end)`` pairs of every row of a chunk, in chunk positions, row ``i``'s being
    ``[offsets[i], offsets[i + 1])`` of ``lo`` / ``hi`` (action ranges, with ``versions``; segments)."""

    lo: np.ndarray
    hi: np.ndarray
    offsets: np.ndarray
    versions: np.ndarray | None = None


class _Arrays(dict[str, np.ndarray]):
    """A chunk's per-token arrays: ``loss_mask`` and ``weight_versions`` are rebuilt from the action ranges, and
    ``logprobs`` spread from the sampled tokens' ones, when first asked for (a record shape that needs none of them
    never builds them)."""

    def __init__(self, given: dict[str, np.ndarray], total: int, ranges: FlatRanges,
                 sampled_logprobs: np.ndarray | None = None) -> None:
        super().__init__(given)
        self._total, self._ranges, self._sampled = total, ranges, sampled_logprobs

    def __missing__(self, name: str) -> np.ndarray:
        r = self._ranges
        if name == "logprobs" and self._sampled is not None:
            got = self[name] = spread(self._total, r.lo, r.hi, self._sampled)
            return got
        if name not in REBUILT:
            raise KeyError(name)
        assert r.versions is not None
        got = self[name] = rebuilt(name, self._total, r.lo, r.hi, r.versions)
        return got


@dataclass(eq=False)
class Chunk(Sequence[dict[str, Any]]):
    """Selected trajectories by column: ``columns`` (one Arrow array per scalar field: ids, counts...), ``json``
    (the ``JSON_FIELDS`` read, one Python value per row), ``arrays`` (each of ``ARRAYS`` as one flat array of the
    rows laid end to end), ``offsets`` (row ``i`` is ``[offsets[i], offsets[i + 1])`` of every array), and the
    rows' action ranges (with the weight version of each) and segments as flat ``FlatRanges``."""

    columns: dict[str, pa.Array]
    json: dict[str, list[Any]]
    arrays: dict[str, np.ndarray]
    offsets: np.ndarray
    ranges: FlatRanges
    segments: FlatRanges
    _lists: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    def values(self, name: str) -> list[Any]:
        """A scalar or JSON field as one Python value per row (converted once per chunk, for per-row code)."""
        if name in self.json:
            return self.json[name]
        got = self._lists.get(name)
        if got is None:
            got = self._lists[name] = self.columns[name].to_pylist()
        return got

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
        row = {name: self.values(name)[i] for name in (*self.columns, *self.json)}
        row.update({name: self.arrays[name][a:b] for name in ARRAYS})
        r0, r1 = int(self.ranges.offsets[i]), int(self.ranges.offsets[i + 1])
        row["action_ranges"] = (np.stack([self.ranges.lo[r0:r1], self.ranges.hi[r0:r1]], axis=1) - a).tolist()
        assert self.ranges.versions is not None
        row["range_versions"] = [None if v < 0 else v for v in self.ranges.versions[r0:r1].tolist()]
        s0, s1 = int(self.segments.offsets[i]), int(self.segments.offsets[i + 1])
        row["segments"] = (np.stack([self.segments.lo[s0:s1], self.segments.hi[s0:s1]], axis=1) - a).tolist()
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def empty(cls) -> Chunk:
        none = FlatRanges(np.empty(0, np.int64), np.empty(0, np.int64), np.zeros(1, np.int64), np.empty(0, np.int32))
        return cls({}, {}, {name: np.empty(0, np.float32 if name == "logprobs" else np.int32) for name in ARRAYS},
                   np.zeros(1, np.int64), none, none)

    @classmethod
    def build(cls, columns: Mapping[str, Sequence[Any] | pa.Array], token_ids: np.ndarray,
              sampled_logprobs: np.ndarray, lengths: np.ndarray, ranges: np.ndarray, range_counts: np.ndarray,
              versions: np.ndarray, segments: np.ndarray, segment_counts: np.ndarray) -> Chunk:
        """A chunk from its per-row scalar columns (Arrow arrays or sequences; ``JSON_FIELDS`` as Python values), its
        flat token ids (``lengths`` per row), the logprobs of its sampled tokens (those inside the action ranges, in
        order), its action ranges (k x 2, relative to their row; ``range_counts`` per row) with one weight version
        each (-1: none), and its segments (m x 2, ``segment_counts`` per row; a row without any gets one covering
        it): the ranges and segments are checked; ``logprobs``, ``loss_mask`` and ``weight_versions`` rebuilt (when
        first used)."""
        n = len(lengths)
        if int(np.sum(lengths)) != len(token_ids):
            raise SchemaError("token_ids and num_tokens of a trajectory differ in length")
        for name, col in columns.items():
            if len(col) != n:
                raise SchemaError(f"column {name} has {len(col)} values for {n} rows")
        if len(versions) != len(ranges):
            raise SchemaError("one weight version per action range expected")
        lo, hi = _spans(lengths, ranges, range_counts, "action ranges")
        if int((hi - lo).sum()) != len(sampled_logprobs):
            raise SchemaError(f"{len(sampled_logprobs)} sampled logprobs for {int((hi - lo).sum())} sampled tokens")
        if np.any(segment_counts == 0):  # a row without segments is one segment
            per_row = np.split(segments, np.cumsum(segment_counts)[:-1]) if n else []
            segments = np.concatenate([s if len(s) else np.array([[0, k]], np.int64)
                                       for s, k in zip(per_row, lengths.tolist(), strict=True)]).reshape(-1, 2)
            segment_counts = np.maximum(segment_counts, 1)
        seg_lo, seg_hi = _spans(lengths, segments, segment_counts, "segments")
        vers = versions.astype(np.int32)
        arrow = {name: col if isinstance(col, pa.Array) else pa.array(list(col))
                 for name, col in columns.items() if name not in JSON_FIELDS}
        json = {name: list(col) for name, col in columns.items() if name in JSON_FIELDS}
        spans = FlatRanges(lo, hi, offsets(range_counts), vers)
        return cls(arrow, json, _Arrays({"token_ids": token_ids}, len(token_ids), spans, sampled_logprobs),
                   offsets(lengths), spans, FlatRanges(seg_lo, seg_hi, offsets(segment_counts)))

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> Chunk:
        """A chunk of row dicts holding numpy/list arrays (tests, examples): ``logprobs``, ``loss_mask`` and
        ``weight_versions`` are taken as given (they must agree with the ranges), ``range_versions`` derived from
        them when missing."""
        lengths = np.fromiter((len(r["token_ids"]) for r in rows), np.int64, len(rows))
        ranges = [r.get("action_ranges") or [] for r in rows]
        versions = [r["range_versions"] if r.get("range_versions") is not None else
                    [int(r["weight_versions"][a]) if b > a else None for a, b in rr]
                    for r, rr in zip(rows, ranges, strict=True)]
        segments = [r.get("segments") or [] for r in rows]
        skip = {*ARRAYS, "action_ranges", "range_versions", "segments"}
        names = [k for k in (rows[0] if rows else {}) if k not in skip]
        columns: dict[str, Sequence[Any]] = {k: [r.get(k) for r in rows] for k in names}

        def flat(values: Sequence[Sequence[Any]]) -> np.ndarray:
            return np.array(list(chain.from_iterable(values)), np.int64).reshape(-1, 2)

        def cat(name: str, dt: type) -> np.ndarray:
            return np.concatenate([np.asarray(r[name], dt) for r in rows]) if rows else np.empty(0, dt)

        logprobs = cat("logprobs", np.float32)
        if len(logprobs) != int(lengths.sum()):
            raise SchemaError("token_ids and logprobs of a trajectory differ in length")
        range_counts = np.fromiter(map(len, ranges), np.int64, len(rows))
        lo, hi = _spans(lengths, flat(ranges), range_counts, "action ranges")
        chunk = cls.build(columns, cat("token_ids", np.int32), sampled_of(logprobs, lo, hi), lengths, flat(ranges),
                          range_counts, np.array([-1 if v is None else v for v in chain.from_iterable(versions)],
                                                 np.int64),
                          flat(segments), np.fromiter(map(len, segments), np.int64, len(rows)))
        chunk.arrays["logprobs"] = logprobs
        chunk.arrays["loss_mask"] = cat("loss_mask", np.int32)
        chunk.arrays["weight_versions"] = cat("weight_versions", np.int32)
        return chunk
