"""The ATIF mapping (``rollout_ledger/services/exporter/atif.py``) on the two-segment example trajectory of
docs/export.md: the steps it makes, token-exact, the tool calls it parses, and the records it refuses (naming the
trajectory)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import numpy as np
import pytest
from atif import Trajectory

from rollout_ledger.services.exporter.atif import document, tool_calls, validated
from rollout_ledger.services.exporter.examples import example_row
from rollout_ledger.services.exporter.kept_turns import KeptTurn
from rollout_ledger.shared.errors import SchemaError

T0 = dt.datetime(2026, 11, 23, 4, 0, tzinfo=dt.UTC)


def kept(turn_index: int, ids: list[int], lps: list[float], obs: list[int], **kw: Any) -> KeptTurn:
    values: dict[str, Any] = {
        "turn_index": turn_index, "step_event_id": f"b1.3.1:a1:s{turn_index}",
        "turn_event_id": f"b1.3.1:a1:t{turn_index}:r0", "action": f"action {turn_index}",
        "observation": f"observation {turn_index}" if obs else "", "observation_token_ids": np.array(obs, np.int32),
        "reward": 0.0, "terminated": not obs, "truncated": False, "info": {}, "drift": None, "new_segment": False,
        "reused_from": None, "token_ids": np.array(ids, np.int32), "logprobs": np.array(lps, np.float32),
        "weight_version": 7 + turn_index, "version_runs": None, "finish_reason": "stop", "prompt_len": None,
        "cached_tokens": None, "engine": "vllm", "produced_at": T0}
    values.update(kw)
    return KeptTurn(**values)


def example_turns() -> list[KeptTurn]:
    """The turns ``example_row`` was assembled from: turn 0 (3 ids; its observation ids carry the re-rendered
    context of the second segment), turn 1 (2 ids, nothing after)."""
    tok = example_row()["token_ids"].tolist()
    return [kept(0, tok[4:7], [-0.25, -1.5, -0.125], tok[7:15], new_segment=True, prompt_len=4),
            kept(1, tok[15:17], [-0.5, -0.0625], [], prompt_len=6)]


def test_one_agent_step_per_turn_token_exact() -> None:
    row = example_row()
    doc = document(row, example_turns())
    traj = Trajectory.model_validate(doc)
    tok = row["token_ids"].tolist()
    assert [s.source for s in traj.steps] == ["user", "agent", "agent"]
    assert traj.steps[0].message == row["prompt_text"]
    first, second = traj.steps[1], traj.steps[2]
    assert first.metrics is not None and second.metrics is not None
    assert first.metrics.completion_token_ids == tok[4:7] and first.metrics.prompt_token_ids == tok[0:4]
    assert first.metrics.logprobs == [-0.25, -1.5, -0.125]
    assert second.metrics.completion_token_ids == tok[15:17]
    assert second.metrics.prompt_token_ids == tok[9:15]  # its segment's context, the re-rendered conversation
    assert second.metrics.logprobs == [-0.5, -0.0625] and second.observation is None
    assert first.observation is not None and first.observation.results[0].extra == {
        "token_ids": tok[7:15], "token_range": [7, 15]}
    assert [(s.extra or {})["segment"] for s in traj.steps[1:]] == [0, 1]
    assert [(s.metrics.extra or {})["weight_version"] for s in traj.steps[1:] if s.metrics] == [7, 8]
    extra = traj.extra or {}
    assert (extra["episode_id"], extra["batch_id"], extra["attempt"], extra["reward"], extra["advantage"]) == (
        "b1.3.1", "b1", 1, 1.0, 0.866)
    assert traj.trajectory_id == "b1.3.1:a1" and traj.session_id == "b1.3.1"
    assert traj.final_metrics is not None and traj.final_metrics.total_completion_tokens == 5
    assert traj.final_metrics.total_prompt_tokens == 10 and traj.final_metrics.total_cached_tokens is None


def test_a_keep_swap_turn_is_one_step_and_an_empty_turn_a_step_too() -> None:
    """A turn carried across versions has two action ranges but is one step (its ``version_runs`` kept); a turn
    that sampled nothing is a step without ids."""
    row = example_row()
    turns = example_turns()
    turns[0] = dataclasses.replace(turns[0], version_runs=[[0, 7], [2, 8]])
    row = {**row, "action_ranges": [[4, 6], [6, 7], [15, 17]], "num_turns": 3}
    turns.append(kept(2, [], [], [], prompt_len=8))
    traj = Trajectory.model_validate(document(row, turns))
    assert len(traj.steps) == 4
    m = traj.steps[1].metrics
    assert m is not None and (m.extra or {})["version_runs"] == [[0, 7], [2, 8]]
    assert m.completion_token_ids == row["token_ids"][4:7].tolist()
    last = traj.steps[3].metrics
    assert last is not None and last.completion_token_ids == [] and last.prompt_tokens == 8


def test_tool_calls_follow_the_session_endpoint() -> None:
    call = '<tool_call>{"name": "refund", "arguments": {"order": 3}}</tool_call>'
    assert tool_calls("plain text", "t") == ("plain text", [])
    assert tool_calls(f"Sure. {call} done", "t") == ("Sure. done", [
        {"tool_call_id": "t:c0", "function_name": "refund", "arguments": {"order": 3}}])
    assert tool_calls(f"{call}<tool_call>not json</tool_call>", "t") == (f"{call}<tool_call>not json</tool_call>", [])
    row = example_row()
    turns = example_turns()
    turns[0] = dataclasses.replace(turns[0], action=call + call)
    step = Trajectory.model_validate(document(row, turns)).steps[1]
    assert step.tool_calls is not None and len(step.tool_calls) == 2
    assert step.observation is not None and step.observation.results[0].source_call_id is None  # which call: unknown


def test_a_context_the_engine_did_not_see_is_not_reported_as_its_prompt() -> None:
    turns = example_turns()
    turns[1] = dataclasses.replace(turns[1], prompt_len=5)  # the recorder logged a context mismatch
    m = Trajectory.model_validate(document(example_row(), turns)).steps[2].metrics
    assert m is not None and m.prompt_token_ids is None and m.prompt_tokens == 5
    assert (m.extra or {})["context_mismatch"] is True


@pytest.mark.parametrize(("change", "message"), [
    (lambda ts: ts[:1], "the step of turn 1 is not stored"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], turn_event_id=None)], "the turn named by step b1.3.1:a1:s1"),
    (lambda ts: [dataclasses.replace(ts[0], token_ids=np.array([504, 1386, 3], np.int32)), ts[1]],
     r"the sampled ids of turn 0 \(b1.3.1:a1:t0:r0\) differ from the trajectory's ids at \[4, 7\)"),
    (lambda ts: [dataclasses.replace(ts[0], logprobs=np.array([-0.25, -1.5, -0.5], np.float32)), ts[1]],
     "the logprobs of turn 0"),
    (lambda ts: [dataclasses.replace(ts[0], observation_token_ids=ts[0].observation_token_ids + 1), ts[1]],
     r"the observation ids of step b1.3.1:a1:s0 differ from the trajectory's ids at \[7, 15\)"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], token_ids=ts[1].token_ids[:1], logprobs=ts[1].logprobs[:1])],
     "its prompt and 2 turns cover 16 of its 17 ids"),
])
def test_records_that_disagree_are_refused_naming_the_trajectory(change: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=r"^trajectory b1\.3\.1 attempt 1: " + message):
        document(example_row(), change(example_turns()))


def test_a_value_json_cannot_hold_and_an_invalid_document_are_refused() -> None:
    row = example_row()
    row["logprobs"] = row["logprobs"].copy()
    row["logprobs"][5] = -np.inf
    turns = example_turns()
    turns[0] = dataclasses.replace(turns[0], logprobs=np.array([-0.25, -np.inf, -0.125], np.float32))
    with pytest.raises(SchemaError, match="not finite"):
        document(row, turns)
    good = document(example_row(), example_turns())
    bad = {**good, "steps": [{**good["steps"][0], "step_id": 2}, *good["steps"][1:]]}
    with pytest.raises(SchemaError, match=r"(?s)^trajectory x is not a valid ATIF trajectory: .*not sequential"):
        validated(bad, "trajectory x")
