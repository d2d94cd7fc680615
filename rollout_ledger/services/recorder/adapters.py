"""The psycopg adapters of the recorder's connections: numpy-encoded ``int4[]`` / ``float4[]`` / ``int2[]`` COPY
columns and parameters, numpy-decoded ``int4[]`` / ``float4[]`` results, and range-checked ``int4`` / ``float4``
and orjson ``jsonb`` COPY columns.

The store declares each COPY'd table once (column, Postgres type, source) and hands rows to psycopg's
``Copy.write_row``, which frames them in C; ``register`` makes the dumpers here the ones psycopg picks by type
after ``Copy.set_types``. What is hand-written here, and why (``bench/recorder_copy.py``, docs/benchmarks.md,
"Recorder COPY"):

- arrays: psycopg dumps a Python list element by element (and an ndarray not at all); one numpy pass writes a
  whole ``int4[]`` (each element a 4-byte length then the big-endian value): psycopg's lists encoded 4.5-37x
  slower and COPY'd 2.3-3.5x slower end to end. Results load back the same way (2.4x as fast as lists);
- ``int4`` and ``float4`` scalars, for correctness rather than speed: psycopg's C dumpers (3.3) write 2**32 + 1
  as 1 and 1e300 as infinity without a word; these raise instead, as ``struct`` does (NaN and infinities pass);
- ``jsonb``: orjson (non-string keys, numpy values) as the recorder has always written it.

A value that does not fit its column raises ``EncodeError`` (a ``ValueError``); the store turns it into a
non-retryable ``StoreError`` so the batch is replayed message by message and only the offending message is
dead-lettered, as with a server-side data error.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Dumper, Loader
from psycopg.pq import Format
from psycopg.types.json import JsonbBinaryDumper

INT2_OID, INT4_OID, FLOAT4_OID = 21, 23, 700
INT2_ARRAY_OID, INT4_ARRAY_OID, FLOAT4_ARRAY_OID = 1005, 1007, 1021

_I4 = struct.Struct(">i")
_F4 = struct.Struct(">f")
_HEAD = struct.Struct(">iii")  # ndim, has_nulls=0, element oid (ndim=0: an empty array, nothing follows)
_DIM = struct.Struct(">ii")  # length, lower bound=1 (one per dimension)

_PAIR_I4 = np.dtype([("n", ">i4"), ("v", ">i4")])
_PAIR_F4 = np.dtype([("n", ">i4"), ("v", ">f4")])
_PAIR_I2 = np.dtype([("n", ">i4"), ("v", ">i2")])


class EncodeError(ValueError):
    """A value cannot be encoded for its column."""


def _array(arr: np.ndarray, oid: int, pair: np.dtype[Any], size: int) -> bytes:
    if arr.size == 0:
        return _HEAD.pack(0, 0, oid)
    body = np.empty(arr.size, pair)
    body["n"] = size
    body["v"] = arr.ravel()
    return _HEAD.pack(arr.ndim, 0, oid) + b"".join(_DIM.pack(n, 1) for n in arr.shape) + body.tobytes()


def int4_array(values: Any) -> bytes:
    """Binary ``int4[]`` of an integer array of any shape (a 2-d one: ``action_ranges``, ``segments``); values
    must fit in int32, rows must be of equal length."""
    try:
        arr = np.asarray(values)
    except ValueError as exc:
        raise EncodeError(f"int4 array: {exc}") from exc
    if arr.size and arr.dtype != np.int32:
        if arr.dtype.kind not in "iub":
            raise EncodeError(f"int4 array of {arr.dtype}")
        if arr.min() < -(2**31) or arr.max() >= 2**31:
            raise EncodeError("int4 array value out of range")
    return _array(arr, INT4_OID, _PAIR_I4, 4)


def float4_array(values: Any) -> bytes:
    """Binary ``float4[]`` of a 1-d float array."""
    return _array(np.asarray(values, dtype=np.float32), FLOAT4_OID, _PAIR_F4, 4)


def int2_array(values: Any) -> bytes:
    """Binary ``int2[]`` of a 1-d array of small integers (a loss mask)."""
    return _array(np.asarray(values, dtype=np.int16), INT2_OID, _PAIR_I2, 2)


def parse_array(data: Buffer, dtype: str) -> np.ndarray:
    """A 1-d binary ``int4[]`` (``dtype`` ``<i4``) or ``float4[]`` (``<f4``) value as a numpy array."""
    buf = bytes(data)
    ndim, has_nulls = _I4.unpack_from(buf, 0)[0], _I4.unpack_from(buf, 4)[0]
    if ndim == 0:
        return np.zeros(0, dtype=dtype)
    if ndim != 1 or has_nulls:
        raise EncodeError(f"expected a 1-d array without NULLs, got ndim={ndim} has_nulls={has_nulls}")
    n = _I4.unpack_from(buf, 12)[0]
    pairs = np.frombuffer(buf, dtype=_PAIR_I4 if dtype == "<i4" else _PAIR_F4, count=n, offset=20)
    return pairs["v"].astype(dtype)


class Int4Array:
    """An ``int4[]`` query parameter (``%b``), encoded and range-checked when made."""

    __slots__ = ("data",)

    def __init__(self, values: Any) -> None:
        self.data = int4_array(values)


class _Int4ArrayParamDumper(Dumper):
    format = Format.BINARY
    oid = INT4_ARRAY_OID

    def dump(self, obj: Int4Array) -> Buffer:
        return obj.data


class Int4ArrayDumper(Dumper):
    """``int4[]`` COPY column (``set_types``) of an integer array or nested list, through numpy."""

    format = Format.BINARY
    oid = INT4_ARRAY_OID

    def dump(self, obj: Any) -> Buffer:
        return int4_array(obj)


class Float4ArrayDumper(Dumper):
    """``float4[]`` COPY column of a float array, through numpy."""

    format = Format.BINARY
    oid = FLOAT4_ARRAY_OID

    def dump(self, obj: Any) -> Buffer:
        return float4_array(obj)


class Int2ArrayDumper(Dumper):
    """``int2[]`` COPY column of a small-integer array, through numpy."""

    format = Format.BINARY
    oid = INT2_ARRAY_OID

    def dump(self, obj: Any) -> Buffer:
        return int2_array(obj)


class Int4Dumper(Dumper):
    """``int4`` COPY column, range-checked (psycopg's own wraps a value outside int32)."""

    format = Format.BINARY
    oid = INT4_OID

    def dump(self, obj: Any) -> Buffer:
        try:
            return _I4.pack(obj)
        except struct.error as exc:
            raise EncodeError(f"int4 {obj!r}: {exc}") from exc


class Float4Dumper(Dumper):
    """``float4`` COPY column; a finite value beyond float4 raises (psycopg's own makes it infinite)."""

    format = Format.BINARY
    oid = FLOAT4_OID

    def dump(self, obj: Any) -> Buffer:
        try:
            return _F4.pack(obj)
        except (struct.error, OverflowError) as exc:
            raise EncodeError(f"float4 {obj!r}: {exc}") from exc


def _json(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise EncodeError(f"not serialisable as JSON: {exc}") from exc


class JsonbDumper(JsonbBinaryDumper):
    """``jsonb`` COPY column of a plain value (dict, list...), with orjson."""

    _dumps = staticmethod(_json)


class _Int4ArrayLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> np.ndarray:
        return parse_array(data, "<i4")


class _Float4ArrayLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> np.ndarray:
        return parse_array(data, "<f4")


COPY_DUMPERS: tuple[type[Dumper], ...] = (Int4ArrayDumper, Float4ArrayDumper, Int2ArrayDumper, Int4Dumper,
                                          Float4Dumper, JsonbDumper)
"""The dumpers psycopg picks by Postgres type (``Copy.set_types``) once ``register`` ran; every other type of a
COPY column (text, varchar, bool, float8, bytea, timestamptz) is psycopg's own, in C."""


def register(context: AdaptContext) -> None:
    """The ``Int4Array`` parameter, the COPY dumpers by type and numpy loaders of binary ``int4[]``/``float4[]``."""
    adapters = context.adapters
    adapters.register_dumper(Int4Array, _Int4ArrayParamDumper)
    for dumper in COPY_DUMPERS:  # by type only (no Python class): after the one above, which also took int4[]
        adapters.register_dumper(None, dumper)
    adapters.register_loader(INT4_ARRAY_OID, _Int4ArrayLoader)
    adapters.register_loader(FLOAT4_ARRAY_OID, _Float4ArrayLoader)
