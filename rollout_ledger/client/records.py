"""The record shapes a trainer takes (openrlhf, slime, verl, trl; ``full``, the whole stored record): their Arrow
schemas (``SCHEMAS``; the fields of JSON text are marked in them, ``json_fields``), the stored fields each reads
(``FIELDS``), and the samples a trajectory maps to (``samples``). ``tables.table`` builds every record of a chunk, by
column: it is the one definition of each shape, and the records of JSONL and the examples are read off its table
(``tables.records``).

A trajectory becomes one sample per unit:

- unit ``segment`` (default): one sample per segment (a context the policy saw). Its prompt is the segment's
  tokens before its first sampled token (segment 0: the rendered prompt; a later segment: the re-rendered
  context, mask 0); its response runs to the end of the segment (sampled ids, mask 1, and the observation ids
  between turns, mask 0). A segment without sampled tokens has nothing to train and gives no sample.
- unit ``turn``: one sample per sampled turn: the prompt is everything of its segment before the turn, the
  response is that turn's sampled ids.

Every sample carries the episode's reward and its group's advantage, its task and ids (trainers group by
``group_id``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


class Unit(enum.StrEnum):
    """What one sample is."""

    SEGMENT = "segment"
    """One sample per segment (a context the policy saw)."""
    TURN = "turn"
    """One sample per sampled turn (its context within its segment as the prompt)."""


@dataclass(frozen=True)
class SampleBounds:
    """``[start, prompt_end)`` is a sample's prompt and ``[prompt_end, end)`` its response, in trajectory positions;
    the ``index``-th of its trajectory's ``count`` samples."""

    start: int
    prompt_end: int
    end: int
    index: int
    count: int


def sample_bounds(segments: Sequence[Sequence[int]], action_ranges: Sequence[Sequence[int]],
                unit: Unit = Unit.SEGMENT) -> list[tuple[int, int, int]]:
    """(start, prompt_end, end) of each sample of a trajectory with these segments and action ranges."""
    ranges = [(a, b) for a, b in action_ranges if b > a]
    out: list[tuple[int, int, int]] = []
    if unit is Unit.SEGMENT:
        for s, e in segments:
            first = min((a for a, _ in ranges if s <= a < e), default=None)
            if first is not None:
                out.append((s, first, e))
    else:
        for a, b in ranges:
            s = next((s for s, e in segments if s <= a < e), 0)
            out.append((s, a, b))
    return out


def samples(row: Mapping[str, Any], unit: Unit = Unit.SEGMENT) -> list[SampleBounds]:
    """The samples a trajectory maps to (see the module docstring)."""
    out = sample_bounds(row["segments"], row["action_ranges"], unit)
    return [SampleBounds(s, p, e, i, len(out)) for i, (s, p, e) in enumerate(out)]


SLIME_STATUS = {"completed": "completed", "truncated": "truncated"}
"""slime's ``Sample.Status`` of each trajectory status (anything else is ``aborted``)."""


JSON_TEXT = b"rollout_ledger.json"
"""Arrow field metadata key marking a string field as the JSON text of a value (an object, a list...): Parquet and
the Python API hold the text (sorted keys), JSONL and ``tables.records`` the value. ``label`` is JSON text too, but
a trainer takes it as a string: it is not marked and stays text everywhere."""


def _json(name: str) -> pa.Field:
    return pa.field(name, pa.string(), metadata={JSON_TEXT: b"true"})


def json_fields(schema: pa.Schema) -> tuple[str, ...]:
    """The fields of ``schema`` that hold JSON text (``JSON_TEXT``)."""
    return tuple(f.name for f in schema if f.metadata and f.metadata.get(JSON_TEXT) == b"true")


_I32 = pa.list_(pa.int32())
_F32 = pa.list_(pa.float32())
_RANGES = pa.list_(pa.list_(pa.int32()))
_IDS = [("episode_id", pa.string()), ("group_id", pa.string()), ("batch_id", pa.string()), ("env", pa.string()),
        ("attempt", pa.int32()), ("sample_index", pa.int32()), ("num_samples", pa.int32())]
_SCORES = [("reward", pa.float64()), ("advantage", pa.float64()), ("status", pa.string())]
_TASK = [_json("task"), ("task_index", pa.int32())]
"""Last in every trainer shape (added after the others: a reader of the older columns finds them where they were)."""

SCHEMAS: dict[str, pa.Schema] = {
    "openrlhf": pa.schema([*_IDS, ("prompt", pa.string()), ("label", pa.string()), ("observation_tokens", _I32),
                           ("action_ranges", _RANGES), ("rollout_log_probs", _F32), ("truncated", pa.bool_()),
                           *_SCORES, _json("scores"), _json("extra_logs"), *_TASK]),
    "slime": pa.schema([*_IDS, ("index", pa.int32()), ("prompt", pa.string()), ("label", pa.string()),
                        ("tokens", _I32), ("response_length", pa.int32()), ("loss_mask", _I32),
                        ("rollout_log_probs", _F32), *_SCORES, ("weight_versions", pa.list_(pa.string())),
                        _json("metadata"), *_TASK]),
    "verl": pa.schema([*_IDS, ("uid", pa.string()), ("prompts", _I32), ("responses", _I32),
                       ("response_mask", _I32), ("attention_mask", _I32), ("position_ids", _I32),
                       ("rollout_log_probs", _F32), *_SCORES, *_TASK]),
    "trl": pa.schema([*_IDS, ("prompt_ids", _I32), ("completion_ids", _I32), ("completion_mask", _I32),
                      ("tool_mask", _I32), ("logprobs", _F32), *_SCORES, *_TASK]),
    "full": pa.schema([
        ("episode_id", pa.string()), ("batch_id", pa.string()), ("group_id", pa.string()),
        ("group_index", pa.int32()), ("env", pa.string()), ("attempt", pa.int32()), ("status", pa.string()),
        ("failure_class", pa.string()), ("reward", pa.float64()), ("reward_source", pa.string()),
        ("rollout_reward", pa.float64()), ("advantage", pa.float64()), ("group_size", pa.int32()),
        _json("task"), ("prompt_text", pa.string()), ("token_ids", _I32), ("loss_mask", _I32),
        ("logprobs", _F32), ("weight_versions", _I32), ("action_ranges", _RANGES), ("segments", _RANGES),
        ("num_segments", pa.int32()), ("token_check", pa.string()), _json("drifts"),
        ("prompt_len", pa.int32()), ("num_tokens", pa.int32()), ("num_sampled_tokens", pa.int32()),
        ("num_turns", pa.int32()), ("created_at", pa.timestamp("us", tz="UTC")), ("task_index", pa.int32()),
    ]),
}
"""Arrow schema of each record shape (Parquet files, JSONL's keys and the Python API); the fields marked
``JSON_TEXT`` hold JSON text. ``tables.table`` builds them (what each field holds: docs/export.md)."""

_ID_FIELDS = ("episode_id", "group_id", "batch_id", "env", "attempt", "status", "task", "task_index")
FIELDS: dict[str, tuple[str, ...] | None] = {
    "openrlhf": (*_ID_FIELDS, "prompt_text", "num_turns", "prompt_len", "num_sampled_tokens", "rollout_reward"),
    "slime": (*_ID_FIELDS, "group_index", "prompt_text", "rollout_reward", "num_turns"),
    "verl": _ID_FIELDS,
    "trl": _ID_FIELDS,
    "full": None,
}
"""The stored row fields each shape reads besides the arrays and spans (None: all); the exporter reads no more."""

SAMPLE_SHAPES = ("openrlhf", "slime", "verl", "trl")
"""Trainer shapes: one record per span."""

DOCUMENT_FORMATS = ("atif",)
"""Formats of one JSON document per trajectory, mapped by the exporter (``services/exporter/atif.py``: the Agent
Trajectory Interchange Format), not record shapes of this package; written as JSONL."""

FORMATS = (*SAMPLE_SHAPES, "parquet", "jsonl", *DOCUMENT_FORMATS)
"""``--format`` values: a trainer shape (written as Parquet or JSONL), the full record as Parquet / JSONL, or a
document format (JSONL)."""
