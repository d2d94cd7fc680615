"""The columnar table builder (``tables.table``, the one definition of every record shape) gives exactly the
records a plain per-sample reference computes (``expected``: Python slicing of each trajectory along
``records.samples``), for every shape and unit, on random trajectories as the recorder assembles them
(empty turns, several segments, several weight versions, no reward, failed and truncated ones); JSON text byte for
byte."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_ledger.client.records import SCHEMAS, SLIME_STATUS, Unit, json_fields, samples
from rollout_ledger.client.rows import Chunk, sampled_of, unpack
from rollout_ledger.client.tables import json_column, json_rows, records, slices, table
from rollout_ledger.services.exporter.writers import write_file
from rollout_ledger.shared.errors import SchemaError
from tests.unit.test_export_records import _assembled, two_segment_row

STATUSES = ("completed", "truncated", "aborted", "failed")


def random_rows(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        t = _assembled(rng, i)
        reward = None if rng.random() < 0.1 else float(rng.integers(0, 3)) / 2
        rows.append({
            "episode_id": f"b.{i // 4}.{i % 4}", "group_id": f"b.{i // 4}", "batch_id": "b", "group_index": i % 4,
            "env": ["arith", "tools"][i % 2], "attempt": int(rng.integers(1, 3)),
            "status": STATUSES[int(rng.integers(0, 4))], "failure_class": None if rng.random() < 0.8 else "env",
            "reward": reward, "rollout_reward": reward, "advantage": None if reward is None else float(rng.normal()),
            "group_size": 4, "task": {"seed": i, "q": [1, {"b": 2, "a": None}]} if i % 3 else "a text task",
            "task_index": i // 4,
            "prompt_text": None if i % 5 == 0 else f"prompt {i}", "token_ids": t.token_ids, "loss_mask": t.loss_mask,
            "logprobs": t.logprobs, "weight_versions": t.weight_versions, "action_ranges": t.action_ranges,
            "segments": t.segments, "num_segments": len(t.segments), "token_check": "ok" if i % 2 else None,
            "drifts": [{"turn": 1, "class": "window"}] if len(t.segments) > 1 else [], "prompt_len": t.prompt_len,
            "num_tokens": t.num_tokens, "num_sampled_tokens": t.num_sampled_tokens, "num_turns": t.num_turns,
            "created_at": dt.datetime(2026, 11, 23, 7, i % 60, tzinfo=dt.UTC),
            "reward_source": "judge@v2" if i % 7 == 0 else "rollout",
        })
    return rows


def _versions(row: dict, lo: int, hi: int) -> list[int]:
    """Distinct weight versions of the sampled turns that start in [lo, hi)."""
    wv = row["weight_versions"]
    return sorted({int(wv[a]) for a, b in row["action_ranges"] if lo <= a < hi and b > a and wv[a] >= 0})


def expected(row: dict, shape: str, unit: Unit) -> list[dict]:
    """Each record of ``row`` in ``shape``, computed the plain way (one sample at a time, by slicing): the reference
    the columnar build must equal."""
    if shape == "full":
        return [{**{k: row[k] for k in SCHEMAS["full"].names if k != "reward_source"},
                 "reward_source": row["reward_source"] or "rollout"}]
    out = []
    for sp in samples(row, unit):
        s, p, e = sp.start, sp.prompt_end, sp.end
        tok, mask, lp = row["token_ids"], row["loss_mask"], row["logprobs"]
        rec = {"episode_id": row["episode_id"], "group_id": row["group_id"], "batch_id": row["batch_id"],
               "env": row["env"], "attempt": row["attempt"], "sample_index": sp.index, "num_samples": sp.count,
               "reward": row["reward"], "advantage": row["advantage"], "status": row["status"],
               "task": row["task"], "task_index": row["task_index"]}
        label = orjson.dumps(row["task"], option=orjson.OPT_SORT_KEYS).decode()
        source = row["reward_source"] or "rollout"
        if shape == "openrlhf":
            rec.update(prompt=row["prompt_text"] or "", label=label, observation_tokens=tok[s:e],
                       action_ranges=[[max(a, p) - s, min(b, e) - s] for a, b in row["action_ranges"]
                                      if a < e and b > p],
                       rollout_log_probs=lp[s:e], truncated=row["status"] == "truncated",
                       scores={"reward": row["reward"], "advantage": row["advantage"]},
                       extra_logs={"num_turns": row["num_turns"], "prompt_len": row["prompt_len"],
                                   "num_sampled_tokens": row["num_sampled_tokens"],
                                   "weight_versions": _versions(row, s, e), "reward_source": source,
                                   "rollout_reward": row["rollout_reward"]})
        elif shape == "slime":
            rec.update(index=row["group_index"], prompt=row["prompt_text"] or "", label=label, tokens=tok[s:e],
                       response_length=e - p, loss_mask=mask[p:e], rollout_log_probs=lp[p:e],
                       status=SLIME_STATUS.get(row["status"], "aborted"),
                       weight_versions=[str(v) for v in _versions(row, p, e)],
                       metadata={"reward_source": source, "rollout_reward": row["rollout_reward"],
                                 "num_turns": row["num_turns"], "rollout_status": row["status"]})
        elif shape == "verl":
            rec.update(uid=row["group_id"], prompts=tok[s:p], responses=tok[p:e], response_mask=mask[p:e],
                       attention_mask=np.ones(e - s, np.int32), position_ids=np.arange(e - s, dtype=np.int32),
                       rollout_log_probs=lp[p:e])
        else:
            rec.update(prompt_ids=tok[s:p], completion_ids=tok[p:e], completion_mask=np.ones(e - p, np.int32),
                       tool_mask=mask[p:e], logprobs=lp[p:e])
        out.append(rec)
    return out


def _same(got: object, want: object) -> bool:
    """Equal values of equal types (1, 1.0 and True differ; floats by their bits: 0.0 and -0.0 differ)."""
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if isinstance(want, float):
        return type(got) is float and got.hex() == want.hex()
    if isinstance(want, list | tuple):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("unit", list(Unit))
@pytest.mark.parametrize("shape", list(SCHEMAS))
def test_columnar_table_equals_the_plain_reference(shape: str, unit: Unit) -> None:
    rows = [*random_rows(11, 300), two_segment_row()]
    want = [rec for row in rows for rec in expected(row, shape, unit)]
    got_table = table(Chunk.from_rows(rows), shape, unit)
    got = records(Chunk.from_rows(rows), shape, unit)
    assert got_table.schema == SCHEMAS[shape] and got_table.num_rows == len(got) == len(want) > 0
    marked = json_fields(SCHEMAS[shape])
    for name in SCHEMAS[shape].names:  # the JSON fields as text, byte for byte (sorted keys; null stays null)
        if name in marked:
            assert got_table.column(name).to_pylist() == json_column([w[name] for w in want]), name
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert list(g) == SCHEMAS[shape].names
        for name in SCHEMAS[shape].names:
            value = w[name]
            if isinstance(value, np.ndarray):  # an array of the field's element type
                value = value.astype(np.float32 if value.dtype.kind == "f" else np.int32)
            elif name in marked and isinstance(value, list):  # values as their JSON text holds them
                value = orjson.loads(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))
            assert _same(g[name], value), (i, name, g[name], value)


@pytest.mark.parametrize("shape", list(SCHEMAS))
def test_an_empty_chunk_gives_an_empty_table(shape: str) -> None:
    got = table(Chunk.from_rows([]), shape)
    assert got.num_rows == 0 and got.schema == SCHEMAS[shape]


def test_chunk_rows_are_views_of_the_flat_arrays() -> None:
    rows = random_rows(3, 20)
    chunk = Chunk.from_rows(rows)
    assert len(chunk) == 20
    for want, got in zip(rows, chunk, strict=True):
        for name in ("token_ids", "loss_mask", "logprobs", "weight_versions"):
            assert got[name].tolist() == pytest.approx(np.asarray(want[name]).tolist())
        assert got["episode_id"] == want["episode_id"] and got["segments"] == want["segments"]
    assert chunk[-1]["episode_id"] == rows[-1]["episode_id"]
    assert [r["episode_id"] for r in chunk[2:4]] == [rows[2]["episode_id"], rows[3]["episode_id"]]
    with pytest.raises(IndexError):
        chunk[20]


def test_chunk_build_rebuilds_mask_versions_and_logprobs_from_ranges() -> None:
    rows = random_rows(5, 50)
    given = Chunk.from_rows(rows)

    def build(sampled: np.ndarray, segments: list | None = None) -> Chunk:
        segs = [r["segments"] for r in rows] if segments is None else segments
        return Chunk.build(
            {k: list(v) for k, v in given.columns.items()}, given.arrays["token_ids"], sampled, given.lengths,
            np.array([p for r in rows for p in r["action_ranges"]], np.int64).reshape(-1, 2),
            np.array([len(r["action_ranges"]) for r in rows]), given.ranges.versions,
            np.array([p for s in segs for p in s], np.int64).reshape(-1, 2), np.array([len(s) for s in segs]))

    sampled = sampled_of(given.arrays["logprobs"], given.ranges.lo, given.ranges.hi)
    built = build(sampled)
    for name in ("loss_mask", "weight_versions", "logprobs"):
        assert built.arrays[name].tobytes() == given.arrays[name].tobytes(), name
    assert [r["segments"] for r in built] == [r["segments"] for r in rows]
    with pytest.raises(SchemaError, match="sampled logprobs for"):
        build(sampled[:-1])
    with pytest.raises(SchemaError, match="segments lies outside"):
        build(sampled, [[[0, 10**6]]] + [r["segments"] for r in rows[1:]])
    with pytest.raises(SchemaError, match="segments overlap"):
        build(sampled, [[[0, 1], [0, 1]]] + [r["segments"] for r in rows[1:]])
    no_segments = build(sampled, [[] for _ in rows])
    assert [r["segments"] for r in no_segments] == [[[0, n]] for n in given.lengths.tolist()]


def test_unpack_reads_packed_little_endian_rows() -> None:
    raws = [np.array([1, -2, 2**31 - 1], "<i4").tobytes(), b"", None, np.array([-(2**31)], "<i4").tobytes()]
    flat, lengths = unpack(raws, np.dtype("<i4"))
    assert flat.tolist() == [1, -2, 2**31 - 1, -(2**31)] and lengths.tolist() == [3, 0, 0, 1]
    flat, lengths = unpack([np.array([0.5, -1.25], "<f4").tobytes()], np.dtype("<f4"))
    assert flat.tolist() == [0.5, -1.25] and lengths.tolist() == [2]
    with pytest.raises(SchemaError, match="whole number"):
        unpack([b"\x00\x01\x02"], np.dtype("<i4"))


def test_slices_gather_in_order_and_contiguous() -> None:
    flat = np.arange(20, dtype=np.int32)
    typ = pa.list_(pa.int32())
    got = slices(flat, np.array([2, 10, 10]), np.array([5, 13, 10]), typ)
    assert got.to_pylist() == [[2, 3, 4], [10, 11, 12], []]
    assert slices(flat, np.array([0, 4]), np.array([4, 9]), typ).to_pylist() == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    assert slices(flat, np.array([], np.int64), np.array([], np.int64), typ).to_pylist() == []


def test_write_file_writes_row_groups_on_a_thread_and_keeps_their_order(tmp_path: Path) -> None:
    rows = random_rows(21, 120)
    chunks = [Chunk.from_rows(rows[i:i + 25]) for i in range(0, 120, 25)]
    tables = [table(c, "slime") for c in chunks]
    want = pa.concat_tables(tables)
    sizes = [t.nbytes for t in tables]

    def grouped(limit: int) -> list[int]:  # a row group closes once it holds ``limit`` bytes
        out, rows, size = [], 0, 0
        for t in tables:
            rows, size = rows + t.num_rows, size + t.nbytes
            if size >= limit:
                out, rows, size = [*out, rows], 0, 0
        return out + ([rows] if rows else [])

    assert grouped(1) == [t.num_rows for t in tables] and len(grouped(max(sizes) + 1)) in (2, 3)
    for group_bytes in (1, max(sizes) + 1, sum(sizes) + 1):
        groups = grouped(group_bytes)
        path, count = write_file(tmp_path / f"out{group_bytes}.parquet", "parquet", "slime", chunks,
                                 row_group_bytes=group_bytes)
        back = pq.read_table(path)
        assert count == want.num_rows == back.num_rows
        assert back.replace_schema_metadata(None).equals(want)
        meta = pq.ParquetFile(path).metadata
        assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == groups


def test_a_failing_write_leaves_no_file_and_raises_in_the_caller(tmp_path: Path) -> None:
    rows = random_rows(22, 40)

    def chunks() -> Iterator[Chunk]:
        yield Chunk.from_rows(rows[:20])
        yield Chunk.from_rows(rows[20:])
        raise SchemaError("the source broke mid-way")

    with pytest.raises(SchemaError, match="mid-way"):
        write_file(tmp_path / "out.parquet", "parquet", "full", chunks())
    assert list(tmp_path.iterdir()) == []

    def broken() -> Iterator[Chunk]:
        yield Chunk.from_rows(rows[5:10])
        bad = dict(rows[0], segments=[[0, 10**6]])
        yield Chunk.from_rows([bad])

    with pytest.raises(SchemaError, match="outside"):
        write_file(tmp_path / "out.parquet", "parquet", "verl", broken())
    assert list(tmp_path.iterdir()) == []


def test_an_error_on_the_writer_thread_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: pq.ParquetWriter, t: pa.Table, row_group_size: int | None = None) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full_disk)
    rows = random_rows(23, 30)
    chunks = [Chunk.from_rows(rows[i:i + 5]) for i in range(0, 30, 5)]
    with pytest.raises(OSError, match="No space"):
        write_file(tmp_path / "out.parquet", "parquet", "trl", chunks)
    assert list(tmp_path.iterdir()) == []


def test_json_rows_dumps_each_distinct_row_once_and_equals_dumping_every_row() -> None:
    # values equal in Python but not in JSON must not share a text: 0.0/-0.0, 1/1.0/True, [1]/[1.0]; NaN and
    # None are both null
    cols: dict[str, list[object]] = {
        "r": [0.0, -0.0, float("nan"), None, 1.0, 1.0, 2.5, None, 1e-05, 1e300],
        "n": [1, 1, True, 1, 1, 1.0, 2, 3, 1, 1],
        "s": ["x", "x", "y", None, "x", "x", "x", "x", "é", "x"],
        "v": [[1], [1.0], [True], [], [1], [1], [2, 3], [-0.0], [1], [1]],
        "d": [{"a": 1}, {"a": 1}, {}, {"b": [1]}, {"a": 1}, {"a": 1}, {}, {}, {}, {}],
    }
    rows = [{k: v[i] for k, v in cols.items()} for i in range(10)]
    assert json_rows(cols) == json_column(rows)
    assert json_rows({k: cols[k] for k in ("r", "n")})[4:6] == ['{"n":1,"r":1.0}', '{"n":1.0,"r":1.0}']
    rng = np.random.default_rng(7)
    many = {"a": rng.integers(0, 3, 5000).tolist(), "b": rng.choice([0.5, -0.0, 0.0, 2.0], 5000).tolist(),
            "c": rng.choice(["ok", "failed"], 5000).tolist(), "d": rng.normal(size=5000).tolist()}
    assert json_rows(many) == json_column([{k: v[i] for k, v in many.items()} for i in range(5000)])
    assert json_rows({"a": []}) == [] and json_rows({}) == []
