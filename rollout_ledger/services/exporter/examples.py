"""The example records of docs/export.md, produced by the real record build (``tables.records``) from one
two-segment trajectory.

``python -m rollout_ledger.services.exporter.examples`` prints the block between the ``examples`` markers of
docs/export.md; tests/unit/test_export_examples.py fails when the document and the code disagree.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import numpy as np

from rollout_ledger.client.records import SAMPLE_SHAPES
from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.tables import records

BEGIN = "<!-- examples:begin (generated: python -m rollout_ledger.services.exporter.examples) -->"
END = "<!-- examples:end -->"


def example_row() -> dict[str, Any]:
    """A stored trajectory as the exporter reads it: prompt (4 ids), turn 1 (3 sampled + 2 observation ids), then a
    second segment (the whole conversation re-rendered: 6 ids, mask 0) and turn 2 (2 sampled ids)."""
    tok = np.array([1, 9690, 198, 2683, 504, 1386, 2, 198, 1, 1, 9690, 198, 2683, 2, 1, 71, 2], np.int32)
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1], np.int32)
    lp = np.where(mask == 1, np.array([0, 0, 0, 0, -0.25, -1.5, -0.125, 0, 0, 0, 0, 0, 0, 0, 0, -0.5, -0.0625]),
                  0).astype(np.float32)
    wv = np.where(mask == 1, np.array([0, 0, 0, 0, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8]), -1).astype(np.int32)
    return {
        "episode_id": "b1.3.1", "group_id": "b1.3", "batch_id": "b1", "group_index": 1, "env": "retail-orders",
        "attempt": 1, "status": "completed", "failure_class": None, "reward": 1.0, "rollout_reward": 1.0,
        "advantage": 0.866, "group_size": 4, "task": {"seed": 3}, "task_index": 3,
        "prompt_text": "<|im_start|>user\n...",
        "token_ids": tok, "loss_mask": mask, "logprobs": lp, "weight_versions": wv,
        "action_ranges": [[4, 7], [15, 17]], "segments": [[0, 9], [9, 17]], "num_segments": 2,
        "token_check": "ok", "drifts": [{"turn": 1, "class": "history_rewrite"}], "prompt_len": 4,
        "num_tokens": 17, "num_sampled_tokens": 5, "num_turns": 2,
        "created_at": dt.datetime(2026, 11, 23, 4, 0, tzinfo=dt.UTC), "reward_source": "rollout",
    }


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return [round(float(x), 4) if v.dtype.kind == "f" else int(x) for x in v]
    if isinstance(v, dt.datetime):
        return v.isoformat()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _json(rec: dict[str, Any]) -> str:
    lines = [f'  "{k}": {json.dumps(_plain(v))}' for k, v in rec.items()]
    return "{\n" + ",\n".join(lines) + "\n}"


def render() -> str:
    chunk = Chunk.from_rows([example_row()])
    out = [BEGIN, ""]
    for shape in (*SAMPLE_SHAPES, "full"):
        recs = records(chunk, shape)
        title = "parquet / jsonl (the full record)" if shape == "full" else shape
        what = ("one record per trajectory" if shape == "full"
                else f"{len(recs)} samples, one per segment: the second one's prompt is the re-rendered context")
        out += [f"#### {title}", "", f"{what}:", ""]
        for rec in recs:
            out += ["```json", _json(rec), "```", ""]
    out.append(END)
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
