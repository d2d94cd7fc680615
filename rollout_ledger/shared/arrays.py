"""Encoding of token-id and logprob arrays: little-endian binary on the bus, base64 in JSON views.

Token arrays travel on every turn (an inference request carries the whole context). Measured in
docs/benchmarks.md ("wire encoding"): JSON int lists cost 4-40x more to encode and validate than raw int32
bytes in a msgpack envelope, and the gap grows with the context. So on the bus an array is its
little-endian bytes (msgpack ``bin``); in JSON (HTTP views, docs) it is the base64 of those bytes; in Python it
is a ``numpy.ndarray`` (int32 for ids, float32 for logprobs).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator, SerializationInfo, WithJsonSchema

_INT = np.dtype("<i4")
_FLOAT = np.dtype("<f4")


def _to_array(value: Any, dtype: np.dtype[Any]) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value.astype(dtype, copy=False)
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value, validate=True), dtype=dtype)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(value), dtype=dtype)
    if isinstance(value, Sequence):
        return np.asarray(value, dtype=dtype)
    raise ValueError(f"expected an array, base64 string or list, got {type(value).__name__}")


def decode_ids(value: Any) -> np.ndarray:
    """Token ids from base64, bytes, a list or an array (int32)."""
    try:
        return _to_array(value, _INT)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"invalid token id array: {exc}") from exc


def decode_floats(value: Any) -> np.ndarray:
    """Logprobs from base64, bytes, a list or an array (float32)."""
    try:
        return _to_array(value, _FLOAT)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"invalid float array: {exc}") from exc


def encode_array(arr: np.ndarray) -> str:
    """Base64 of the array's little-endian bytes."""
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


def _serialize(arr: np.ndarray, info: SerializationInfo) -> str | bytes:
    """JSON mode: base64 text; python mode (the msgpack bus encoding): raw little-endian bytes."""
    if info.mode_is_json():
        return encode_array(arr)
    return np.ascontiguousarray(arr).tobytes()


TokenIds = Annotated[
    np.ndarray,
    PlainValidator(decode_ids),
    PlainSerializer(_serialize, when_used="always"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": "int32 little-endian token ids"}),
]
"""Token ids: int32 array in Python, little-endian int32 bytes on the bus, base64 in JSON."""

Floats = Annotated[
    np.ndarray,
    PlainValidator(decode_floats),
    PlainSerializer(_serialize, when_used="always"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": "float32 little-endian values"}),
]
"""Per-token floats (logprobs): float32 array in Python, little-endian bytes on the bus, base64 in JSON."""
