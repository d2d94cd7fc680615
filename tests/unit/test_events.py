"""Every event type round-trips through the bus encoding (msgpack) and JSON, arrays exactly."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_ledger.shared.errors import SchemaError
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeRequested,
    EpisodeStarted,
    FailureClass,
    FinishReason,
    InferenceRequested,
    SamplingParams,
    StepCompleted,
    TrajectoryStatus,
    TurnGenerated,
    decode,
    decode_as,
    encode,
    to_json,
)

ENV = {"episode_id": "b.0.0", "batch_id": "b", "attempt": 1, "produced_by": "test/1"}
IDS = np.array([1, 9690, 198, 49151, 0], dtype=np.int32)
LPS = np.array([-0.5, -1e-6, -12.25, 0.0, -3.0], dtype=np.float32)


def _all_events() -> list[object]:
    return [
        EpisodeRequested(event_id="b.0.0:requested", seq=0, env="arithmetic", task={"seed": 1, "nested": [1, "x"]},
                         group_id="b.0", group_index=0, group_size=4, sampling=SamplingParams(temperature=0.7),
                         max_turns=3, **ENV),
        EpisodeStarted(event_id="b.0.0:a1:started", seq=0, env="arithmetic", worker_id="w", prompt_token_ids=IDS,
                       prompt_text="<|im_start|>user\nhi", messages=[{"role": "user", "content": "hi"}], **ENV),
        InferenceRequested(event_id="b.0.0:a1:t0:r1", request_id="b.0.0:a1:t0:r1", seq=1, turn_index=0,
                           prompt_token_ids=IDS, sampling=SamplingParams(), max_tokens=16, reply_seq=1, **ENV),
        TurnGenerated(event_id="b.0.0:a1:t0:r1", request_id="b.0.0:a1:t0:r1", seq=1, turn_index=0, prompt_len=5,
                      token_ids=IDS, logprobs=LPS, top_logprobs=[{1: -0.5, 7: -2.0}] * 5,
                      finish_reason=FinishReason.STOP, weight_version=12, engine="fake", worker_id="i",
                      queue_ms=0.5, generate_ms=3.25, cached_tokens=4, **ENV),
        StepCompleted(event_id="b.0.0:a1:s0", seq=2, turn_index=0, turn_event_id="b.0.0:a1:t0:r1", action="42",
                      observation="", observation_token_ids=np.zeros(0, np.int32), reward=1.0, terminated=True,
                      truncated=False, info={"correct": True}, **ENV),
        EpisodeFinished(event_id="b.0.0:a1:end", seq=3, status=TrajectoryStatus.COMPLETED, reward=1.0, num_turns=1,
                        num_tokens=10, stop_reason="terminated", **ENV),
        EpisodeFailed(event_id="b.0.0:a1:end", seq=1, failure_class=FailureClass.INFERENCE, reason="no worker",
                      **ENV),
        EpisodeCancelled(event_id="b.0.0:a1:end", seq=1, **ENV),
    ]


def _same(a: object, b: object) -> None:
    for name in type(a).model_fields:  # type: ignore[attr-defined]
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and np.array_equal(va, vb), name
        else:
            assert va == vb, name


@pytest.mark.parametrize("event", _all_events(), ids=lambda e: e.type)  # type: ignore[attr-defined]
def test_round_trip_bus_and_json(event: object) -> None:
    _same(event, decode(encode(event)))  # type: ignore[arg-type]
    _same(event, decode(to_json(event)))  # type: ignore[arg-type]


def test_arrays_are_exact_bytes() -> None:
    turn = _all_events()[3]
    back = decode_as(encode(turn), TurnGenerated)  # type: ignore[arg-type]
    assert back.token_ids.tobytes() == IDS.tobytes()
    assert back.logprobs.tobytes() == LPS.tobytes()


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"\xc1\xff garbage", "not a msgpack event"),
        (b"{not json", "not valid JSON"),
        (b'{"type": "turn.generated"}', "event_id: Field required"),
        (b'{"type": "no.such.type"}', "does not match any of the expected tags"),
    ],
)
def test_bad_payloads_raise_schema_error(payload: bytes, fragment: str) -> None:
    with pytest.raises(SchemaError, match=fragment):
        decode(payload)


def test_unknown_fields_are_ignored() -> None:
    """Tolerant readers: a newer producer's optional field does not make the event unreadable (contract
    evolution, tests/contract/test_contract_evolution.py)."""
    failed = _all_events()[6]
    data = to_json(failed).replace(b'"reason"', b'"extra":1,"reason"')
    _same(failed, decode(data))


def test_sampling_params_bounds() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
