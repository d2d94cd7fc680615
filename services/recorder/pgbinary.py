"""Postgres binary wire encoding of the recorder's hot rows and arrays, built with numpy instead of per element.

Why: psycopg dumps a Python list element by element; the recorder writes every turn's token ids and logprobs
and every trajectory's four per-token arrays, so encoding dominated its CPU. Here an ``int4[]`` / ``float4[]``
/ ``int2[]`` value is built in one numpy pass (each element is a 4-byte length then the big-endian value), and
a ``COPY ... (FORMAT BINARY)`` payload is assembled row by row from ``struct`` packs of the scalar columns.
Parsing goes the other way: binary ``int4[]`` / ``float4[]`` results load straight into numpy arrays.

Values that do not fit their column (an int outside int32, a non-UTF-8 string, unserialisable JSON) raise
``EncodeError``; the store turns it into a non-retryable ``StoreError`` so the batch is replayed message by
message and only the offending message is dead-lettered, as with a server-side data error.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Dumper, Loader
from psycopg.pq import Format

INT2_OID, INT4_OID, FLOAT4_OID = 21, 23, 700
INT2_ARRAY_OID, INT4_ARRAY_OID, FLOAT4_ARRAY_OID = 1005, 1007, 1021

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" * 2
COPY_TRAILER = b"\xff\xff"
NULL = b"\xff\xff\xff\xff"

_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_I4 = struct.Struct(">i")
_ARRAY1_HEADER = struct.Struct(">iiiii")  # ndim=1, has_nulls=0, element oid, length, lower bound=1
_ARRAY0_HEADER = struct.Struct(">iii")  # ndim=0 (empty array)
_ARRAY2_HEADER = struct.Struct(">iiiiiii")  # ndim=2: two (length, lower bound) pairs

_PAIR_I4 = np.dtype([("n", ">i4"), ("v", ">i4")])
_PAIR_F4 = np.dtype([("n", ">i4"), ("v", ">f4")])
_PAIR_I2 = np.dtype([("n", ">i4"), ("v", ">i2")])


class EncodeError(ValueError):
    """A value cannot be encoded for its column."""


def _array(values: np.ndarray, oid: int, pair: np.dtype[Any], size: int) -> bytes:
    n = len(values)
    if n == 0:
        return _ARRAY0_HEADER.pack(0, 0, oid)
    body = np.empty(n, pair)
    body["n"] = size
    body["v"] = values
    return _ARRAY1_HEADER.pack(1, 0, oid, n, 1) + body.tobytes()


def int4_array(values: np.ndarray) -> bytes:
    """Binary ``int4[]`` of a 1-d integer array (values must fit in int32)."""
    arr = np.asarray(values)
    if arr.dtype != np.int32 and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise EncodeError("int4 array value out of range")
    return _array(arr, INT4_OID, _PAIR_I4, 4)


def float4_array(values: np.ndarray) -> bytes:
    """Binary ``float4[]`` of a 1-d float array."""
    return _array(np.asarray(values, dtype=np.float32), FLOAT4_OID, _PAIR_F4, 4)


def int2_array(values: np.ndarray) -> bytes:
    """Binary ``int2[]`` of a 1-d array of small integers (a loss mask)."""
    return _array(np.asarray(values, dtype=np.int16), INT2_OID, _PAIR_I2, 2)


def packed_le(values: np.ndarray, dtype: str) -> bytes:
    """A ``bytea`` of packed little-endian values (``trajectories.token_ids_le`` / ``sampled_logprobs_le``), the
    same values as ``int4_array`` / ``float4_array`` of the same array (which check the range first)."""
    return np.asarray(values).astype(dtype, copy=False).tobytes()


def sampled(values: np.ndarray, ranges: Sequence[Sequence[int]]) -> np.ndarray:
    """The values inside the ``[start, end)`` ranges, in order (``sampled_logprobs_le``: the logprobs of the
    sampled tokens; migration 0008)."""
    arr = np.asarray(values)
    return np.concatenate([arr[a:b] for a, b in ranges]) if len(ranges) else arr[:0]


def int4_matrix(rows: Sequence[Sequence[int]], width: int) -> bytes:
    """Binary 2-d ``int4[][]`` of equal-length rows (empty input: an empty array)."""
    if not rows:
        return _ARRAY0_HEADER.pack(0, 0, INT4_OID)
    arr = np.asarray(rows, dtype=np.int64).reshape(len(rows), width)
    if arr.min() < -(2**31) or arr.max() >= 2**31:
        raise EncodeError("int4 array value out of range")
    body = np.empty(arr.size, _PAIR_I4)
    body["n"] = 4
    body["v"] = arr.ravel()
    return _ARRAY2_HEADER.pack(2, 0, INT4_OID, len(rows), 1, width, 1) + body.tobytes()


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


class BinaryValue:
    """Pre-encoded binary value of one array column, passed as a query parameter (see ``register``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Int4Array(BinaryValue):
    """A binary ``int4[]`` parameter."""


class Int4Matrix(BinaryValue):
    """A binary 2-d ``int4[][]`` parameter (same type oid as ``int4[]``)."""


class Float4Array(BinaryValue):
    """A binary ``float4[]`` parameter."""


class Int2Array(BinaryValue):
    """A binary ``int2[]`` parameter."""


def _dumper(oid_: int) -> type[Dumper]:
    class _D(Dumper):
        format = Format.BINARY
        oid = oid_

        def dump(self, obj: Any) -> Buffer:
            return obj.data

    return _D


class _Int4ArrayLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> np.ndarray:
        return parse_array(data, "<i4")


class _Float4ArrayLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> np.ndarray:
        return parse_array(data, "<f4")


def register(context: AdaptContext) -> None:
    """Dumpers of the ``BinaryValue`` classes and numpy loaders of binary ``int4[]``/``float4[]`` results."""
    context.adapters.register_dumper(Int4Array, _dumper(INT4_ARRAY_OID))
    context.adapters.register_dumper(Int4Matrix, _dumper(INT4_ARRAY_OID))
    context.adapters.register_dumper(Float4Array, _dumper(FLOAT4_ARRAY_OID))
    context.adapters.register_dumper(Int2Array, _dumper(INT2_ARRAY_OID))
    context.adapters.register_loader(INT4_ARRAY_OID, _Int4ArrayLoader)
    context.adapters.register_loader(FLOAT4_ARRAY_OID, _Float4ArrayLoader)


# --- COPY rows -------------------------------------------------------------------------------------------------


def text(value: str) -> bytes:
    """A ``text``/``varchar`` field (length prefix included)."""
    b = value.encode()
    return _I4.pack(len(b)) + b


def field(b: bytes) -> bytes:
    """A field of already-encoded bytes (length prefix included)."""
    return _I4.pack(len(b)) + b


def micros(t: datetime) -> int:
    """``timestamptz`` binary value: microseconds since 2000-01-01 UTC (a naive time is taken as UTC)."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    d = t - _PG_EPOCH
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def jsonb(value: Any) -> bytes:
    """A ``jsonb`` field (version byte 1, then the JSON text)."""
    try:
        b = b"\x01" + orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise EncodeError(f"not serialisable as JSON: {exc}") from exc
    return _I4.pack(len(b)) + b


_I4_FIELD = struct.Struct(">ii")
_F4_FIELD = struct.Struct(">if")
_F8_FIELD = struct.Struct(">id")
_TS_FIELD = struct.Struct(">iq")
_BOOL2 = struct.Struct(">i?i?")
_NCOLS_TURN = struct.pack(">h", 15)
_NCOLS_STEP = struct.pack(">h", 16)
_BOOL = struct.Struct(">i?")


def turn_row(e: Any) -> bytes:
    """One ``turns`` COPY row (columns in ``store._TURN_COLS`` order) from a ``TurnGenerated``."""
    try:
        cached = NULL if e.cached_tokens is None else _I4_FIELD.pack(4, e.cached_tokens)
        return b"".join((
            _NCOLS_TURN, text(e.event_id), text(e.episode_id),
            _I4_FIELD.pack(4, e.attempt), _I4_FIELD.pack(4, e.turn_index), _I4_FIELD.pack(4, e.prompt_len),
            field(int4_array(e.token_ids)), field(float4_array(e.logprobs)), text(str(e.finish_reason)),
            _I4_FIELD.pack(4, e.weight_version), text(e.engine), text(e.worker_id),
            _F4_FIELD.pack(4, e.queue_ms), _F4_FIELD.pack(4, e.generate_ms), cached,
            _TS_FIELD.pack(8, micros(e.time)),
        ))
    except (struct.error, OverflowError, UnicodeError) as exc:
        raise EncodeError(f"turn {e.event_id}: {exc}") from exc


def step_row(e: Any) -> bytes:
    """One ``steps`` COPY row (columns in ``store._STEP_COLS`` order) from a ``StepCompleted``."""
    try:
        return b"".join((
            _NCOLS_STEP, text(e.event_id), text(e.episode_id),
            _I4_FIELD.pack(4, e.attempt), _I4_FIELD.pack(4, e.turn_index), text(e.turn_event_id),
            text(e.action), text(e.observation), field(int4_array(e.observation_token_ids)),
            _F8_FIELD.pack(8, e.reward), _BOOL2.pack(1, e.terminated, 1, e.truncated), jsonb(e.info),
            _F4_FIELD.pack(4, e.step_ms), NULL if e.drift is None else text(e.drift), _BOOL.pack(1, e.new_segment),
            _TS_FIELD.pack(8, micros(e.time)),
        ))
    except (struct.error, OverflowError, UnicodeError) as exc:
        raise EncodeError(f"step {e.event_id}: {exc}") from exc


_NCOLS_TRAJECTORY = struct.pack(">h", 24)


def trajectory_row(episode_id: str, batch_id: str, group_id: str, env: str, attempt: int, status: str,
                   failure_class: str | None, reward: float | None, traj: Any, token_check: str | None = None,
                   drifts: Any = ()) -> bytes:
    """One ``trajectories`` COPY row (columns in ``store._TRAJECTORY_COLS`` order) from an assembled trajectory."""
    try:
        return b"".join((
            _NCOLS_TRAJECTORY, text(episode_id), text(batch_id), text(group_id), text(env),
            _I4_FIELD.pack(4, attempt), text(status), NULL if failure_class is None else text(failure_class),
            NULL if reward is None else _F8_FIELD.pack(8, reward),
            field(int4_array(traj.token_ids)), field(int2_array(traj.loss_mask)), field(float4_array(traj.logprobs)),
            field(int4_array(traj.weight_versions)), field(int4_matrix(traj.action_ranges, 2)),
            _I4_FIELD.pack(4, traj.prompt_len), _I4_FIELD.pack(4, traj.num_tokens),
            _I4_FIELD.pack(4, traj.num_sampled_tokens), _I4_FIELD.pack(4, traj.num_turns),
            field(int4_matrix(traj.segments, 2)), _I4_FIELD.pack(4, len(traj.segments)),
            NULL if token_check is None else text(token_check), jsonb(list(drifts)),
            field(packed_le(traj.token_ids, "<i4")),
            field(packed_le(sampled(traj.logprobs, traj.action_ranges), "<f4")),
            field(int4_array(np.array([traj.weight_versions[a] for a, _ in traj.action_ranges], np.int64))),
        ))
    except (struct.error, OverflowError, UnicodeError) as exc:
        raise EncodeError(f"trajectory of {episode_id}: {exc}") from exc
