"""Pure mapping of a stored trajectory row to a trainer's record shape (no I/O)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

RECORD_SHAPES = ("openrlhf",)


def openrlhf_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """OpenRLHF agent-executor sample: ``observation_tokens`` + ``action_ranges`` + ``rollout_log_probs``.

    ``rollout_log_probs`` covers every position of ``observation_tokens`` (0.0 where the token was not sampled),
    as OpenRLHF's executor builds it; ``action_ranges`` are ``[start, end)`` spans of sampled ids.
    """
    tokens = list(row["token_ids"])
    return {
        "episode_id": row["episode_id"],
        "group_id": row["group_id"],
        "batch_id": row["batch_id"],
        "env": row["env"],
        "attempt": row["attempt"],
        "prompt": row["prompt_text"] or "",
        "label": json.dumps(row["task"], sort_keys=True),
        "observation_tokens": tokens,
        "action_ranges": [[int(a), int(b)] for a, b in (row["action_ranges"] or [])],
        "rollout_log_probs": [float(x) for x in row["logprobs"]],
        "truncated": row["status"] == "truncated",
        "reward": row["reward"],
        "scores": {"reward": row["reward"]},
        "status": row["status"],
        "extra_logs": {
            "num_turns": row["num_turns"],
            "prompt_len": row["prompt_len"],
            "num_sampled_tokens": row["num_sampled_tokens"],
            "weight_versions": sorted({int(v) for v in row["weight_versions"] if v >= 0}),
        },
    }
