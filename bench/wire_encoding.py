"""Wire-encoding benchmark for token arrays, side by side in one run.

For one TurnGenerated event per size: encode + decode + validation into the event model with
(a) JSON lists of ints, (b) JSON with base64 int32 arrays, (c) msgpack with raw little-endian ``bin`` arrays
(what rollout_ledger/shared/events.encode uses). Run: `python bench/wire_encoding.py` (part of `make bench`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel

from rollout_ledger.shared.events import FinishReason, TurnGenerated, decode_as, encode, to_json


class TurnAsLists(BaseModel):
    """The same event with token arrays as plain JSON lists (the alternative measured)."""

    event_id: str
    episode_id: str
    batch_id: str
    attempt: int
    seq: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


def _event(n: int) -> TurnGenerated:
    rng = np.random.default_rng(0)
    return TurnGenerated(
        event_id="b.0.0:a1:t0:r1", episode_id="b.0.0", batch_id="b", attempt=1, seq=1, produced_by="bench",
        request_id="b.0.0:a1:t0:r1", turn_index=0, prompt_len=100,
        token_ids=rng.integers(0, 49152, n, dtype=np.int32), logprobs=-rng.random(n, dtype=np.float32),
        finish_reason=FinishReason.STOP, weight_version=0, engine="fake", worker_id="w", queue_ms=0.1,
        generate_ms=1.0,
    )


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def run(sizes: tuple[int, ...] = (64, 512, 4096)) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        ev = _event(n)
        reps = max(200, 100_000 // n)
        lists = TurnAsLists(event_id=ev.event_id, episode_id=ev.episode_id, batch_id=ev.batch_id, attempt=1, seq=1,
                            token_ids=ev.token_ids.tolist(), logprobs=ev.logprobs.tolist(), finish_reason="stop",
                            weight_version=0)

        def _lists(lists: TurnAsLists = lists) -> None:
            d = TurnAsLists.model_validate_json(lists.model_dump_json())
            np.asarray(d.token_ids, dtype=np.int32)
            np.asarray(d.logprobs, dtype=np.float32)

        t_list = _time(_lists, reps)
        t_b64 = _time(lambda ev=ev: decode_as(to_json(ev), TurnGenerated), reps)
        t_mp = _time(lambda ev=ev: decode_as(encode(ev), TurnGenerated), reps)
        rows.append({
            "tokens": n,
            "json_lists_us": round(t_list, 1), "json_base64_us": round(t_b64, 1), "msgpack_bin_us": round(t_mp, 1),
            "json_lists_bytes": len(lists.model_dump_json()), "json_base64_bytes": len(to_json(ev)),
            "msgpack_bytes": len(encode(ev)),
            "lists_over_msgpack": round(t_list / t_mp, 1),
        })
    return rows


if __name__ == "__main__":
    json.dump(run(), sys.stdout, indent=1)
    print()
