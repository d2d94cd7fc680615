"""Decoding of the rows ``selection.py`` reads: ``array_send`` bytes -> numpy arrays, a whole chunk at a time.

``array_send`` of a one-dimensional array is a 20-byte header (ndim, has-nulls flag, element type, length, lower
bound) and then, per element, a 4-byte length and the big-endian value; an empty array is a 12-byte header. A
chunk's headers are read as one ``(n, 5)`` big-endian table, its bodies joined (without their headers) into one
buffer read as (length, value) records, so a column's values are one strided byte-swapping copy (no Python per
element, little per row), and each row gets a view into the chunk's flat array.

Only ``token_ids`` and ``logprobs`` are shipped (``SHIPPED``): ``loss_mask`` and ``weight_versions`` are derivable
from ``action_ranges`` and one weight version per range (``range_versions``), because ``recorder/assembly.py``
writes ``loss_mask`` 1 exactly on the action ranges and 0 elsewhere, and ``weight_versions`` the turn's version on
its range and -1 elsewhere. ``rebuild_sampled`` rebuilds both for a whole chunk. ``array_send`` costs the server
per element: serialising all four arrays of 100,000 trajectories of 256 tokens took it 2.6 s, the two shipped
ones 1.35 s, plus 0.22 s for ``range_versions`` (``EXPLAIN (ANALYZE, SERIALIZE BINARY)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from rollout_ledger.shared.errors import SchemaError

_HEADER = 20
_EMPTY = 12
ARRAY_COLUMNS: dict[str, tuple[int, np.dtype[Any]]] = {
    "token_ids": (4, np.dtype("<i4")),
    "loss_mask": (2, np.dtype("<i4")),
    "logprobs": (4, np.dtype("<f4")),
    "weight_versions": (4, np.dtype("<i4")),
}
"""The array columns as ``array_send`` bytes: element width on the wire (int4/float4: 4, int2: 2) and numpy type."""

SHIPPED = ("token_ids", "logprobs")
"""The array columns the export reads as ``array_send`` bytes; the other two are rebuilt (``rebuild_sampled``)."""


def _wire(width: int, dtype: np.dtype[Any]) -> np.dtype[Any]:
    """One element on the wire: its 4-byte length, then the big-endian value."""
    value = f">f{width}" if dtype.kind == "f" else f">i{width}"
    return np.dtype([("len", ">i4"), ("value", value)])


def decode_column(raws: Sequence[bytes | memoryview | None], width: int, dtype: np.dtype[Any]) -> list[np.ndarray]:
    """``array_send`` values of one column -> one numpy array per row (views into one flat array)."""
    n = len(raws)
    if n == 0:
        return []
    views = [memoryview(b"") if r is None else memoryview(r) for r in raws]
    sizes = np.fromiter(map(len, views), np.int64, n)
    if np.any((sizes > 0) & (sizes < _EMPTY)):
        raise SchemaError("not an array_send value")
    heads = np.frombuffer(b"".join(v[:_HEADER] if len(v) >= _HEADER else bytes(v) + bytes(_HEADER - len(v))
                                   for v in views), ">i4").reshape(n, 5)
    ndim, flags, counts = heads[:, 0], heads[:, 1], heads[:, 3].astype(np.int64)
    one = ndim == 1
    if np.any((ndim != 0) & ~one) or np.any(flags[one] != 0):
        raise SchemaError("expected one-dimensional arrays without NULLs")
    counts[~one] = 0
    if np.any(sizes[one] != _HEADER + counts[one] * (4 + width)) or np.any(sizes[~one] > _EMPTY):
        raise SchemaError("array_send value of unexpected length")
    pairs = np.frombuffer(b"".join(v[_HEADER:] for v in views), _wire(width, dtype))
    if np.any(pairs["len"] != width):
        raise SchemaError(f"array_send elements are not {width} bytes wide")
    flat = pairs["value"].astype(dtype)
    ends = np.cumsum(counts)
    return [flat[a:b] for a, b in zip((ends - counts).tolist(), ends.tolist(), strict=True)]


def decode_array(raw: bytes | memoryview | None, column: str) -> np.ndarray:
    """One ``array_send`` value of ``column`` (a key of ``ARRAY_COLUMNS``)."""
    width, dtype = ARRAY_COLUMNS[column]
    return decode_column([raw], width, dtype)[0]


def rebuild_sampled(lengths: Sequence[int], ranges: Sequence[Sequence[Sequence[int]]],
                    versions: Sequence[Sequence[int | None]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``loss_mask`` (1 on every range, 0 elsewhere) and ``weight_versions`` (the range's version on it, -1
    elsewhere) of a chunk of rows, from each row's length, ``action_ranges`` and one version per range."""
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
    spans = hi - lo
    total = int(spans.sum())
    at = np.repeat(lo - (np.cumsum(spans) - spans), spans) + np.arange(total, dtype=np.int64)
    mask = np.zeros(int(ends[-1]) if n else 0, np.int32)
    wv = np.full(len(mask), -1, np.int32)
    mask[at] = 1
    wv[at] = np.repeat(vers, spans)
    cuts = list(zip((ends - sizes).tolist(), ends.tolist(), strict=True))
    return [mask[a:b] for a, b in cuts], [wv[a:b] for a, b in cuts]


def decode_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Selected rows (``selection.ROWS_QUERY``) with their arrays decoded, ``loss_mask`` and ``weight_versions``
    rebuilt, and their 2-d arrays as lists of [start, end)."""
    out = [dict(r) for r in rows]
    for name in SHIPPED:
        width, dtype = ARRAY_COLUMNS[name]
        for row, arr in zip(out, decode_column([r[name] for r in rows], width, dtype), strict=True):
            row[name] = arr
    for row in out:
        row["action_ranges"] = row.get("action_ranges") or []
        row["range_versions"] = row.get("range_versions") or []
        row["segments"] = row.get("segments") or [[0, len(row["token_ids"])]]
    masks, versions = rebuild_sampled([len(r["token_ids"]) for r in out], [r["action_ranges"] for r in out],
                                      [r["range_versions"] for r in out])
    for row, mask, wv in zip(out, masks, versions, strict=True):
        row["loss_mask"] = mask
        row["weight_versions"] = wv
    return out
