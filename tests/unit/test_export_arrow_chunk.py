"""``source.arrow_chunk`` turns a batch of the export query's rows, as ADBC decodes them into Arrow, into a
``Chunk``: packed arrays read in place (also from a slice that starts inside the batch's buffers), the sampled
tokens' logprobs laid back on the action ranges (0.0 elsewhere), 2-D ``int4[]`` arrays flattened into spans, NULL
arrays and NULL versions handled, jsonb parsed, and malformed rows refused."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.source import _parsed, arrow_chunk, rechunked
from rollout_ledger.shared.errors import SchemaError

NAMES = ("batch_id", "group_id", "status", "rollout_reward", "token_ids", "logprobs", "range_versions",
         "action_ranges", "segments", "num_tokens", "task", "drifts")

ROWS: list[dict[str, Any]] = [
    {"episode_id": "e0", "token_ids": [1, 2, 3, 4], "logprobs": [0.0, -0.5, 0.0, -1.5],
     "action_ranges": [[1, 2], [3, 4]], "range_versions": [7, 8], "segments": [[0, 4]], "task": {"b": 1, "a": [2]},
     "drifts": []},
    {"episode_id": "e1", "token_ids": [5, 6, 7], "logprobs": [0.0, -0.25, -0.125], "action_ranges": [[1, 3], [3, 3]],
     "range_versions": [9, None], "segments": None, "task": {"b": 1, "a": [2]}, "drifts": [{"at": 1}]},
    {"episode_id": "e2", "token_ids": [2**31 - 1, -(2**31)], "logprobs": [0.0, 0.0], "action_ranges": None,
     "range_versions": None, "segments": [[0, 1], [1, 2]], "task": "a plain string", "drifts": None},
    {"episode_id": "e3", "token_ids": [9], "logprobs": [-0.5], "action_ranges": [[0, 1]], "range_versions": [3],
     "segments": [[0, 1]], "task": None, "drifts": []},
]


def _jsonb(value: Any) -> str | None:
    """jsonb's text form (spaces after separators; not sorted like the exporter's output)."""
    return None if value is None else json.dumps(value)


def _packed(values: list[Any], dtype: str) -> bytes:
    return np.array(values, dtype).tobytes()


def _sampled(row: dict[str, Any]) -> bytes:
    """``sampled_logprobs_le``: the logprobs inside the action ranges, in order."""
    return b"".join(_packed(row["logprobs"][a:b], "<f4") for a, b in row["action_ranges"] or [])


def batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """Rows as ADBC's PostgreSQL driver decodes the export query: bytea as binary, int4[] flattened into
    list<int32> (2-D too), jsonb as the arrow.json extension type."""
    def flat(v: Any) -> list[int] | None:
        return None if v is None else [x for pair in v for x in pair]

    n = len(rows)
    json_type = pa.json_()
    cols = {
        "episode_id": pa.array([r["episode_id"] for r in rows]),
        "attempt": pa.array([1] * n, pa.int32()),
        "reward": pa.array([0.5 * i for i in range(n)], pa.float64()),
        "advantage": pa.array([0.25 - i for i in range(n)], pa.float64()),
        "group_size": pa.array([n] * n, pa.int64()),
        "batch_id": pa.array(["b"] * n),
        "group_id": pa.array(["g"] * n),
        "status": pa.array(["completed", "truncated", None, "failed"][:n]),
        "rollout_reward": pa.array([1.0, None, 0.0, 2.0][:n], pa.float64()),
        "token_ids": pa.array([_packed(r["token_ids"], "<i4") for r in rows], pa.binary()),
        "logprobs": pa.array([_sampled(r) for r in rows], pa.binary()),
        "range_versions": pa.array([r["range_versions"] for r in rows], pa.list_(pa.int32())),
        "action_ranges": pa.array([flat(r["action_ranges"]) for r in rows], pa.list_(pa.int32())),
        "segments": pa.array([flat(r["segments"]) for r in rows], pa.list_(pa.int32())),
        "num_tokens": pa.array([len(r["token_ids"]) for r in rows], pa.int32()),
        "task": pa.ExtensionArray.from_storage(json_type, pa.array([_jsonb(r["task"]) for r in rows], pa.string())),
        "drifts": pa.ExtensionArray.from_storage(json_type, pa.array([_jsonb(r["drifts"]) for r in rows],
                                                                     pa.string())),
    }
    return pa.RecordBatch.from_pydict(cols)


def expected(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        ranges = r["action_ranges"] or []
        versions = r["range_versions"] or []
        mask = np.zeros(len(r["token_ids"]), np.int32)
        wv = np.full(len(r["token_ids"]), -1, np.int32)
        for (a, b), v in zip(ranges, versions, strict=True):
            mask[a:b] = 1
            wv[a:b] = -1 if v is None else v
        out.append({"episode_id": r["episode_id"], "token_ids": r["token_ids"], "logprobs": r["logprobs"],
                    "loss_mask": mask.tolist(), "weight_versions": wv.tolist(), "action_ranges": ranges,
                    "range_versions": list(versions),
                    "segments": r["segments"] or [[0, len(r["token_ids"])]], "task": r["task"],
                    "drifts": r["drifts"]})
    return out


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize(("start", "length"), [(0, 4), (1, 2), (2, 2), (3, 1), (1, 3)])
def test_a_slice_of_a_batch_becomes_the_chunk_of_its_rows(start: int, length: int, large: bool) -> None:
    b = batch(ROWS)
    if large:  # 64-bit offsets, should the driver ever hand them out
        for name in ("token_ids", "logprobs"):
            b = b.set_column(b.schema.get_field_index(name), name, b.column(name).cast(pa.large_binary()))
    b = b.slice(start, length)  # slices share the batch's buffers: offsets must be honoured
    chunk = arrow_chunk(b, NAMES, "rm@2")
    assert isinstance(chunk, Chunk) and len(chunk) == length
    for got, want, i in zip(chunk, expected(ROWS[start:start + length]), range(start, start + length), strict=True):
        assert got["episode_id"] == want["episode_id"]
        assert got["token_ids"].tolist() == want["token_ids"]
        assert got["logprobs"].tolist() == want["logprobs"]
        assert got["loss_mask"].tolist() == want["loss_mask"]
        assert got["weight_versions"].tolist() == want["weight_versions"]
        assert got["action_ranges"] == want["action_ranges"]
        assert got["range_versions"] == [None if v is None else v for v in want["range_versions"]]
        assert got["segments"] == want["segments"]
        assert got["task"] == want["task"] and got["drifts"] == want["drifts"]
        assert got["reward"] == 0.5 * i and got["advantage"] == 0.25 - i and got["group_size"] == 4
        assert got["reward_source"] == "rm@2"
        assert got["status"] == ["completed", "truncated", None, "failed"][i]
    assert chunk.columns["episode_id"].type == pa.string()  # scalar fields stay Arrow arrays


def test_jsonb_texts_are_parsed_once_per_distinct_text() -> None:
    got = _parsed(pa.array(['{"a": 1}', None, '{"a": 1}', "[]", '"s"', "[1, [2]]", "null"]))
    assert got == [{"a": 1}, None, {"a": 1}, [], "s", [1, [2]], None]
    assert got[0] is got[2]
    assert _parsed(pa.array([], pa.string())) == [] and _parsed(pa.array([None, None], pa.string())) == [None, None]


@pytest.mark.parametrize(("column", "value", "message"), [
    ("token_ids", pa.array([b"\x01\x00\x00"] * 4, pa.binary()), "whole number"),
    ("num_tokens", pa.array([4, 3, 2, 2], pa.int32()), "disagree in length"),
    ("logprobs", pa.array([_packed([-0.5], "<f4"), _packed([-0.25, -0.125], "<f4"), b"",
                           _packed([-0.5, 0.0], "<f4")], pa.binary()), "sampled logprobs and action ranges"),
    ("logprobs", pa.array([_packed([-0.5, -1.5, -0.25], "<f4"), _packed([-0.125], "<f4"), b"",
                           _packed([-0.5], "<f4")], pa.binary()), "sampled logprobs and action ranges"),
    ("action_ranges", pa.array([[1, 2, 3], [1, 3, 3, 3], None, [0, 1]], pa.list_(pa.int32())), "pairs"),
    ("range_versions", pa.array([[7], [9, None], None, [3]], pa.list_(pa.int32())), "pairs"),
    ("segments", pa.array([[0, 4], None, [0, 1, 1, 3], [0, 1]], pa.list_(pa.int32())), "outside"),
])
def test_malformed_rows_are_refused(column: str, value: pa.Array, message: str) -> None:
    b = batch(ROWS)
    b = b.set_column(b.schema.get_field_index(column), column, value)
    with pytest.raises(SchemaError, match=message):
        arrow_chunk(b, NAMES, "rollout")


def test_rechunked_cuts_driver_batches_into_chunks_of_exactly_the_asked_rows() -> None:
    full = pa.concat_batches([batch(ROWS)] * 5)  # 20 rows, packed bytes and jsonb (an extension type) included
    driver = [full.slice(0, 7), full.slice(7, 0), full.slice(7, 6), full.slice(13, 7)]
    got = list(rechunked(driver, 4))
    assert [b.num_rows for b in got] == [4, 4, 4, 4, 4]
    assert pa.Table.from_batches(got).equals(pa.Table.from_batches([full]))
    assert got[0].column("token_ids").buffers()[2].address == full.column("token_ids").buffers()[2].address  # a slice
    chunks = [arrow_chunk(b, NAMES, "rollout") for b in got]  # a copied chunk reads like a sliced one
    assert [r["episode_id"] for c in chunks for r in c] == [r["episode_id"] for r in ROWS * 5]
    assert [r["logprobs"].tolist() for c in chunks for r in c] == [r["logprobs"] for r in ROWS * 5]
    assert [b.num_rows for b in rechunked(driver, 8)] == [8, 8, 4]
    assert list(rechunked([], 4)) == []
