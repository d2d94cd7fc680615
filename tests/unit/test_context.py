"""Context policies: the window of a conversation, and the driver generating each turn from it (one segment per
turn) on real NATS with a scripted inference responder."""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout_ledger.services.env_worker.attempt import AttemptDeps
from rollout_ledger.services.env_worker.context import turns_of, window, windowed
from rollout_ledger.services.env_worker.driver import EpisodeDriver
from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.shared.events import ContextPolicy, EpisodeRequested, SamplingParams, decode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.subjects import EVENTS_STREAM
from tests.unit.test_driver import served

__all__ = ["served"]  # the scripted inference responder fixture

S = {"role": "system", "content": "sys"}


def _u(i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"u{i}"}


def _a(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"a{i}"}


def test_window_keeps_the_system_message_and_the_last_turns() -> None:
    conv = [S, _u(0), _a(0), _u(1), _a(1), {"role": "tool", "content": "t"}, _u(2)]
    assert turns_of(conv[1:]) == [[_u(0), _a(0)], [_u(1), _a(1)], [{"role": "tool", "content": "t"}, _u(2)]]
    assert window(conv, 1) == [S, {"role": "tool", "content": "t"}, _u(2)]
    assert window(conv, 2) == [S, _u(1), _a(1), {"role": "tool", "content": "t"}, _u(2)]
    assert window(conv, 10) == conv
    assert window([_u(0), _a(0), _u(1)], 1) == [_u(1)]
    assert windowed(None, conv) is None and windowed(ContextPolicy(), conv) is None
    assert windowed(ContextPolicy(policy="window", window_turns=1), conv) == window(conv, 1)


async def test_a_window_makes_every_turn_its_own_segment(nc: bus.NATS, served: ChatTokenizer) -> None:
    tok = served
    client = InferenceClient(nc, InferenceClientConfig(request_timeout_s=5, heartbeat_timeout_s=5))
    await client.start()
    publisher = StreamPublisher(nc)
    await publisher.start()
    deps = AttemptDeps(publisher=publisher, client=client, envs=builtin_registry(), template=TurnTemplate(tok),
                      is_cancelled=lambda _b: False, metrics=build_metrics(), worker_id="w0")
    item = EpisodeRequested(event_id="b.0.0:requested", episode_id="b.0.0", batch_id="b", attempt=1, seq=0,
                            produced_by="test", env="fixed-turns", task={"turns": 4}, group_id="b.0",
                            group_index=0, group_size=1, sampling=SamplingParams(max_tokens=16), max_turns=4,
                            context=ContextPolicy(policy="window", window_turns=1))
    try:
        outcome = await EpisodeDriver(deps, item, attempt=1).run()
    finally:
        await publisher.stop()
        await client.stop()
    js = nc.jetstream()
    info = await js.stream_info(EVENTS_STREAM)
    events = sorted([decode((await js.get_msg(EVENTS_STREAM, s)).data or b"")
                     for s in range(info.state.first_seq, info.state.last_seq + 1)], key=lambda e: e.seq)
    assert outcome.status == "completed" and outcome.num_turns == 4
    started, *middle, finished = events
    turns = [e for e in middle if e.type == "turn.generated"]
    steps = [e for e in middle if e.type == "step.completed"]
    assert [s.new_segment for s in steps] == [True, True, True, False]  # the last step appends nothing
    assert [s.drift for s in steps[:3]] == ["window"] * 3
    # each turn after the first was generated from its window alone: the newest observation (fixed-turns has no
    # system message; the template adds its default one)
    for t, (turn, step) in enumerate(zip(turns[:-1], steps[:-1], strict=True)):
        assert turns[t + 1].prompt_len == len(step.observation_token_ids)
        rendered = tok.render([{"role": "user", "content": step.observation}], add_generation_prompt=True)
        assert tok.decode(step.observation_token_ids) == rendered
        assert turn.prompt_len < 200  # the context never grows with the history
    assert finished.info["token_check"] == "ok" and finished.info["segment_checks"] == ["ok"] * 4
    assert finished.info["drifts"] == [{"turn": t, "class": "window"} for t in range(3)]
    total = len(started.prompt_token_ids) + sum(len(t.token_ids) + len(s.observation_token_ids)
                                                for t, s in zip(turns, steps, strict=True))
    assert finished.num_tokens == total
    assert np.all(np.array([len(t.token_ids) for t in turns]) > 0)
