"""The TRL adapter's pure parts: TRL's row layout from ``trl`` records (groups contiguous, members in order, a
member without a trajectory as a placeholder that trains nothing), the task prompt, the refusal of multi-segment
episodes, and the switch of TRL's importance-sampling correction onto the ledger. The real TRL training from a
real ledger is tests/e2e/trainers/test_trl_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rollout_ledger.client.adapters.trl import (
    LedgerRollout,
    TrlAdapterError,
    arrange,
    records_of,
    task_text,
)


def rec(group: str, member: int, *, reward: float | None = 1.0, prompt: tuple[int, ...] = (1, 2, 3),
        completion: tuple[int, ...] = (7, 8, 9), mask: tuple[int, ...] = (1, 0, 1), samples: int = 1) -> dict[str, Any]:
    return {"episode_id": f"{group}.{member}", "group_id": group, "prompt_ids": np.array(prompt),
            "completion_ids": np.array(completion), "tool_mask": np.array(mask),
            "logprobs": np.array([-0.5, 0.0, -0.25][:len(completion)], np.float32),
            "reward": np.nan if reward is None else reward, "num_samples": samples}


def test_rows_follow_trls_layout_groups_contiguous_members_in_order() -> None:
    records = [rec("b.1", 1, reward=0.0), rec("b.0", 1, reward=1.0), rec("b.1", 0, reward=1.0),
               rec("b.0", 0, reward=0.0)]
    out = arrange(records, [("b.0", {"a": 1}, 0), ("b.1", {"a": 2}, 1)], group_size=2, eos_id=2).output()
    assert out["ledger_episode_id"] == ["b.0.0", "b.0.1", "b.1.0", "b.1.1"]
    assert out["ledger_reward"] == [0.0, 1.0, 1.0, 0.0]
    assert out["ledger_task"] == [{"a": 1}, {"a": 1}, {"a": 2}, {"a": 2}]
    assert out["ledger_task_index"] == [0, 0, 1, 1]
    assert out["prompt_ids"][0] == [1, 2, 3] and out["completion_ids"][0] == [7, 8, 9]
    assert out["env_mask"][0] == [1, 0, 1], "the loss mask: observation ids are not trained"
    assert out["logprobs"][0] == [-0.5, 0.0, -0.25], "the engine's logprobs, verbatim"
    assert set(out) >= {"prompt_ids", "completion_ids", "logprobs", "env_mask"}


def test_a_member_without_a_trajectory_is_a_placeholder_that_trains_nothing() -> None:
    out = arrange([rec("b.0", 1, reward=1.0, prompt=(5, 6))], [("b.0", {"a": 1}, 0)], group_size=3,
                  eos_id=2).output()
    assert out["ledger_episode_id"] == ["b.0.0", "b.0.1", "b.0.2"]
    assert out["ledger_reward"] == [None, 1.0, None], "None: left out of TRL's group mean, no advantage"
    assert out["completion_ids"][0] == [2] and out["env_mask"][0] == [0] and out["prompt_ids"][0] == [5, 6]


def test_a_nan_reward_is_none_and_a_group_with_no_trajectory_is_refused() -> None:
    out = arrange([rec("b.0", 0, reward=None)], [("b.0", 1, 0)], group_size=1, eos_id=2).output()
    assert out["ledger_reward"] == [None]
    with pytest.raises(TrlAdapterError, match="every member failed"):
        arrange([], [("b.0", 1, 0)], group_size=1, eos_id=2)


class FakeBatch:
    """A fake delivery (a ``Batch``'s ``numpy()`` and length only)."""

    def __init__(self, **columns: list[Any]) -> None:
        self.columns = {name: np.asarray(values) for name, values in columns.items()}

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def numpy(self) -> dict[str, Any]:
        return self.columns


def test_a_multi_segment_episode_is_refused_with_the_reason() -> None:
    assert records_of(FakeBatch(episode_id=["b.0.0"], num_samples=[1]))[0]["episode_id"] == "b.0.0"  # type: ignore[arg-type]
    with pytest.raises(TrlAdapterError, match="2 segments"):
        records_of(FakeBatch(episode_id=["b.0.0", "b.0.0"], num_samples=[2, 2]))  # type: ignore[arg-type]


def test_task_prompts_are_canonical_json() -> None:
    assert task_text({"b": 2, "a": 1}) == '{"a":1,"b":2}'


def test_the_importance_sampling_correction_is_trls_own_switched_onto_the_ledger() -> None:
    trainer = SimpleNamespace(use_vllm=False, vllm_importance_sampling_correction=False)
    LedgerRollout.correct_importance_sampling(None, trainer, mode="sequence_mask", clip_max=2.0)  # type: ignore[arg-type]
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    assert trainer.vllm_importance_sampling_mode == "sequence_mask"
    assert trainer.vllm_importance_sampling_clip_max == 2.0 and trainer._last_loaded_step == -1
    assert trainer.vllm_generation.sync_weights() is None, "the callback publishes versions; nothing to sync"
