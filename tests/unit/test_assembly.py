"""Trajectory assembly: masks, logprobs, weight versions and action ranges line up with the token ids."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_ledger.services.recorder.assembly import (
    Incomplete,
    StepRecord,
    TurnRecord,
    assemble,
    pair_records,
)
from rollout_ledger.shared.errors import SchemaError


def turn(index: int, ids: list[int], lps: list[float] | None = None, *, try_: int = 1, version: int = 7,
         prompt_len: int = 0) -> TurnRecord:
    return TurnRecord(f"e:a1:t{index}:r{try_}", index, prompt_len, np.asarray(ids, "<i4"),
                      np.asarray(lps if lps is not None else [-0.5] * len(ids), "<f4"), version)


def step(index: int, obs: list[int], *, try_: int = 1, reward: float = 0.0) -> StepRecord:
    return StepRecord(f"e:a1:s{index}", index, f"e:a1:t{index}:r{try_}", np.asarray(obs, "<i4"), reward)


def test_single_turn_alignment() -> None:
    prompt = np.asarray([1, 2, 3], "<i4")
    t = turn(0, [10, 11], [-0.1, -0.2], prompt_len=3)
    traj = assemble(prompt, [(t, step(0, [2], reward=1.0))])
    assert traj.token_ids.tolist() == [1, 2, 3, 10, 11, 2]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 0]
    assert traj.logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0])
    assert traj.weight_versions.tolist() == [-1, -1, -1, 7, 7, -1]
    assert traj.action_ranges == [[3, 5]]
    assert (traj.prompt_len, traj.num_tokens, traj.num_sampled_tokens, traj.num_turns) == (3, 6, 2, 1)
    assert traj.context_mismatches == ()
    assert traj.token_ids.dtype == np.int32 and traj.logprobs.dtype == np.float32


def test_multi_turn_ranges_and_versions() -> None:
    prompt = np.asarray([1, 2], "<i4")
    pairs = [
        (turn(0, [5, 6, 7], version=1, prompt_len=2), step(0, [2, 90, 91, 1], reward=0.0)),
        (turn(1, [8], version=2, prompt_len=9), step(1, [2, 92], reward=0.5)),
        (turn(2, [9, 9], version=2, prompt_len=12), step(2, [], reward=1.0)),
    ]
    traj = assemble(prompt, pairs)
    ids = traj.token_ids.tolist()
    assert ids == [1, 2, 5, 6, 7, 2, 90, 91, 1, 8, 2, 92, 9, 9]
    assert traj.action_ranges == [[2, 5], [9, 10], [12, 14]]
    for start, end in traj.action_ranges:
        assert traj.loss_mask[start:end].tolist() == [1] * (end - start)
    assert int(traj.loss_mask.sum()) == traj.num_sampled_tokens == 6
    # logprobs non-zero exactly where the mask is 1
    assert ((traj.logprobs != 0) == (traj.loss_mask == 1)).all()
    assert traj.weight_versions.tolist() == [-1, -1, 1, 1, 1, -1, -1, -1, -1, 2, -1, -1, 2, 2]
    assert traj.distinct_weight_versions == [1, 2]
    assert traj.step_rewards == [0.0, 0.5, 1.0]
    assert traj.kept_turn_ids == ("e:a1:t0:r1", "e:a1:t1:r1", "e:a1:t2:r1")
    assert traj.context_mismatches == ()


def test_length_finish_observation_starts_with_template_tokens() -> None:
    # The turn hit max_tokens (no end-of-turn id sampled): the template's <|im_end|> and newline come with the
    # observation, so they are mask 0 even though they look like assistant tokens.
    prompt = np.asarray([1, 9, 9], "<i4")
    t0 = turn(0, [40, 41, 42, 43], prompt_len=3)
    s0 = step(0, [2, 198, 1, 4093, 198, 55, 2, 198, 1, 520, 198])
    t1 = turn(1, [60], prompt_len=18)
    traj = assemble(prompt, [(t0, s0), (t1, step(1, [2]))])
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1] + [0] * 11 + [1, 0]
    assert traj.token_ids[7:9].tolist() == [2, 198]
    assert traj.action_ranges == [[3, 7], [18, 19]]


def test_empty_observation_at_end_and_empty_turn() -> None:
    prompt = np.asarray([1], "<i4")
    traj = assemble(prompt, [(turn(0, [], prompt_len=1), step(0, [2, 3])), (turn(1, [7], prompt_len=3), step(1, []))])
    assert traj.token_ids.tolist() == [1, 2, 3, 7]
    assert traj.action_ranges == [[3, 4]]  # empty sampled spans get no range
    assert traj.num_tokens == 4 and traj.num_sampled_tokens == 1 and traj.num_turns == 2


def test_failed_partial_prompt_only_and_prefix() -> None:
    prompt = np.asarray([1, 2, 3], "<i4")
    only_prompt = assemble(prompt, [])
    assert only_prompt.token_ids.tolist() == [1, 2, 3]
    assert only_prompt.loss_mask.tolist() == [0, 0, 0]
    assert only_prompt.action_ranges == [] and only_prompt.num_turns == 0
    partial = assemble(prompt, [(turn(0, [4], prompt_len=3), step(0, [5, 6]))])
    assert partial.num_turns == 1 and partial.token_ids.tolist() == [1, 2, 3, 4, 5, 6]


def test_context_mismatch_is_reported_not_fatal() -> None:
    traj = assemble(np.asarray([1, 2], "<i4"), [(turn(0, [3], prompt_len=2), step(0, [4])),
                                               (turn(1, [5], prompt_len=99), step(1, []))])
    assert traj.context_mismatches == (1,)


def test_inconsistent_records_raise_schema_error() -> None:
    prompt = np.asarray([1], "<i4")
    with pytest.raises(SchemaError, match="logprobs"):
        assemble(prompt, [(turn(0, [3, 4], [-1.0]), step(0, []))])
    with pytest.raises(SchemaError, match="turn_index"):
        assemble(prompt, [(turn(1, [3]), step(1, []))])
    with pytest.raises(SchemaError, match="names turn"):
        assemble(prompt, [(turn(0, [3], try_=1), step(0, [], try_=2))])


def test_pairing_picks_the_try_the_step_names_and_reports_gaps() -> None:
    t_r1 = turn(0, [3], try_=1)
    t_r2 = turn(0, [4], try_=2)
    turns = {t.event_id: t for t in (t_r1, t_r2)}
    pairs = pair_records(1, [step(0, [], try_=2)], turns)
    assert not isinstance(pairs, Incomplete)
    assert pairs[0][0].event_id == "e:a1:t0:r2"

    missing_step = pair_records(2, [step(0, [], try_=2)], turns)
    assert isinstance(missing_step, Incomplete) and (missing_step.have, missing_step.need) == (1, 2)
    missing_turn = pair_records(1, [step(0, [], try_=3)], turns)
    assert isinstance(missing_turn, Incomplete) and "e:a1:t0:r3" in missing_turn.reason
    assert pair_records(0, [], {}) == []


def test_new_segment_steps_split_the_trajectory_and_check_context_per_segment() -> None:
    """A step with ``new_segment`` carries the next turn's whole context: a segment starts there, and the next
    turn's ``prompt_len`` is that segment's length (not the whole sequence's)."""
    prompt = np.asarray([1, 2], "<i4")
    seg_step = StepRecord("e:a1:s0", 0, "e:a1:t0:r1", np.asarray([1, 2, 5, 70, 71], "<i4"), 0.0, new_segment=True)
    pairs = [
        (turn(0, [5, 6, 7], prompt_len=2), seg_step),
        (turn(1, [8, 9], prompt_len=5), step(1, [3], reward=1.0)),
        (turn(2, [4], prompt_len=8), step(2, [])),
    ]
    traj = assemble(prompt, pairs)
    assert traj.token_ids.tolist() == [1, 2, 5, 6, 7, 1, 2, 5, 70, 71, 8, 9, 3, 4]
    assert traj.segments == [[0, 5], [5, 14]]
    assert traj.context_mismatches == ()
    assert traj.action_ranges == [[2, 5], [10, 12], [13, 14]]
    assert traj.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1]
    # a turn whose prompt_len counts the whole sequence instead of its segment is a recorded mismatch
    bad = [(pairs[0][0], seg_step), (turn(1, [8, 9], prompt_len=10), step(1, [3]))]
    assert assemble(prompt, bad).context_mismatches == (1,)


def test_one_segment_without_new_segment_steps() -> None:
    traj = assemble(np.asarray([1], "<i4"), [(turn(0, [5], prompt_len=1), step(0, []))])
    assert traj.segments == [[0, 2]]
