"""Wire encoding of token-id and logprob arrays: little-endian binary, base64 inside JSON events.

Token arrays travel on every turn. A JSON list of ints costs several times more to encode, send and
parse than the same ids packed as int32 bytes (see docs/benchmarks.md, "wire encoding"), and the recorder
wants numpy arrays for COPY anyway. On the wire an array is the base64 of its little-endian bytes; in
Python it is a read-only ``numpy.ndarray`` (int32 for ids, float32 for logprobs).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

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


TokenIds = Annotated[
    np.ndarray,
    PlainValidator(decode_ids),
    PlainSerializer(encode_array, when_used="json"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": "int32 little-endian token ids"}),
]
"""Token ids: int32 array in Python, base64 of little-endian int32 on the wire."""

Floats = Annotated[
    np.ndarray,
    PlainValidator(decode_floats),
    PlainSerializer(encode_array, when_used="json"),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": "float32 little-endian values"}),
]
"""Per-token floats (logprobs): float32 array in Python, base64 of little-endian float32 on the wire."""
