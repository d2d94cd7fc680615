"""Pure mapping of a selected trajectory row to each trainer's sample shape (no I/O).

A row (``rows.decode_rows``) holds the trajectory's aligned arrays as numpy (``token_ids``, ``loss_mask``,
``logprobs``, ``weight_versions``), ``action_ranges`` and ``segments`` as ``[start, end)`` lists (and, optionally,
``range_versions``: the weight version of each action range), the chosen ``reward``, the group ``advantage`` and
ids. A trajectory becomes one sample per **span**:

- unit ``segment`` (default): one span per segment (a context the policy saw). Its prompt is the segment's
  tokens before its first sampled token (segment 0: the rendered prompt; a later segment: the re-rendered
  context, mask 0); its response runs to the end of the segment (sampled ids, mask 1, and the observation ids
  between turns, mask 0). A segment without sampled tokens has nothing to train and gives no sample.
- unit ``turn``: one span per sampled turn: the prompt is everything of its segment before the turn, the
  response is that turn's sampled ids.

Every sample carries the episode's reward and its group's advantage (and ids: trainers group by ``group_id``).
Array fields are numpy arrays (views, not copies); ``writers.py`` turns lists of records into Arrow columns.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa


class Unit(enum.StrEnum):
    """What one sample is."""

    SEGMENT = "segment"
    """One sample per segment (a context the policy saw)."""
    TURN = "turn"
    """One sample per sampled turn (its context within its segment as the prompt)."""


@dataclass(frozen=True)
class Span:
    """``[start, prompt_end)`` is a sample's prompt and ``[prompt_end, end)`` its response, in trajectory positions."""

    start: int
    prompt_end: int
    end: int
    index: int
    count: int


def span_bounds(segments: Sequence[Sequence[int]], action_ranges: Sequence[Sequence[int]],
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


def spans(row: Mapping[str, Any], unit: Unit = Unit.SEGMENT) -> list[Span]:
    """The samples a trajectory maps to (see the module docstring)."""
    out = span_bounds(row["segments"], row["action_ranges"], unit)
    return [Span(s, p, e, i, len(out)) for i, (s, p, e) in enumerate(out)]


def _ids(row: Mapping[str, Any], span: Span) -> dict[str, Any]:
    return {
        "episode_id": row["episode_id"], "group_id": row["group_id"], "batch_id": row["batch_id"],
        "env": row["env"], "attempt": row["attempt"], "sample_index": span.index, "num_samples": span.count,
    }


def _label(row: Mapping[str, Any]) -> str:
    return orjson.dumps(row["task"], option=orjson.OPT_SORT_KEYS).decode()


def _versions(row: Mapping[str, Any], lo: int, hi: int) -> list[int]:
    """Distinct weight versions of the sampled spans in [lo, hi) (an action range is sampled by one version: a turn a
    keep swap carried across two versions has two ranges)."""
    per_range = row.get("range_versions")
    if per_range is None:
        wv = row["weight_versions"]
        per_range = [int(wv[a]) if b > a else -1 for a, b in row["action_ranges"]]
    return sorted({v for (a, b), v in zip(row["action_ranges"], per_range, strict=True)
                   if lo <= a < hi and b > a and v >= 0})


def _reward_source(row: Mapping[str, Any]) -> str:
    return str(row.get("reward_source") or "rollout")


def openrlhf(row: Mapping[str, Any], span: Span) -> dict[str, Any]:
    """OpenRLHF agent executor: ``observation_tokens`` + ``action_ranges`` + ``rollout_log_probs`` (every position,
    0.0 where not sampled); ``action_ranges`` are the sample's trained spans, relative to its first token."""
    s, p, e = span.start, span.prompt_end, span.end
    actions = [[max(a, p) - s, min(b, e) - s] for a, b in row["action_ranges"] if a < e and b > p]
    return {
        **_ids(row, span),
        "prompt": row["prompt_text"] or "",
        "label": _label(row),
        "observation_tokens": row["token_ids"][s:e],
        "action_ranges": actions,
        "rollout_log_probs": row["logprobs"][s:e],
        "truncated": row["status"] == "truncated",
        "reward": row["reward"],
        "advantage": row["advantage"],
        "scores": {"reward": row["reward"], "advantage": row["advantage"]},
        "status": row["status"],
        "extra_logs": {
            "num_turns": row["num_turns"], "prompt_len": row["prompt_len"],
            "num_sampled_tokens": row["num_sampled_tokens"], "weight_versions": _versions(row, s, e),
            "reward_source": _reward_source(row), "rollout_reward": row["rollout_reward"],
        },
    }


SLIME_STATUS = {"completed": "completed", "truncated": "truncated"}
"""slime's ``Sample.Status`` of each trajectory status (anything else is ``aborted``); the columnar build uses it
too (``tables.py``)."""


def slime(row: Mapping[str, Any], span: Span) -> dict[str, Any]:
    """slime ``Sample``: ``tokens`` = prompt + response, ``loss_mask`` and ``rollout_log_probs`` over the response
    only, ``status`` completed / truncated / aborted (a failed trajectory is aborted), ``weight_versions`` as
    strings."""
    s, p, e = span.start, span.prompt_end, span.end
    return {
        **_ids(row, span),
        "index": row["group_index"],
        "prompt": row["prompt_text"] or "",
        "label": _label(row),
        "tokens": row["token_ids"][s:e],
        "response_length": e - p,
        "loss_mask": row["loss_mask"][p:e],
        "rollout_log_probs": row["logprobs"][p:e],
        "reward": row["reward"],
        "advantage": row["advantage"],
        "status": SLIME_STATUS.get(row["status"], "aborted"),
        "weight_versions": [str(v) for v in _versions(row, p, e)],
        "metadata": {"reward_source": _reward_source(row), "rollout_reward": row["rollout_reward"],
                     "num_turns": row["num_turns"], "rollout_status": row["status"]},
    }


def verl(row: Mapping[str, Any], span: Span) -> dict[str, Any]:
    """verl ``DataProto`` row, unpadded: ``prompts``, ``responses``, ``response_mask``, ``attention_mask`` and
    ``position_ids`` over prompt + response, ``rollout_log_probs`` over the response; ``uid`` = group id (what
    verl's GRPO groups by)."""
    s, p, e = span.start, span.prompt_end, span.end
    return {
        **_ids(row, span),
        "uid": row["group_id"],
        "prompts": row["token_ids"][s:p],
        "responses": row["token_ids"][p:e],
        "response_mask": row["loss_mask"][p:e],
        "attention_mask": np.ones(e - s, np.int32),
        "position_ids": np.arange(e - s, dtype=np.int32),
        "rollout_log_probs": row["logprobs"][p:e],
        "reward": row["reward"],
        "advantage": row["advantage"],
        "status": row["status"],
    }


def trl(row: Mapping[str, Any], span: Span) -> dict[str, Any]:
    """TRL GRPO: ``prompt_ids``, ``completion_ids``, ``completion_mask`` (1 on every real completion token),
    ``tool_mask`` (0 on environment/tool tokens; TRL trains on ``completion_mask * tool_mask``), ``logprobs``
    (the sampling logprobs, 0.0 on tool tokens)."""
    s, p, e = span.start, span.prompt_end, span.end
    return {
        **_ids(row, span),
        "prompt_ids": row["token_ids"][s:p],
        "completion_ids": row["token_ids"][p:e],
        "completion_mask": np.ones(e - p, np.int32),
        "tool_mask": row["loss_mask"][p:e],
        "logprobs": row["logprobs"][p:e],
        "reward": row["reward"],
        "advantage": row["advantage"],
        "status": row["status"],
    }


def full(row: Mapping[str, Any]) -> dict[str, Any]:
    """The whole stored record, one per trajectory (formats ``parquet`` and ``jsonl``)."""
    return {
        "episode_id": row["episode_id"], "batch_id": row["batch_id"], "group_id": row["group_id"],
        "group_index": row["group_index"], "env": row["env"], "attempt": row["attempt"], "status": row["status"],
        "failure_class": row["failure_class"], "reward": row["reward"], "reward_source": _reward_source(row),
        "rollout_reward": row["rollout_reward"], "advantage": row["advantage"], "group_size": row["group_size"],
        "task": row["task"], "prompt_text": row["prompt_text"],
        "token_ids": row["token_ids"], "loss_mask": row["loss_mask"], "logprobs": row["logprobs"],
        "weight_versions": row["weight_versions"], "action_ranges": row["action_ranges"],
        "segments": row["segments"], "num_segments": row["num_segments"], "token_check": row["token_check"],
        "drifts": row["drifts"], "prompt_len": row["prompt_len"], "num_tokens": row["num_tokens"],
        "num_sampled_tokens": row["num_sampled_tokens"], "num_turns": row["num_turns"],
        "created_at": row["created_at"],
    }


_I32 = pa.list_(pa.int32())
_F32 = pa.list_(pa.float32())
_RANGES = pa.list_(pa.list_(pa.int32()))
_IDS = [("episode_id", pa.string()), ("group_id", pa.string()), ("batch_id", pa.string()), ("env", pa.string()),
        ("attempt", pa.int32()), ("sample_index", pa.int32()), ("num_samples", pa.int32())]
_SCORES = [("reward", pa.float64()), ("advantage", pa.float64()), ("status", pa.string())]

SCHEMAS: dict[str, pa.Schema] = {
    "openrlhf": pa.schema([*_IDS, ("prompt", pa.string()), ("label", pa.string()), ("observation_tokens", _I32),
                           ("action_ranges", _RANGES), ("rollout_log_probs", _F32), ("truncated", pa.bool_()),
                           *_SCORES, ("scores", pa.string()), ("extra_logs", pa.string())]),
    "slime": pa.schema([*_IDS, ("index", pa.int32()), ("prompt", pa.string()), ("label", pa.string()),
                        ("tokens", _I32), ("response_length", pa.int32()), ("loss_mask", _I32),
                        ("rollout_log_probs", _F32), *_SCORES, ("weight_versions", pa.list_(pa.string())),
                        ("metadata", pa.string())]),
    "verl": pa.schema([*_IDS, ("uid", pa.string()), ("prompts", _I32), ("responses", _I32),
                       ("response_mask", _I32), ("attention_mask", _I32), ("position_ids", _I32),
                       ("rollout_log_probs", _F32), *_SCORES]),
    "trl": pa.schema([*_IDS, ("prompt_ids", _I32), ("completion_ids", _I32), ("completion_mask", _I32),
                      ("tool_mask", _I32), ("logprobs", _F32), *_SCORES]),
    "full": pa.schema([
        ("episode_id", pa.string()), ("batch_id", pa.string()), ("group_id", pa.string()),
        ("group_index", pa.int32()), ("env", pa.string()), ("attempt", pa.int32()), ("status", pa.string()),
        ("failure_class", pa.string()), ("reward", pa.float64()), ("reward_source", pa.string()),
        ("rollout_reward", pa.float64()), ("advantage", pa.float64()), ("group_size", pa.int32()),
        ("task", pa.string()), ("prompt_text", pa.string()), ("token_ids", _I32), ("loss_mask", _I32),
        ("logprobs", _F32), ("weight_versions", _I32), ("action_ranges", _RANGES), ("segments", _RANGES),
        ("num_segments", pa.int32()), ("token_check", pa.string()), ("drifts", pa.string()),
        ("prompt_len", pa.int32()), ("num_tokens", pa.int32()), ("num_sampled_tokens", pa.int32()),
        ("num_turns", pa.int32()), ("created_at", pa.timestamp("us", tz="UTC")),
    ]),
}
"""Arrow schema of each record shape (Parquet files and the Python API); dict/list-of-dict fields are JSON text."""

_ID_FIELDS = ("episode_id", "group_id", "batch_id", "env", "attempt", "status")
FIELDS: dict[str, tuple[str, ...] | None] = {
    "openrlhf": (*_ID_FIELDS, "prompt_text", "task", "num_turns", "prompt_len", "num_sampled_tokens",
                 "rollout_reward"),
    "slime": (*_ID_FIELDS, "group_index", "prompt_text", "task", "rollout_reward", "num_turns"),
    "verl": _ID_FIELDS,
    "trl": _ID_FIELDS,
    "full": None,
}
"""The stored row fields each shape reads besides the arrays and spans (None: all); the exporter reads no more."""

SampleFn = Callable[[Mapping[str, Any], Span], dict[str, Any]]
SAMPLE_SHAPES: dict[str, SampleFn] = {"openrlhf": openrlhf, "slime": slime, "verl": verl, "trl": trl}
"""Trainer shapes: one record per span."""

FORMATS = (*SAMPLE_SHAPES, "parquet", "jsonl")
"""``--format`` values: a trainer shape (written as Parquet or JSONL), or the full record as Parquet / JSONL."""


def records(row: Mapping[str, Any], shape: str, unit: Unit = Unit.SEGMENT) -> list[dict[str, Any]]:
    """All records of one row in ``shape`` (a trainer shape or ``full``)."""
    if shape == "full":
        return [full(row)]
    fn = SAMPLE_SHAPES.get(shape)
    if fn is None:
        raise ValueError(f"unknown record shape {shape!r}; known: {', '.join([*SAMPLE_SHAPES, 'full'])}")
    return [fn(row, span) for span in spans(row, unit)]
