"""Pure trajectory assembly: prompt ids plus the kept (turn, step) records of one attempt -> aligned token arrays.

Design note. A trajectory is the exact token sequence the policy saw and produced, never a re-tokenisation:

    token_ids = prompt ids + for each turn t (in turn_index order): sampled ids(t) + observation ids(t)

Sampled ids are copied verbatim from the turn the step names (``StepCompleted.turn_event_id``), so a retried try
that the env worker dropped never leaks in. The observation ids are whatever the chat template appended after
the sampled ids (end-of-turn tokens, the tool/user message, the next assistant header); they may start with
template tokens and may be empty on the last turn. Per position:

- ``loss_mask`` is 1 exactly on sampled ids, 0 elsewhere;
- ``logprobs`` holds the inference engine's logprob on sampled ids, 0.0 elsewhere;
- ``weight_versions`` holds the weight version of the turn on sampled ids, -1 elsewhere;
- ``action_ranges`` lists ``[start, end)`` of every non-empty sampled span of one weight version: one per turn,
  or one per version run of a turn that a weight swap in mode ``keep`` carried across versions;
- ``segments`` lists ``[start, end)`` of every segment: a step with ``new_segment`` carries the whole
  re-rendered context of the next turn, and a new segment starts with it (each segment is a context the policy
  saw, trained on as its own sample). A turn's ``prompt_len`` is checked against its segment's length.

This module does no I/O; ``pair_records`` decides whether the stored records are complete, ``assemble`` builds
the arrays and checks that they are consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollout_ledger.shared.errors import SchemaError
from rollout_ledger.shared.events import token_versions

_IDS = np.dtype("<i4")
_FLOATS = np.dtype("<f4")
_MASK = np.dtype("<i2")


@dataclass(frozen=True)
class TurnRecord:
    """The parts of a stored ``TurnGenerated`` that assembly needs."""

    event_id: str
    turn_index: int
    prompt_len: int
    """Context length the engine generated this turn from (checked against the assembled length)."""
    token_ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int
    version_runs: tuple[tuple[int, int], ...] | None = None
    """``(start, version)`` runs when a swap in mode ``keep`` carried the turn across versions; None: one version."""

    def token_versions(self) -> np.ndarray:
        return token_versions(len(self.token_ids), self.weight_version,
                              None if self.version_runs is None else list(self.version_runs))

    def runs(self) -> list[tuple[int, int, int]]:
        """``(start, end, version)`` of each non-empty run of the turn's ids (one run without ``version_runs``)."""
        n = len(self.token_ids)
        if not self.version_runs:
            return [(0, n, self.weight_version)] if n else []
        starts = [min(max(0, a), n) for a, _ in self.version_runs]
        ends = [*starts[1:], n]
        return [(a, b, v) for a, b, (_, v) in zip(starts, ends, self.version_runs, strict=True) if b > a]


@dataclass(frozen=True)
class StepRecord:
    """The parts of a stored ``StepCompleted`` that assembly needs."""

    event_id: str
    turn_index: int
    turn_event_id: str
    """The turn try whose sampled ids the episode kept."""
    observation_token_ids: np.ndarray
    reward: float
    new_segment: bool = False
    """``observation_token_ids`` is the re-rendered context that starts a new segment."""


@dataclass(frozen=True)
class Incomplete:
    """The stored records do not yet cover the turns the terminal event announced."""

    reason: str
    have: int
    """Complete (turn, step) pairs found from turn 0 on."""
    need: int


@dataclass(frozen=True)
class Trajectory:
    """Aligned per-token arrays of one attempt (all of length ``num_tokens``) and their summary."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    weight_versions: np.ndarray
    action_ranges: list[list[int]]
    """``[start, end)`` of each non-empty sampled span, in order."""
    prompt_len: int
    num_tokens: int
    num_sampled_tokens: int
    num_turns: int
    kept_turn_ids: tuple[str, ...]
    kept_step_ids: tuple[str, ...]
    distinct_weight_versions: list[int]
    """Sorted distinct weight versions of the kept turns."""
    step_rewards: list[float]
    segments: list[list[int]] = field(default_factory=list)
    """``[start, end)`` of each segment, covering ``token_ids`` in order."""
    context_mismatches: tuple[int, ...] = field(default=())
    """Turn indices whose ``prompt_len`` differs from the assembled segment length before them: the env worker
    sent the engine a context that is not this trajectory's prefix (re-tokenisation drift). Recorded, not fatal."""


def pair_records(
    num_turns: int, steps: Sequence[StepRecord], turns: Mapping[str, TurnRecord]
) -> list[tuple[TurnRecord, StepRecord]] | Incomplete:
    """The (turn, step) pairs for turns ``0..num_turns-1``, or ``Incomplete`` naming the first missing record.

    ``steps`` are the attempt's stored steps (any order); ``turns`` maps event ids to stored turns.
    """
    by_index = {s.turn_index: s for s in steps}
    pairs: list[tuple[TurnRecord, StepRecord]] = []
    for index in range(num_turns):
        step = by_index.get(index)
        if step is None:
            return Incomplete(f"step of turn {index} not stored yet", len(pairs), num_turns)
        turn = turns.get(step.turn_event_id)
        if turn is None:
            return Incomplete(f"turn {step.turn_event_id} named by step {step.event_id} not stored yet", len(pairs),
                              num_turns)
        pairs.append((turn, step))
    return pairs


def assemble(prompt_ids: np.ndarray, pairs: Sequence[tuple[TurnRecord, StepRecord]]) -> Trajectory:
    """Concatenate prompt, sampled and observation ids; raise ``SchemaError`` when the records disagree."""
    prompt = np.asarray(prompt_ids, dtype=_IDS)
    parts_ids: list[np.ndarray] = [prompt]
    parts_mask: list[np.ndarray] = [np.zeros(len(prompt), _MASK)]
    parts_lp: list[np.ndarray] = [np.zeros(len(prompt), _FLOATS)]
    parts_wv: list[np.ndarray] = [np.full(len(prompt), -1, _IDS)]
    ranges: list[list[int]] = []
    mismatches: list[int] = []
    pos = len(prompt)
    sampled = 0
    starts = [0]
    for expected_index, (turn, step) in enumerate(pairs):
        if step.turn_index != expected_index or turn.turn_index != expected_index:
            raise SchemaError(f"turn {expected_index}: step has turn_index {step.turn_index}, "
                              f"turn {turn.event_id} has turn_index {turn.turn_index}")
        if step.turn_event_id != turn.event_id:
            raise SchemaError(f"step {step.event_id} names turn {step.turn_event_id}, paired with {turn.event_id}")
        ids = np.asarray(turn.token_ids, dtype=_IDS)
        lps = np.asarray(turn.logprobs, dtype=_FLOATS)
        if len(ids) != len(lps):
            raise SchemaError(f"turn {turn.event_id}: {len(ids)} token ids but {len(lps)} logprobs")
        obs = np.asarray(step.observation_token_ids, dtype=_IDS)
        if turn.prompt_len != pos - starts[-1]:
            mismatches.append(expected_index)
        if step.new_segment:
            starts.append(pos + len(ids))
        n = len(ids)
        for start, end, _ in turn.runs():  # one action range per run of one version (a keep swap makes two)
            ranges.append([pos + start, pos + end])
        parts_ids += [ids, obs]
        parts_mask += [np.ones(n, _MASK), np.zeros(len(obs), _MASK)]
        parts_lp += [lps, np.zeros(len(obs), _FLOATS)]
        parts_wv += [turn.token_versions().astype(_IDS), np.full(len(obs), -1, _IDS)]
        pos += n + len(obs)
        sampled += n
    token_ids = np.concatenate(parts_ids)
    ends = [*starts[1:], len(token_ids)]
    return Trajectory(
        token_ids=token_ids,
        loss_mask=np.concatenate(parts_mask),
        logprobs=np.concatenate(parts_lp),
        weight_versions=np.concatenate(parts_wv),
        action_ranges=ranges,
        prompt_len=len(prompt),
        num_tokens=len(token_ids),
        num_sampled_tokens=sampled,
        num_turns=len(pairs),
        kept_turn_ids=tuple(t.event_id for t, _ in pairs),
        kept_step_ids=tuple(s.event_id for _, s in pairs),
        distinct_weight_versions=sorted({int(v) for t, _ in pairs for _, _, v in t.runs()}
                                        | {int(t.weight_version) for t, _ in pairs}),
        step_rewards=[float(s.reward) for _, s in pairs],
        segments=[[a, b] for a, b in zip(starts, ends, strict=True)],
        context_mismatches=tuple(mismatches),
    )
