"""Regenerates the pinned contract: tests/contract/schemas/*.json (each event type's JSON schema) and
tests/contract/events/v<major>/*.msgpack (one example event of each type, as bytes on the bus).

Run it only for a deliberate, reviewed contract change (`python -m tests.contract.snapshot`). The example events
of an older major are never rewritten: they stay as what producers of that version put on the bus, and the
current code must keep reading them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import numpy as np
from pydantic import BaseModel

from rollout_ledger.shared.events import (
    SCHEMA_VERSION,
    ContextPolicy,
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    Event,
    FailureClass,
    FinishReason,
    InferenceRequested,
    SamplingParams,
    StepCompleted,
    ToolCallConstraint,
    TrajectoryStatus,
    TurnGenerated,
    encode,
)

HERE = Path(__file__).parent
SCHEMAS = HERE / "schemas"
EVENTS = HERE / "events"

_TIME = datetime(2026, 11, 24, 12, 0, 0, tzinfo=UTC)
_ENV = {"episode_id": "b.0.0", "batch_id": "b", "attempt": 1, "produced_by": "snapshot/1", "time": _TIME}
_IDS = np.array([1, 9690, 198, 49151, 0], dtype=np.int32)
_LPS = np.array([-0.5, -1e-6, -12.25, 0.0, -3.0], dtype=np.float32)


def event_schemas() -> dict[str, dict[str, Any]]:
    """JSON schema of each event type of the contract's ``Event`` union, keyed by ``type`` (what the snapshots pin)."""
    models: tuple[type[BaseModel], ...] = get_args(get_args(Event)[0])
    return {model.model_fields["type"].default: model.model_json_schema() for model in models}


def examples() -> list[BaseModel]:
    """One event of each type with every optional field set (what a producer of this version writes)."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=64, stop=["</s>"], seed=3, logprobs=2)
    forced = sampling.model_copy(update={"tool_call": ToolCallConstraint(
        names=["add", "mul"], parameters={"add": {"type": "object", "properties": {"a": {"type": "integer"}}}})})
    return [
        EpisodeRequested(event_id="b.0.0:requested", seq=0, env="arithmetic", task={"seed": 1, "nested": [1, "x"]},
                         group_id="b.0", group_index=0, group_size=4, sampling=sampling, max_turns=3,
                         context=ContextPolicy(policy="window", window_turns=2), attempt_base=1,
                         failures={"env": 1}, **_ENV),
        EpisodeStarted(event_id="b.0.0:a1:started", seq=0, env="arithmetic", worker_id="w", prompt_token_ids=_IDS,
                       prompt_text="<|im_start|>user\nhi", messages=[{"role": "user", "content": "hi"}], **_ENV),
        InferenceRequested(event_id="b.0.0:a1:t0:r1", request_id="b.0.0:a1:t0:r1", seq=1, turn_index=0,
                           prompt_token_ids=_IDS, sampling=forced, max_tokens=16, reply_seq=1, record=False,
                           **_ENV),
        TurnGenerated(event_id="b.0.0:a1:t0:r1", request_id="b.0.0:a1:t0:r1", seq=1, turn_index=0, prompt_len=5,
                      token_ids=_IDS, logprobs=_LPS, top_logprobs=[{1: -0.5, 7: -2.0}] * 5,
                      finish_reason=FinishReason.STOP, weight_version=12, engine="fake", worker_id="i",
                      queue_ms=0.5, generate_ms=3.25, cached_tokens=4, **_ENV),
        StepCompleted(event_id="b.0.0:a1:s0", seq=2, turn_index=0, turn_event_id="b.0.0:a1:t0:r1", action="42",
                      observation="higher", observation_token_ids=_IDS[:2], reward=1.0, terminated=False,
                      truncated=False, info={"correct": True}, step_ms=1.5, drift="history_rewritten",
                      new_segment=True, **_ENV),
        EpisodeFinished(event_id="b.0.0:a1:end", seq=3, status=TrajectoryStatus.COMPLETED, reward=1.0, num_turns=1,
                        num_tokens=10, stop_reason="terminated", info={"token_check": "ok"}, **_ENV),
        EpisodeFailed(event_id="b.0.0:a1:end", seq=1, failure_class=FailureClass.INFERENCE, reason="no worker",
                      num_turns=1, retryable=True, will_retry=True, **_ENV),
        EpisodeCancelled(event_id="b.0.0:a1:end", seq=1, num_turns=2, **_ENV),
    ]


def write_schemas() -> None:
    SCHEMAS.mkdir(exist_ok=True)
    for name, schema in event_schemas().items():
        (SCHEMAS / f"{name}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(event_schemas())} schemas to {SCHEMAS}")


def write_events() -> None:
    out = EVENTS / f"v{SCHEMA_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    for event in examples():
        (out / f"{event.type}.msgpack").write_bytes(encode(event))  # type: ignore[attr-defined]
    print(f"wrote {len(examples())} example events to {out}")


if __name__ == "__main__":
    write_schemas()
    write_events()
