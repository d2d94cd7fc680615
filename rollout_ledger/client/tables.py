"""Arrow tables of each record shape: ``table`` builds every record of a ``Chunk`` column by column, and is the one
definition of each shape (Parquet and the Python API take its table; JSONL and the examples its rows, ``records``),
without a Python dict per record or a Python object per token.

A token column of a sample shape is one gather from the chunk's flat array (``[start, end)`` of every sample, as
numpy index arithmetic); the full record's token columns are the flat arrays themselves under the chunk's offsets
(no copy). What stays per sample in Python is small: its span, its trained ranges, weight versions and JSON text.
tests/unit/test_export_records.py and test_export_tables.py hold each shape to hand-computed records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from rollout_ledger.client.records import SCHEMAS, SLIME_STATUS, Unit, json_fields
from rollout_ledger.client.rows import Chunk, by_code, offsets, runs


def _json_text(v: Any) -> str | None:
    """The JSON text of ``v`` (sorted keys); None stays None (a null field)."""
    if v is None:
        return None
    return orjson.dumps(v, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()


def _numpy_type(typ: pa.DataType) -> np.dtype[Any]:
    """The numpy dtype of a numeric Arrow type (``DataType.to_pandas_dtype`` looks for pandas on every call)."""
    return np.dtype(("f" if pa.types.is_floating(typ) else "i") + str(typ.bit_width // 8))


def _each_once(values: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``[fn(v) for v in values]``, calling ``fn`` once per distinct object: rows whose JSON text was the same share
    one parsed value (``source._parsed``). The distinct objects are found by numpy over their ids (no Python
    loop over the rows)."""
    if not values:
        return []
    _, first, inverse = np.unique(np.fromiter(map(id, values), np.int64, len(values)), return_index=True,
                                  return_inverse=True)
    return by_code([fn(values[i]) for i in first.tolist()], inverse.reshape(-1))


class Samples:
    """The samples of a chunk: for each, its row and ``[start, prompt_end, end)`` in the chunk's flat arrays,
    found for the whole chunk at once (``records.sample_bounds`` per trajectory is the reference; the chunk's
    segments and ranges are ordered and disjoint, ``Chunk.build`` checks it)."""

    def __init__(self, chunk: Chunk, unit: Unit) -> None:
        n = len(chunk)
        offsets = chunk.offsets
        seg_lo, seg_hi = chunk.segments.lo, chunk.segments.hi
        seg_row = np.repeat(np.arange(n), np.diff(chunk.segments.offsets))
        rlo, rhi = chunk.ranges.lo, chunk.ranges.hi
        sampled = rhi > rlo
        a, b = rlo[sampled], rhi[sampled]
        if unit is Unit.SEGMENT:
            i = np.searchsorted(a, seg_lo)
            first = a[np.minimum(i, len(a) - 1)] if len(a) else np.zeros(len(i), np.int64)
            has = (i < len(a)) & (first < seg_hi)
            rows, start, prompt_end, end = seg_row[has], seg_lo[has], first[has], seg_hi[has]
        else:
            rows = np.searchsorted(offsets, a, side="right") - 1
            k = np.searchsorted(seg_lo, a, side="right") - 1
            kk = np.maximum(k, 0)
            inside = (k >= 0) & (seg_row[kk] == rows) & (a < seg_hi[kk]) if len(seg_lo) else np.zeros(len(a), bool)
            start = np.where(inside, seg_lo[kk] if len(seg_lo) else 0, offsets[rows])
            prompt_end, end = a, b
        count = np.bincount(rows, minlength=n) if n else np.zeros(0, np.int64)
        first_of_row = np.cumsum(count) - count
        self.chunk = chunk
        self.rows = rows.astype(np.int64)
        self.start, self.prompt_end, self.end = start, prompt_end, end
        base = offsets[:-1][self.rows]
        self.rel = np.stack([start - base, prompt_end - base, end - base], axis=1).reshape(-1, 3)
        """Sample bounds relative to their trajectory (what records carry)."""
        self.index = (np.arange(len(rows)) - first_of_row[rows]).tolist()
        self.count = count[rows].tolist()
        self._one_each = len(rows) == n and bool(np.all(count == 1))

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str) -> pa.Array:
        """A per-row column repeated for each of the row's samples."""
        col = self.chunk.columns[name]
        return col if self._one_each else col.take(pa.array(self.rows))

    def json(self, name: str) -> list[Any]:
        """A per-row JSON field (Python values) repeated for each of the row's samples."""
        col = self.chunk.json[name]
        return col if self._one_each else [col[i] for i in self.rows.tolist()]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Arrow ``list`` offsets (int32)."""
    return offsets(lengths, np.int32)


def _list(values: np.ndarray, offsets: np.ndarray, typ: pa.DataType) -> pa.Array:
    value_type = typ.value_type
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(
        values.astype(_numpy_type(value_type), copy=False), type=value_type))


def slices(flat: np.ndarray, lo: np.ndarray, hi: np.ndarray, typ: pa.DataType) -> pa.Array:
    """``flat[lo[k]:hi[k]]`` for every k as one ``list<...>`` column (one gather, no Python per sample)."""
    lengths = hi - lo
    offsets = _offsets(lengths)
    total = int(offsets[-1])
    if len(lo) == 0:
        values = flat[:0]
    elif np.array_equal(lo[1:], hi[:-1]):
        values = flat[int(lo[0]):int(hi[-1])]
    elif np.all(lo[1:] >= hi[:-1]):  # disjoint and in order: keep those positions
        values = flat[runs(len(flat), lo, hi, True, False, np.bool_)]
    else:
        values = flat[np.repeat(lo - offsets[:-1], lengths) + np.arange(total, dtype=np.int64)]
    return _list(values, offsets, typ)


def _filled(lengths: np.ndarray, typ: pa.DataType, fill: Callable[[int, np.ndarray], np.ndarray]) -> pa.Array:
    offsets = _offsets(lengths)
    return _list(fill(int(offsets[-1]), offsets), offsets, typ)


def _ones(lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    return _filled(lengths, typ, lambda total, _: np.ones(total, np.int32))


def _positions(lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    return _filled(lengths, typ, lambda total, off: np.arange(total, dtype=np.int32)
                   - np.repeat(off[:-1], lengths).astype(np.int32))


def span_versions(s: Samples, lo: np.ndarray) -> pa.Array:
    """Sorted distinct weight versions of the sampled turns starting in ``[lo[k], end[k])`` of each sample k, as
    one ``list<int32>`` column: each non-empty range with a version is assigned to the sample it starts in by one
    ``searchsorted`` when the windows are disjoint (samples are ordered in the chunk's positions); overlapping
    windows (per-turn samples over their whole segment) are counted one by one."""
    rlo, rhi, rv = s.chunk.ranges.lo, s.chunk.ranges.hi, s.chunk.ranges.versions
    assert rv is not None
    keep = (rhi > rlo) & (rv >= 0)
    starts, vers = rlo[keep], rv[keep].astype(np.int64)
    if np.any(lo[1:] < s.end[:-1]):
        first, last = np.searchsorted(starts, lo).tolist(), np.searchsorted(starts, s.end).tolist()
        got = [sorted(set(vers[i:j].tolist())) for i, j in zip(first, last, strict=True)]
        return pa.array(got, pa.list_(pa.int32()))
    k = np.searchsorted(lo, starts, side="right") - 1
    inside = k >= 0
    inside[inside] = starts[inside] < s.end[k[inside]]
    pairs = np.unique((k[inside] << 32) | vers[inside])
    counts = np.bincount(pairs >> 32, minlength=len(s)) if len(s) else np.zeros(0, np.int64)
    return _list((pairs & 0xFFFFFFFF).astype(np.int32), _offsets(counts), pa.list_(pa.int32()))


def json_column(values: Sequence[Any]) -> list[str | None]:
    """JSON text of each value (sorted keys; None stays null): what a field marked ``records.JSON_TEXT`` holds."""
    return [_json_text(v) for v in values]


_NAN_BITS = np.float64("nan").view(np.int64)


def _key(v: Any) -> Any:
    """A hashable key equal only for values with the same JSON text: floats by their exact hex (0.0 and -0.0
    differ), every value with its type (1, 1.0 and True differ), lists item by item."""
    if isinstance(v, float):
        return float, v.hex()
    if isinstance(v, list):
        return list, tuple(_key(x) for x in v)
    return type(v), v


def _factorize(values: Sequence[Any] | pa.Array) -> tuple[np.ndarray, int]:
    """Codes of ``values`` such that equal codes mean the same JSON text, and how many distinct codes (a column
    of floats and None: by bits, NaN and None both being JSON null; an Arrow column of another type by value, null
    being one value; anything else by ``_key``; unhashable values each get their own code)."""
    n = len(values)
    floats = isinstance(values, pa.Array) and pa.types.is_floating(values.type)
    if isinstance(values, pa.Array) and not floats:
        encoded = pc.dictionary_encode(values, null_encoding="encode")
        return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), len(encoded.dictionary)
    if n and (floats or set(map(type, values)) <= {float, type(None)}):
        arr = values.to_numpy(zero_copy_only=False).astype(np.float64) if isinstance(values, pa.Array) \
            else np.array(values, dtype=np.float64)
        bits = arr.view(np.int64).copy()
        bits[np.isnan(arr)] = _NAN_BITS
        uniq, codes = np.unique(bits, return_inverse=True)
        return codes.reshape(-1), len(uniq)
    memo: dict[Any, int] = {}
    try:
        return np.fromiter((memo.setdefault(_key(v), len(memo)) for v in values), np.int64, n), len(memo)
    except TypeError:
        return np.arange(n, dtype=np.int64), n


def json_rows(columns: dict[str, Sequence[Any] | pa.Array]) -> list[str | None]:
    """``json_column`` of the dicts ``{name: columns[name][i]}`` for every i, dumping each distinct row once
    (records of a chunk repeat the same few values: turns, statuses, rewards)."""
    names = list(columns)
    n = len(columns[names[0]]) if names else 0
    key = np.zeros(n, np.int64)
    distinct = 1
    for name in names:
        codes, k = _factorize(columns[name])
        if distinct * max(k, 1) >= 1 << 62:
            uniq, key = np.unique(key, return_inverse=True)
            key, distinct = key.reshape(-1), len(uniq)
            if distinct * max(k, 1) >= 1 << 62:
                every = {m: _pylist(columns[m]) for m in names}
                return json_column([{m: every[m][i] for m in names} for i in range(n)])
        key = key * max(k, 1) + codes
        distinct *= max(k, 1)
    if not n:
        return []
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    picked = {m: _pylist(columns[m], first) for m in names}
    texts = np.empty(len(first), object)
    texts[:] = json_column([{m: picked[m][j] for m in names} for j in range(len(first))])
    return texts[inverse.reshape(-1)].tolist()


def _pylist(values: Sequence[Any] | pa.Array, at: np.ndarray | None = None) -> list[Any]:
    """Python values of a column (those at positions ``at`` only, when given)."""
    if isinstance(values, pa.Array):
        return (values if at is None else values.take(pa.array(at))).to_pylist()
    return list(values) if at is None else [values[i] for i in at.tolist()]


def _labels(tasks: list[str | None]) -> list[str]:
    """The task's JSON text (``_ids``'s ``task``) as a string label: a null task is ``"null"``."""
    return ["null" if t is None else t for t in tasks]


def _ids(s: Samples) -> dict[str, Any]:
    """The fields every trainer shape carries: ids, the sample's place in its trajectory, the task and its index."""
    return {"episode_id": s.column("episode_id"), "group_id": s.column("group_id"),
            "batch_id": s.column("batch_id"), "env": s.column("env"), "attempt": s.column("attempt"),
            "sample_index": s.index, "num_samples": s.count, "task": _each_once(s.json("task"), _json_text),
            "task_index": s.column("task_index")}


def _text(value: str) -> pa.Scalar:
    """A string scalar for a compute function (given a Python str, pyarrow looks for pandas on every call)."""
    return pa.scalar(value, pa.string())


def _or(col: pa.Array, default: str) -> pa.Array:
    """``v or default`` for every value of a string column (null and empty become ``default``)."""
    col = col.cast(pa.string())
    empty = pc.fill_null(pc.equal(col, _text("")), pa.scalar(True, pa.bool_()))
    return pc.if_else(empty, _text(default), col)


def _sources(s: Samples) -> pa.Array:
    return _or(s.column("reward_source"), "rollout")


def trained_ranges(s: Samples, typ: pa.DataType) -> pa.Array:
    """Each sample's action ranges that overlap its response ``[prompt_end, end)`` (an empty range strictly
    inside counts), clipped to it and relative to the sample's start, as one ``list<list<int32>>`` column: ranges
    are ordered and disjoint, so a sample's are the contiguous run found by two ``searchsorted``."""
    lo, hi = s.chunk.ranges.lo, s.chunk.ranges.hi
    first = np.searchsorted(hi, s.prompt_end, side="right")
    last = np.maximum(np.searchsorted(lo, s.end, side="left"), first)
    counts = last - first
    outer = _offsets(counts)
    at = np.repeat(first - outer[:-1], counts) + np.arange(int(outer[-1]), dtype=np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    pairs = np.stack([np.maximum(lo[at], s.prompt_end[owner]), np.minimum(hi[at], s.end[owner])], axis=1)
    pairs -= s.start[owner][:, None]
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * len(at) + 1, 2, dtype=np.int32)),
                                     pa.array(pairs.reshape(-1).astype(np.int32), pa.int32()))
    return pa.ListArray.from_arrays(pa.array(outer), inner, type=typ)


def _nested(spans_lo: np.ndarray, spans_hi: np.ndarray, row_offsets: np.ndarray, base: np.ndarray,
            typ: pa.DataType) -> pa.Array:
    """Every row's ``[start, end)`` pairs, relative to the row, as one ``list<list<int32>>`` column."""
    owner = np.repeat(np.arange(len(row_offsets) - 1), np.diff(row_offsets))
    pairs = np.stack([spans_lo - base[owner], spans_hi - base[owner]], axis=1).reshape(-1).astype(np.int32)
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, len(pairs) + 1, 2, dtype=np.int32)),
                                     pa.array(pairs, pa.int32()))
    return pa.ListArray.from_arrays(pa.array(row_offsets.astype(np.int32)), inner, type=typ)


def _openrlhf(s: Samples) -> dict[str, Any]:
    """OpenRLHF agent executor: ``observation_tokens`` + ``action_ranges`` + ``rollout_log_probs`` (every position,
    0.0 where not sampled); ``action_ranges`` are the sample's trained spans, relative to its first token."""
    arr, f = s.chunk.arrays, SCHEMAS["openrlhf"]
    actions = trained_ranges(s, f.field("action_ranges").type)
    reward, advantage = s.column("reward"), s.column("advantage")
    logs = json_rows({"num_turns": s.column("num_turns"), "prompt_len": s.column("prompt_len"),
                      "num_sampled_tokens": s.column("num_sampled_tokens"),
                      "weight_versions": span_versions(s, s.start).to_pylist(), "reward_source": _sources(s),
                      "rollout_reward": s.column("rollout_reward")})
    ids = _ids(s)
    return {
        **ids,
        "prompt": _or(s.column("prompt_text"), ""),
        "label": _labels(ids["task"]),
        "observation_tokens": slices(arr["token_ids"], s.start, s.end, f.field("observation_tokens").type),
        "action_ranges": actions,
        "rollout_log_probs": slices(arr["logprobs"], s.start, s.end, f.field("rollout_log_probs").type),
        "truncated": pc.fill_null(pc.equal(s.column("status"), _text("truncated")), pa.scalar(False, pa.bool_())),
        "reward": reward,
        "advantage": advantage,
        "scores": json_rows({"reward": reward, "advantage": advantage}),
        "status": s.column("status"),
        "extra_logs": logs,
    }


def _slime(s: Samples) -> dict[str, Any]:
    """slime ``Sample``: ``tokens`` = prompt + response, ``loss_mask`` and ``rollout_log_probs`` over the response
    only, ``status`` completed / truncated / aborted (a failed trajectory is aborted), ``weight_versions`` as
    strings."""
    arr, f = s.chunk.arrays, SCHEMAS["slime"]
    status = s.column("status")
    slime_status = pc.fill_null(pa.array(list(SLIME_STATUS.values()), pa.string()).take(
        pc.index_in(status, value_set=pa.array(list(SLIME_STATUS), pa.string()))), _text("aborted"))
    meta = json_rows({"reward_source": _sources(s), "rollout_reward": s.column("rollout_reward"),
                      "num_turns": s.column("num_turns"), "rollout_status": status})
    ids = _ids(s)
    return {
        **ids,
        "index": s.column("group_index"),
        "prompt": _or(s.column("prompt_text"), ""),
        "label": _labels(ids["task"]),
        "tokens": slices(arr["token_ids"], s.start, s.end, f.field("tokens").type),
        "response_length": pa.array((s.end - s.prompt_end).astype(np.int32)),
        "loss_mask": slices(arr["loss_mask"], s.prompt_end, s.end, f.field("loss_mask").type),
        "rollout_log_probs": slices(arr["logprobs"], s.prompt_end, s.end, f.field("rollout_log_probs").type),
        "reward": s.column("reward"),
        "advantage": s.column("advantage"),
        "status": slime_status,
        "weight_versions": span_versions(s, s.prompt_end).cast(f.field("weight_versions").type),
        "metadata": meta,
    }


def _verl(s: Samples) -> dict[str, Any]:
    """verl ``DataProto`` row, unpadded: ``prompts``, ``responses``, ``response_mask``, ``attention_mask`` and
    ``position_ids`` over prompt + response, ``rollout_log_probs`` over the response; ``uid`` = group id (what
    verl's GRPO groups by)."""
    arr, f = s.chunk.arrays, SCHEMAS["verl"]
    return {
        **_ids(s),
        "uid": s.column("group_id"),
        "prompts": slices(arr["token_ids"], s.start, s.prompt_end, f.field("prompts").type),
        "responses": slices(arr["token_ids"], s.prompt_end, s.end, f.field("responses").type),
        "response_mask": slices(arr["loss_mask"], s.prompt_end, s.end, f.field("response_mask").type),
        "attention_mask": _ones(s.end - s.start, f.field("attention_mask").type),
        "position_ids": _positions(s.end - s.start, f.field("position_ids").type),
        "rollout_log_probs": slices(arr["logprobs"], s.prompt_end, s.end, f.field("rollout_log_probs").type),
        "reward": s.column("reward"),
        "advantage": s.column("advantage"),
        "status": s.column("status"),
    }


def _trl(s: Samples) -> dict[str, Any]:
    """TRL GRPO: ``prompt_ids``, ``completion_ids``, ``completion_mask`` (1 on every real completion token),
    ``tool_mask`` (0 on environment/tool tokens; TRL trains on ``completion_mask * tool_mask``), ``logprobs``
    (the sampling logprobs, 0.0 on tool tokens)."""
    arr, f = s.chunk.arrays, SCHEMAS["trl"]
    return {
        **_ids(s),
        "prompt_ids": slices(arr["token_ids"], s.start, s.prompt_end, f.field("prompt_ids").type),
        "completion_ids": slices(arr["token_ids"], s.prompt_end, s.end, f.field("completion_ids").type),
        "completion_mask": _ones(s.end - s.prompt_end, f.field("completion_mask").type),
        "tool_mask": slices(arr["loss_mask"], s.prompt_end, s.end, f.field("tool_mask").type),
        "logprobs": slices(arr["logprobs"], s.prompt_end, s.end, f.field("logprobs").type),
        "reward": s.column("reward"),
        "advantage": s.column("advantage"),
        "status": s.column("status"),
    }


def _full(chunk: Chunk) -> dict[str, Any]:
    """The whole stored record, one per trajectory (formats ``parquet`` and ``jsonl``)."""
    f, cols = SCHEMAS["full"], chunk.columns
    offsets = chunk.offsets.astype(np.int32)
    out: dict[str, Any] = {name: cols[name] for name in f.names if name in cols}
    out["reward_source"] = _or(cols["reward_source"], "rollout")
    for name in json_fields(f):
        out[name] = _each_once(chunk.json[name], _json_text)
    for name in ("token_ids", "loss_mask", "logprobs", "weight_versions"):
        out[name] = _list(chunk.arrays[name], offsets, f.field(name).type)
    base = chunk.offsets[:-1]
    out["action_ranges"] = _nested(chunk.ranges.lo, chunk.ranges.hi, chunk.ranges.offsets, base,
                                   f.field("action_ranges").type)
    out["segments"] = _nested(chunk.segments.lo, chunk.segments.hi, chunk.segments.offsets, base,
                              f.field("segments").type)
    return out


_SAMPLE_COLUMNS: dict[str, Callable[[Samples], dict[str, Any]]] = {
    "openrlhf": _openrlhf, "slime": _slime, "verl": _verl, "trl": _trl}


def table(chunk: Chunk, shape: str, unit: Unit = Unit.SEGMENT) -> pa.Table:
    """The Arrow table of every record of ``chunk`` in ``shape`` (a trainer shape or ``full``)."""
    schema = SCHEMAS.get(shape)
    if schema is None:
        raise ValueError(f"unknown record shape {shape!r}; known: {', '.join(SCHEMAS)}")
    if len(chunk) == 0:
        return schema.empty_table()
    values = _full(chunk) if shape == "full" else _SAMPLE_COLUMNS[shape](Samples(chunk, unit))
    columns: list[pa.Array] = []
    for field in schema:
        v = values[field.name]
        if isinstance(v, pa.Array):
            columns.append(v if v.type == field.type else v.cast(field.type))
        else:
            columns.append(pa.array(v, type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _json_values(col: pa.Array) -> list[Any]:
    """A column of JSON text parsed, each distinct text once (records that hold the same text share one value,
    which readers must not change); null stays None."""
    encoded = pc.dictionary_encode(col)
    values = [*map(orjson.loads, encoded.dictionary.to_pylist()), None]  # the last one: null
    codes = pc.fill_null(encoded.indices, pa.scalar(len(values) - 1, encoded.indices.type))
    return by_code(values, codes.to_numpy())


def rows_of(t: pa.Table) -> list[dict[str, Any]]:
    """The records of a table of ``SCHEMAS`` as dicts, in its column order: number lists as numpy views of the
    table's buffers (their values exactly, e.g. float32), the fields marked ``records.JSON_TEXT`` as the JSON
    values they hold, every other field as Python values (nested lists, strings, datetimes...)."""
    texts = set(json_fields(t.schema))
    columns: list[list[Any]] = []
    for f in t.schema:
        col = t.column(f.name).combine_chunks()
        if f.name in texts:
            columns.append(_json_values(col))
        elif pa.types.is_list(f.type) and (pa.types.is_integer(f.type.value_type)
                                           or pa.types.is_floating(f.type.value_type)) and col.null_count == 0:
            at = col.offsets.to_numpy().tolist()
            values = col.values.to_numpy(zero_copy_only=False)
            columns.append([values[a:b] for a, b in pairwise(at)])
        else:
            columns.append(col.to_pylist())
    names = t.column_names
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def records(chunk: Chunk, shape: str, unit: Unit = Unit.SEGMENT) -> list[dict[str, Any]]:
    """Every record of ``chunk`` in ``shape`` as a dict (JSONL, the examples): the rows of ``table`` (``rows_of``)."""
    return rows_of(table(chunk, shape, unit))
