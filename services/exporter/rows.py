"""Decoding of the rows ``selection.py`` reads: ``array_send`` bytes -> numpy arrays, a whole chunk at a time.

``array_send`` of a one-dimensional array is a 20-byte header (ndim, has-nulls flag, element type, length, lower
bound) and then, per element, a 4-byte length and the big-endian value; an empty array is a 12-byte header. A
chunk's values of one column are gathered with one numpy fancy-index over the concatenated bytes (no Python per
element, little per row), and each row gets a view into the chunk's flat array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout_ledger.shared.errors import SchemaError

_HEADER = 20
ARRAY_COLUMNS: dict[str, tuple[int, np.dtype[Any]]] = {
    "token_ids": (4, np.dtype("<i4")),
    "loss_mask": (2, np.dtype("<i4")),
    "logprobs": (4, np.dtype("<f4")),
    "weight_versions": (4, np.dtype("<i4")),
}
"""The columns read as ``array_send`` bytes: element width on the wire (int4/float4: 4, int2: 2) and numpy type."""


def _be(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Big-endian unsigned integers of ``width`` bytes at byte positions ``pos``."""
    out = np.zeros(len(pos), np.uint32)
    for k in range(width):
        out = (out << 8) | buf[pos + k].astype(np.uint32)
    return out


def decode_column(raws: Sequence[bytes | memoryview | None], width: int, dtype: np.dtype[Any]) -> list[np.ndarray]:
    """``array_send`` values of one column -> one numpy array per row (views into one flat array)."""
    n = len(raws)
    chunks = [b"" if r is None else bytes(r) for r in raws]
    sizes = np.fromiter((len(c) for c in chunks), np.int64, n)
    if n == 0:
        return []
    buf = np.frombuffer(b"".join(chunks), np.uint8)
    starts = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    present = sizes >= 12
    if np.any(sizes[present] < 12) or np.any((sizes > 0) & ~present):
        raise SchemaError("not an array_send value")
    ndim = np.zeros(n, np.uint32)
    ndim[present] = _be(buf, starts[present], 4)
    one = ndim == 1
    if np.any(ndim > 1) or np.any(_be(buf, starts[one] + 4, 4) != 0):
        raise SchemaError("expected one-dimensional arrays without NULLs")
    counts = np.zeros(n, np.int64)
    counts[one] = _be(buf, starts[one] + 12, 4)
    if np.any(sizes[one] != _HEADER + counts[one] * (4 + width)):
        raise SchemaError("array_send value of unexpected length")
    total = int(counts.sum())
    ends = np.cumsum(counts)
    first = ends - counts
    within = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
    pos = np.repeat(starts + _HEADER + 4, counts) + within * (4 + width)
    if width == 4 and not np.any(sizes % 4):
        raw = np.frombuffer(buf.data, ">u4")[pos // 4].astype(np.uint32)  # aligned: one gather
    else:
        raw = _be(buf, pos, width)
    if dtype.kind == "f":
        flat = raw.view(np.float32).astype(dtype, copy=False)
    elif width == 2:
        flat = raw.astype(np.uint16).view(np.int16).astype(dtype)
    else:
        flat = raw.view(np.int32).astype(dtype, copy=False)
    return [flat[a:b] for a, b in zip(first.tolist(), ends.tolist(), strict=True)]


def decode_array(raw: bytes | memoryview | None, column: str) -> np.ndarray:
    """One ``array_send`` value of ``column`` (a key of ``ARRAY_COLUMNS``)."""
    width, dtype = ARRAY_COLUMNS[column]
    return decode_column([raw], width, dtype)[0]


def decode_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Selected rows with their array columns decoded and their 2-d arrays as lists of [start, end)."""
    out = [dict(r) for r in rows]
    for name, (width, dtype) in ARRAY_COLUMNS.items():
        for row, arr in zip(out, decode_column([r[name] for r in rows], width, dtype), strict=True):
            row[name] = arr
    for row in out:
        row["action_ranges"] = row.get("action_ranges") or []
        row["segments"] = row.get("segments") or [[0, len(row["token_ids"])]]
    return out
