"""The exporter's pure parts: spans of segmented trajectories, each record shape (through its one definition,
``tables.table``) against records computed by hand, array decoding, advantages, selections."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pytest

from rollout_ledger.client import tables
from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
from rollout_ledger.client.records import SCHEMAS, SampleBounds, Unit, json_fields, samples
from rollout_ledger.client.rows import Chunk, rebuild_sampled, sampled_of, spread
from rollout_ledger.client.selection import RewardChoice, Selection
from rollout_ledger.client.tables import records
from rollout_ledger.services.recorder.assembly import StepRecord, Trajectory, TurnRecord, assemble
from rollout_ledger.shared.errors import SchemaError
from tests.advantages_reference import group_advantages


def two_segment_row() -> dict:
    """prompt 0..3 | turn 1 sampled 4..6, obs 7..8 || segment 2: context 9..14 | turn 2 sampled 15..16."""
    tok = np.arange(100, 117, dtype=np.int32)
    mask = np.zeros(17, np.int32)
    mask[4:7] = 1
    mask[15:17] = 1
    lp = np.where(mask == 1, -np.arange(17) / 10, 0).astype(np.float32)
    wv = np.full(17, -1, np.int32)
    wv[4:7] = 3
    wv[15:17] = 4
    return {
        "episode_id": "b.0.1", "group_id": "b.0", "batch_id": "b", "group_index": 1, "env": "e", "attempt": 2,
        "status": "truncated", "failure_class": None, "reward": 0.5, "rollout_reward": 0.5, "advantage": -1.25,
        "group_size": 4, "task": {"q": 1}, "task_index": 5, "prompt_text": "hi", "token_ids": tok, "loss_mask": mask,
        "logprobs": lp, "weight_versions": wv, "action_ranges": [[4, 7], [15, 17]], "segments": [[0, 9], [9, 17]],
        "num_segments": 2, "token_check": "ok", "drifts": [{"turn": 1, "class": "history_rewrite"}],
        "prompt_len": 4, "num_tokens": 17, "num_sampled_tokens": 5, "num_turns": 2, "created_at": None,
        "reward_source": "rollout",
    }


def test_segments_map_to_one_span_each_with_the_context_as_prompt() -> None:
    row = two_segment_row()
    assert samples(row) == [SampleBounds(0, 4, 9, 0, 2), SampleBounds(9, 15, 17, 1, 2)]
    assert samples(row, Unit.TURN) == [SampleBounds(0, 4, 7, 0, 2), SampleBounds(9, 15, 17, 1, 2)]
    row["segments"] = [[0, 9], [9, 12], [12, 17]]  # a segment without a sampled token trains nothing
    assert [(s.start, s.prompt_end, s.end) for s in samples(row)] == [(0, 4, 9), (12, 15, 17)]


def one(row: dict, shape: str, unit: Unit = Unit.SEGMENT) -> list[dict]:
    """The records of one trajectory, through the one definition (``tables.table``, read off by ``records``)."""
    return records(Chunk.from_rows([row]), shape, unit)


def test_openrlhf_sample_per_segment() -> None:
    row = two_segment_row()
    first, second = one(row, "openrlhf")
    assert first["observation_tokens"].tolist() == list(range(100, 109))
    assert first["action_ranges"] == [[4, 7]]
    assert first["rollout_log_probs"].tolist() == pytest.approx([0, 0, 0, 0, -0.4, -0.5, -0.6, 0, 0])
    assert second["observation_tokens"].tolist() == list(range(109, 117))
    assert second["action_ranges"] == [[6, 8]]
    assert second["rollout_log_probs"].tolist() == pytest.approx([0] * 6 + [-1.5, -1.6])
    for rec in (first, second):
        assert rec["reward"] == 0.5 and rec["advantage"] == -1.25 and rec["truncated"] is True
        assert rec["group_id"] == "b.0" and rec["num_samples"] == 2
        assert rec["label"] == '{"q":1}' and rec["prompt"] == "hi"
        assert rec["scores"] == {"reward": 0.5, "advantage": -1.25}
        assert rec["task"] == {"q": 1} and rec["task_index"] == 5
    assert (first["sample_index"], second["sample_index"]) == (0, 1)
    assert first["extra_logs"] == {"num_turns": 2, "prompt_len": 4, "num_sampled_tokens": 5, "weight_versions": [3],
                                   "reward_source": "rollout", "rollout_reward": 0.5}
    assert second["extra_logs"]["weight_versions"] == [4]


def test_openrlhf_sample_per_turn() -> None:
    first, second = one(two_segment_row(), "openrlhf", Unit.TURN)
    assert first["observation_tokens"].tolist() == list(range(100, 107)) and first["action_ranges"] == [[4, 7]]
    assert first["rollout_log_probs"].tolist() == pytest.approx([0, 0, 0, 0, -0.4, -0.5, -0.6])
    assert second["observation_tokens"].tolist() == list(range(109, 117)) and second["action_ranges"] == [[6, 8]]
    assert [r["extra_logs"]["weight_versions"] for r in (first, second)] == [[3], [4]]
    assert [(r["sample_index"], r["num_samples"]) for r in (first, second)] == [(0, 2), (1, 2)]


def test_slime_sample_masks_the_response_only() -> None:
    rec, second = one(two_segment_row(), "slime")
    assert rec["tokens"].tolist() == list(range(100, 109))
    assert rec["response_length"] == 5
    assert rec["loss_mask"].tolist() == [1, 1, 1, 0, 0]
    assert rec["rollout_log_probs"].tolist() == pytest.approx([-0.4, -0.5, -0.6, 0, 0])
    assert rec["status"] == "truncated" and rec["weight_versions"] == ["3"] and rec["index"] == 1
    assert rec["metadata"] == {"reward_source": "rollout", "rollout_reward": 0.5, "num_turns": 2,
                               "rollout_status": "truncated"}
    assert rec["label"] == '{"q":1}' and rec["task"] == {"q": 1} and rec["task_index"] == 5
    assert second["tokens"].tolist() == list(range(109, 117)) and second["response_length"] == 2
    assert second["loss_mask"].tolist() == [1, 1] and second["weight_versions"] == ["4"]
    row = two_segment_row()
    row["status"] = "failed"
    failed = one(row, "slime")
    assert [r["status"] for r in failed] == ["aborted", "aborted"]
    assert failed[0]["metadata"]["rollout_status"] == "failed"
    turn, _ = one(two_segment_row(), "slime", Unit.TURN)
    assert turn["tokens"].tolist() == list(range(100, 107)) and turn["response_length"] == 3
    assert turn["loss_mask"].tolist() == [1, 1, 1] and turn["rollout_log_probs"].tolist() == pytest.approx(
        [-0.4, -0.5, -0.6])


def test_verl_and_trl_split_prompt_and_response() -> None:
    row = two_segment_row()
    _, v = one(row, "verl")
    assert v["prompts"].tolist() == list(range(109, 115)) and v["responses"].tolist() == [115, 116]
    assert v["response_mask"].tolist() == [1, 1] and v["attention_mask"].tolist() == [1] * 8
    assert v["position_ids"].tolist() == list(range(8)) and v["uid"] == "b.0"
    assert v["rollout_log_probs"].tolist() == pytest.approx([-1.5, -1.6])
    assert (v["task"], v["task_index"], v["status"]) == ({"q": 1}, 5, "truncated")
    t, _ = one(row, "trl")
    assert t["prompt_ids"].tolist() == [100, 101, 102, 103]
    assert t["completion_ids"].tolist() == [104, 105, 106, 107, 108]
    assert t["completion_mask"].tolist() == [1] * 5 and t["tool_mask"].tolist() == [1, 1, 1, 0, 0]
    assert t["logprobs"].tolist() == pytest.approx([-0.4, -0.5, -0.6, 0, 0])
    assert (t["task"], t["task_index"]) == ({"q": 1}, 5)
    v_turn, _ = one(row, "verl", Unit.TURN)
    assert v_turn["prompts"].tolist() == [100, 101, 102, 103] and v_turn["responses"].tolist() == [104, 105, 106]
    assert v_turn["attention_mask"].tolist() == [1] * 7 and v_turn["position_ids"].tolist() == list(range(7))
    _, t_turn = one(row, "trl", Unit.TURN)
    assert t_turn["prompt_ids"].tolist() == list(range(109, 115)) and t_turn["completion_ids"].tolist() == [115, 116]
    assert t_turn["tool_mask"].tolist() == [1, 1] and t_turn["completion_mask"].tolist() == [1, 1]


def test_full_record_is_the_stored_trajectory() -> None:
    row = two_segment_row()
    for unit in Unit:  # one record per trajectory, whatever the unit
        (rec,) = one(row, "full", unit)
        for name in ("token_ids", "loss_mask", "weight_versions"):
            assert rec[name].tolist() == row[name].tolist() and rec[name].dtype == np.int32, name
        assert rec["logprobs"].tobytes() == row["logprobs"].tobytes()
        assert rec["action_ranges"] == [[4, 7], [15, 17]] and rec["segments"] == [[0, 9], [9, 17]]
        assert rec["task"] == {"q": 1} and rec["drifts"] == [{"turn": 1, "class": "history_rewrite"}]
        assert (rec["task_index"], rec["group_index"], rec["num_segments"], rec["attempt"]) == (5, 1, 2, 2)
        assert (rec["reward"], rec["rollout_reward"], rec["advantage"], rec["reward_source"]) == (
            0.5, 0.5, -1.25, "rollout")
        assert rec["created_at"] is None and rec["failure_class"] is None
    row.update(reward_source=None, drifts=None)
    (rec,) = one(row, "full")
    assert rec["reward_source"] == "rollout" and rec["drifts"] is None


@pytest.mark.parametrize("shape", list(SCHEMAS))
def test_every_shape_is_one_table_and_its_records_are_its_rows(shape: str) -> None:
    table = tables.table(Chunk.from_rows([two_segment_row()]), shape)
    assert table.schema == SCHEMAS[shape]
    assert table.num_rows == (1 if shape == "full" else 2)
    marked = json_fields(table.schema)
    assert marked == {"openrlhf": ("scores", "extra_logs", "task"), "slime": ("metadata", "task"),
                      "verl": ("task",), "trl": ("task",), "full": ("task", "drifts")}[shape]
    recs = tables.rows_of(table)
    assert [list(r) for r in recs] == [table.column_names] * table.num_rows
    for back, rec in zip(table.to_pylist(), recs, strict=True):
        for name, value in rec.items():
            if name in marked:  # JSON text in the table (sorted keys), its value in the record
                assert back[name] == orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
            elif isinstance(value, np.ndarray):
                assert back[name] == value.tolist()
            else:
                assert back[name] == value, name


def test_json_text_holds_any_value_and_null_stays_null() -> None:
    row = two_segment_row()
    row.update(task="a text task", drifts=[])
    (full,) = one(row, "full")
    assert (full["task"], full["drifts"]) == ("a text task", [])
    text = tables.table(Chunk.from_rows([row]), "full")
    assert text.column("task").to_pylist() == ['"a text task"'] and text.column("drifts").to_pylist() == ["[]"]
    first, _ = one(row, "trl")
    assert first["task"] == "a text task"
    row.update(task=None, drifts=None)
    (full,) = one(row, "full")
    assert full["task"] is None and full["drifts"] is None
    first, _ = one(row, "openrlhf")
    assert first["task"] is None and first["label"] == "null"
    assert records(Chunk.from_rows([]), "slime") == []


def _assembled(rng: np.random.Generator, index: int) -> Trajectory:
    """A random trajectory as the recorder assembles it: turns with 0-5 sampled ids (0: an empty turn), 0-4
    observation ids, some steps starting a new segment, a weight version per turn."""
    pairs = []
    for t in range(int(rng.integers(0, 6))):
        n = int(rng.integers(0, 6))
        turn = TurnRecord(f"e{index}:t{t}", t, 0, rng.integers(0, 100, n).astype(np.int32),
                          -rng.random(n).astype(np.float32), int(rng.integers(0, 4)))
        pairs.append((turn, StepRecord(f"e{index}:s{t}", t, turn.event_id, rng.integers(0, 100, int(
            rng.integers(0, 5))).astype(np.int32), 0.0, new_segment=bool(rng.random() < 0.3))))
    return assemble(rng.integers(0, 100, int(rng.integers(1, 5))).astype(np.int32), pairs)


def test_rebuilt_mask_and_versions_equal_what_assembly_stores() -> None:
    rng = np.random.default_rng(7)
    trajs = [_assembled(rng, i) for i in range(300)]
    ranges = [t.action_ranges for t in trajs]
    versions = [[int(t.weight_versions[a]) for a, _ in r] for t, r in zip(trajs, ranges, strict=True)]
    masks, wvs = rebuild_sampled([t.num_tokens for t in trajs], ranges, versions)
    for t, mask, wv in zip(trajs, masks, wvs, strict=True):
        assert mask.tolist() == t.loss_mask.tolist() and wv.tolist() == t.weight_versions.tolist()
    assert rebuild_sampled([], [], []) == ([], [])


def test_a_built_chunk_reads_two_arrays_and_rebuilds_three() -> None:
    chunk = Chunk.build({"episode_id": ["a", "b"]}, np.array([5, 6, 7, 8, 9], np.int32),
                        np.array([-0.5, -0.25], np.float32), np.array([5, 0]),
                        np.array([[1, 3], [4, 4]]), np.array([2, 0]), np.array([2, -1]), np.zeros((0, 2), np.int64),
                        np.array([0, 0]))
    first, empty = chunk
    assert first["token_ids"].tolist() == [5, 6, 7, 8, 9] and first["logprobs"].tolist() == [0, -0.5, -0.25, 0, 0]
    assert first["loss_mask"].tolist() == [0, 1, 1, 0, 0] and first["weight_versions"].tolist() == [-1, 2, 2, -1, -1]
    assert first["segments"] == [[0, 5]] and first["range_versions"] == [2, None]
    assert first["action_ranges"] == [[1, 3], [4, 4]]
    assert empty["loss_mask"].tolist() == [] and empty["action_ranges"] == [] and empty["segments"] == [[0, 0]]
    with pytest.raises(SchemaError, match="3 sampled logprobs for 2 sampled tokens"):
        Chunk.build({}, np.arange(5, dtype=np.int32), np.zeros(3, np.float32), np.array([5]), np.array([[1, 3]]),
                    np.array([1]), np.array([2]), np.zeros((0, 2), np.int64), np.array([0]))


def test_spread_lays_the_sampled_logprobs_on_the_ranges_and_sampled_of_takes_them_back() -> None:
    lo, hi = np.array([1, 4, 6]), np.array([3, 4, 8])
    full = spread(9, lo, hi, np.array([-1, -2, -3, -4], np.float32))
    assert full.dtype == np.float32 and full.tolist() == [0, -1, -2, 0, 0, 0, -3, -4, 0]
    assert sampled_of(full, lo, hi).tolist() == [-1, -2, -3, -4]
    assert spread(3, np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)).tolist() == [0, 0, 0]


@pytest.mark.parametrize(("ranges", "versions", "match"), [
    ([[[3, 7]]], [[1]], "outside"),
    ([[[2, 1]]], [[1]], "outside"),
    ([[[0, 3], [2, 4]]], [[1, 1]], "overlap"),
    ([[[0, 2]]], [[]], "one weight version per action range"),
    ([[[0, 2, 3]]], [[1]], "malformed"),
    ([[[0, 1, 2, 3]]], [[1]], "pairs"),
])
def test_rebuild_refuses_ranges_that_do_not_fit(ranges: list, versions: list, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        rebuild_sampled([5], ranges, versions)


def test_advantage_arithmetic_on_known_groups() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0]  # mean 0.5, sample std sqrt(1/3)
    std = (1 / 3) ** 0.5
    grpo = group_advantages(rewards, AdvantageSpec(AdvantageKind.GRPO, epsilon=0.0))
    assert grpo == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_advantages(rewards, AdvantageSpec(AdvantageKind.GRPO, epsilon=1.0)) == pytest.approx(
        [0.5 / (std + 1), -0.5 / (std + 1), -0.5 / (std + 1), 0.5 / (std + 1)])
    assert group_advantages([3.0, 1.0], AdvantageSpec(normalize_std=False)) == [1.0, -1.0]
    # rloo: r - mean(others): 1 - 1/3, 0 - 2/3
    assert group_advantages(rewards, AdvantageSpec(AdvantageKind.RLOO)) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert group_advantages([0.7], AdvantageSpec(AdvantageKind.RLOO)) == [0.0]
    assert group_advantages([0.7], AdvantageSpec(AdvantageKind.GRPO)) == [0.0]
    assert group_advantages([0.7, None], AdvantageSpec(AdvantageKind.NONE)) == [0.7, None]


def test_selection_validates_its_windows() -> None:
    with pytest.raises(ValueError, match="staleness"):
        Selection(max_staleness=2)
    with pytest.raises(ValueError, match="reward range"):
        Selection(reward_min=1, reward_max=0)
    assert RewardChoice.parse("rollout") is None
    assert RewardChoice.parse("judge@v2") == RewardChoice("judge", "v2")
    with pytest.raises(ValueError, match="NAME@VERSION"):
        RewardChoice.parse("judge")
    assert pa.types.is_list(SCHEMAS["slime"].field("weight_versions").type)
    assert Selection().as_json()["single_segment"] is False
    assert Selection(single_segment=True).as_json()["single_segment"] is True
