"""The slime adapter (``rollout_ledger/client/adapters/slime.py``) against slime's ``Sample`` contract at a pinned
commit (``tests/unit/slime_contract.py``): every field it sets has slime's name and type, the lengths slime checks
agree, statuses are ``Sample.Status`` members, multi-segment trajectories are nested as slime nests a rollout of several
samples and pass slime's own nesting check; the rollout function submits the data source's prompts as one batch
and returns exactly its groups; the post-write hook serves each version slime writes. The ledger is faked here
(subclasses of ``LedgerClient`` and ``TrajectoryReader``); tests/integration/test_slime_adapter.py runs a real one."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import numpy as np
import pyarrow as pa
import pytest

from rollout_ledger.client.adapters import slime as adapter
from rollout_ledger.client.advantages import AdvantageKind
from rollout_ledger.client.cursor import Position, Read
from rollout_ledger.client.reader import Batch, Selection, TrajectoryReader
from rollout_ledger.client.rest import LedgerClient
from rollout_ledger.client.rows import Chunk
from rollout_ledger.client.tables import table
from tests.unit import slime_contract
from tests.unit.slime_contract import Sample

SET_BY_ADAPTER = ("group_index", "index", "rollout_id", "prompt", "tokens", "response_length", "label", "reward",
                  "loss_mask", "weight_versions", "rollout_log_probs", "status", "metadata")
"""The fields the adapter fills; the others keep slime's defaults."""

HINTS = get_type_hints(Sample, localns={**vars(Sample), "torch": types.SimpleNamespace(Tensor=type("Tensor", (), {}))})


def conforms(value: Any, hint: Any) -> bool:
    """``value`` is of the annotated type, strictly (a numpy integer is not an ``int``, an ``int`` not a ``float``)."""
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = get_args(hint)
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if origin is dict:
        key, val = get_args(hint)
        return isinstance(value, dict) and all(conforms(k, key) and conforms(v, val) for k, v in value.items())
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, float)
    return isinstance(value, hint)


# --- the pinned contract itself ----------------------------------------------------------------------------------


def test_the_stand_in_is_slimes_sample_at_the_pinned_commit() -> None:
    assert tuple(f.name for f in dataclasses.fields(Sample)) == slime_contract.FIELDS
    assert {m.name: m.value for m in Sample.Status} == slime_contract.STATUSES
    assert set(HINTS) == set(slime_contract.FIELDS)  # every annotation resolves
    assert conforms(["1", "2"], HINTS["weight_versions"]) and not conforms([1], HINTS["weight_versions"])
    assert conforms(None, HINTS["loss_mask"]) and not conforms([np.int32(1)], HINTS["loss_mask"])


# --- a batch as the ledger gives it -------------------------------------------------------------------------------

BATCH = "run-r3"


def trajectory(parts: list[tuple[Any, ...]], segments: list[list[int]] | None = None) -> dict[str, Any]:
    """A trajectory's arrays from ("p"rompt/"o"bservation ids) and ("s"ampled ids, version) parts, as the recorder
    assembles them: mask 1 exactly on the sampled ranges, their logprobs and version there, 0.0 and -1 elsewhere."""
    tok: list[int] = []
    mask: list[int] = []
    lp: list[float] = []
    wv: list[int] = []
    ranges: list[list[int]] = []
    for kind, ids, *version in parts:
        start = len(tok)
        tok += ids
        sampled = kind == "s"
        mask += [int(sampled)] * len(ids)
        lp += [-0.5 - 0.25 * i if sampled else 0.0 for i in range(len(ids))]
        wv += [version[0] if sampled else -1] * len(ids)
        if sampled:
            ranges.append([start, len(tok)])
    segments = segments or [[0, len(tok)]]
    return {"token_ids": np.array(tok, np.int32), "loss_mask": np.array(mask, np.int32),
            "logprobs": np.array(lp, np.float32), "weight_versions": np.array(wv, np.int32), "action_ranges": ranges,
            "segments": segments, "num_segments": len(segments), "num_tokens": len(tok),
            "num_sampled_tokens": sum(b - a for a, b in ranges), "prompt_len": ranges[0][0] if ranges else len(tok)}


def row(task: int, member: int, arrays: dict[str, Any], status: str = "completed",
        reward: float | None = 1.0, advantage: float | None = 0.5, turns: int = 1) -> dict[str, Any]:
    return {
        "episode_id": f"{BATCH}.{task}.{member}", "group_id": f"{BATCH}.{task}", "batch_id": BATCH,
        "group_index": member, "task_index": task, "env": "arithmetic", "attempt": 1, "status": status,
        "failure_class": "env" if status == "failed" else None, "reward": reward, "rollout_reward": reward,
        "advantage": advantage, "group_size": 2, "task": {"seed": task}, "prompt_text": f"prompt of task {task}",
        "drifts": [], "token_check": "ok", "num_turns": turns, "reward_source": "rollout", **arrays,
    }


def single(version: int = 7) -> dict[str, Any]:
    return trajectory([("p", [1, 2, 3]), ("s", [40, 41, 42], version)])


def two_segments() -> dict[str, Any]:
    """Prompt (4 ids), turn 1 (3 sampled, v7), observation (2); re-rendered context (6 ids), turn 2 (2 sampled, v8)."""
    return trajectory([("p", [1, 9, 8, 2]), ("s", [50, 51, 52], 7), ("o", [198, 1]),
                       ("p", [1, 9, 8, 2, 2, 1]), ("s", [71, 2], 8)], segments=[[0, 9], [9, 17]])


def ledger_rows(fan_out: bool = True) -> list[dict[str, Any]]:
    """Three groups of two, completed in the order 2, 0, 1: group 0 a completed and a truncated member; group 1 a
    two-segment member and a failed one without a reward; group 2 one member (the other ended without a
    trajectory)."""
    return [
        row(2, 0, single(9), advantage=0.0),
        row(0, 1, single(8), status="truncated", reward=0.0, advantage=-0.7),
        row(0, 0, single(7), advantage=0.7),
        row(1, 0, two_segments() if fan_out else single(), turns=2, advantage=0.7),
        row(1, 1, single(), status="failed", reward=None, advantage=None),
    ]


def slime_table(rows: list[dict[str, Any]]) -> pa.Table:
    return table(Chunk.from_rows(rows), "slime")


class DataSource:
    """slime's ``RolloutDataSource.get_samples`` (``slime/rollout/data_source.py`` 90-118): n deep copies of each
    dataset row, ``group_index`` and ``index`` counted across calls (started high here: they come from slime, not
    from the ledger)."""

    def __init__(self, n: int, rows: list[dict[str, Any]] | None = None) -> None:
        self.n = n
        self.rows = rows or [{"input": f"q{i}", "label": f"a{i}", "metadata": {"seed": 100 + i}} for i in range(9)]
        self.offset, self.group_index, self.index = 0, 40, 80

    def get_samples(self, num: int) -> list[list[Sample]]:
        out = []
        for r in self.rows[self.offset:self.offset + num]:
            prompt = Sample(prompt=r["input"], label=r["label"], metadata=dict(r["metadata"]))
            group = []
            for _ in range(self.n):
                s = copy.deepcopy(prompt)
                s.group_index, s.index = self.group_index, self.index
                self.index += 1
                group.append(s)
            self.group_index += 1
            out.append(group)
        self.offset += num
        return out


# --- records to samples --------------------------------------------------------------------------------------------


def check_sample(s: Sample) -> None:
    """Field by field against the contract: types, and the lengths slime checks."""
    assert isinstance(s, Sample)
    for name in SET_BY_ADAPTER:
        assert conforms(getattr(s, name), HINTS[name]), (name, getattr(s, name))
    defaults = Sample()
    for name in set(slime_contract.FIELDS) - set(SET_BY_ADAPTER):
        assert getattr(s, name) == getattr(defaults, name), name
    assert isinstance(s.reward, float) and s.loss_mask is not None and s.rollout_log_probs is not None
    assert s.response_length > 0
    assert len(s.tokens) > s.response_length  # a prompt, then the response
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    s._validate_response_metadata_lengths()  # slime's own check
    assert s.status in Sample.Status and s.status is not Sample.Status.PENDING
    assert all(v.isdigit() for v in s.weight_versions)


def test_records_become_slimes_samples_nested_as_slime_nests_a_rollout_of_several() -> None:
    groups = DataSource(2).get_samples(3)
    out = adapter.to_samples(slime_table(ledger_rows()), groups, Sample)
    # a group per task in task order; in it a rollout per member; every rollout a list (one trajectory has two)
    assert [len(g) for g in out] == [2, 2, 1]
    assert all(isinstance(rollout, list) for g in out for rollout in g)
    assert [[len(rollout) for rollout in g] for g in out] == [[1, 1], [2, 1], [1]]
    for t, group in enumerate(out):
        for m, rollout in enumerate(group):
            for s in rollout:
                check_sample(s)
                assert (s.group_index, s.index, s.rollout_id) == (40 + t, 80 + 2 * t + m, 80 + 2 * t + m)
                assert s.label == f"a{t}" and s.prompt == f"prompt of task {t}"
                assert s.metadata["seed"] == 100 + t  # the dataset row's metadata carries over
                assert s.metadata["episode_id"] == f"{BATCH}.{t}.{m}" and s.metadata["num_samples"] == len(rollout)
    (done, truncated), (fanned, failed), (alone,) = out
    assert alone[0].metadata["group_id"] == f"{BATCH}.2"  # its second member ended without a trajectory
    assert (done[0].status, truncated[0].status, failed[0].status) == (
        Sample.Status.COMPLETED, Sample.Status.TRUNCATED, Sample.Status.ABORTED)
    assert (done[0].reward, truncated[0].reward, failed[0].reward) == (1.0, 0.0, 0.0)
    assert failed[0].metadata["rollout_status"] == "failed" and failed[0].metadata["advantage"] is None
    assert done[0].tokens == [1, 2, 3, 40, 41, 42] and done[0].response_length == 3
    assert done[0].loss_mask == [1, 1, 1] and done[0].rollout_log_probs == [-0.5, -0.75, -1.0]
    assert done[0].weight_versions == ["7"] and truncated[0].weight_versions == ["8"]
    # the two segments: each its own sequence, the second's prompt the re-rendered context
    first, second = fanned
    assert first.tokens == [1, 9, 8, 2, 50, 51, 52, 198, 1] and first.response_length == 5
    assert first.loss_mask == [1, 1, 1, 0, 0] and first.rollout_log_probs == [-0.5, -0.75, -1.0, 0.0, 0.0]
    assert second.tokens == [1, 9, 8, 2, 2, 1, 71, 2] and second.response_length == 2
    assert (first.weight_versions, second.weight_versions) == (["7"], ["8"])
    assert [s.metadata["sample_index"] for s in fanned] == [0, 1]
    assert first.rollout_id == second.rollout_id == first.index
    # slime's own check of the nesting passes, and its flattening gives one Sample per segment in order
    slime_contract.validate_rollout_id_annotated(out)
    flat = slime_contract.flatten(out)
    assert len(flat) == 6 and all(isinstance(s, Sample) for s in flat)
    assert [s.metadata["episode_id"] for s in flat] == [f"{BATCH}.0.0", f"{BATCH}.0.1", f"{BATCH}.1.0",
                                                        f"{BATCH}.1.0", f"{BATCH}.1.1", f"{BATCH}.2.0"]


def test_without_multi_segment_trajectories_it_is_slimes_default_shape() -> None:
    groups = DataSource(2).get_samples(3)
    out = adapter.to_samples(slime_table(ledger_rows(fan_out=False)), groups, Sample)
    assert all(isinstance(s, Sample) for g in out for s in g)  # list[list[Sample]]
    for g in out:
        for s in g:
            check_sample(s)
    slime_contract.validate_rollout_id_annotated(out)
    assert len(slime_contract.flatten(out)) == 5


def test_an_unsplit_nesting_would_fail_slimes_check() -> None:
    """Why every sibling carries the rollout id: slime refuses a fanned-out rollout without one."""
    groups = DataSource(2).get_samples(3)
    out = adapter.to_samples(slime_table(ledger_rows()), groups, Sample)
    out[1][0][1].rollout_id = None
    with pytest.raises(AssertionError, match="rollout_id is unset"):
        slime_contract.validate_rollout_id_annotated(out)


# --- the rollout function, on a faked ledger ---------------------------------------------------------------------


class FakeLedger(LedgerClient):
    """The scheduler: records the submitted batch and reports it done."""

    def __init__(self, done: bool = True, created: bool = True) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.done = done
        self.created = created

    def submit(self, **body: Any) -> dict[str, Any]:
        self.submitted.append(body)
        return {"batch_id": body["batch_id"], "created": self.created}

    def batch(self, batch_id: str) -> dict[str, Any]:
        return {"batch_id": batch_id, "done": self.done, "counts": {"completed": 5}}

    def close(self) -> None:
        raise AssertionError("an injected client is the caller's to close")


class FakeReader(TrajectoryReader):
    """The consumer: delivers ``rows`` once ``groups`` groups are asked for (as ``read_groups`` does), records
    the acknowledgement."""

    def __init__(self, selection: Selection, rows: list[dict[str, Any]] | None) -> None:
        self.sel = selection
        self.rows = rows
        self.asked: list[int] = []
        self.acked = False
        self.closed = False

    def read_groups(self, groups: int, timeout_s: float | None = None, poll_s: float = 0.5,
                    stop: Any = None, scan: int = 100_000) -> Batch | None:
        self.asked.append(groups)
        if self.rows is None:
            return None
        return Batch(slime_table(self.rows), Read(Position(0, 0), Position(0, 1), 1), self)

    def _ack(self, batch: Batch) -> None:
        self.acked = True

    def close(self) -> None:
        self.closed = True


def slime_args(**extra: Any) -> types.SimpleNamespace:
    """The slime ``args`` the adapter reads (names as slime's argparse makes them), plus ``ledger_*`` keys."""
    base = {"rollout_batch_size": 3, "n_samples_per_prompt": 2, "rollout_temperature": 0.8, "rollout_top_p": 1.0,
            "rollout_top_k": -1, "rollout_max_response_len": 64, "rollout_stop": None,
            "advantage_estimator": "grpo", "rewards_normalization": True, "grpo_std_normalization": True,
            "ledger_env": "arithmetic", "ledger_consumer": "run"}
    return types.SimpleNamespace(**{**base, **extra})


def run(args: types.SimpleNamespace, ledger: FakeLedger, rows: list[dict[str, Any]] | None,
        rollout_id: int = 3) -> tuple[list[list[Any]], FakeReader]:
    readers: list[FakeReader] = []

    def open_reader(settings: adapter.LedgerSettings, selection: Selection) -> FakeReader:
        assert not ledger.submitted, "the cursor is opened before the batch exists"
        readers.append(FakeReader(selection, rows))
        return readers[-1]

    out = adapter.generate_rollout(args, rollout_id, DataSource(args.n_samples_per_prompt), sample_cls=Sample,
                                   ledger=ledger, open_reader=open_reader, environ={})
    return out, readers[0]


def test_generate_rollout_submits_the_data_sources_prompts_and_returns_exactly_its_groups() -> None:
    ledger = FakeLedger()
    args = slime_args(ledger_batch={"max_turns": 4, "context": {"policy": "window", "window_turns": 1},
                                    "sampling": {"max_tokens": 16}, "metadata": {"note": "x"}})
    out, reader = run(args, ledger, ledger_rows())
    (body,) = ledger.submitted
    assert body["env"] == "arithmetic" and body["group_size"] == 2 and body["batch_id"] == BATCH
    assert body["tasks"] == [{"seed": 100}, {"seed": 101}, {"seed": 102}]  # each row's metadata object
    assert body["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_tokens": 16}
    assert body["max_turns"] == 4 and body["context"] == {"policy": "window", "window_turns": 1}
    assert body["metadata"] == {"note": "x", "trainer": "slime", "consumer": "run", "rollout_id": 3}
    assert reader.sel.batch_ids == (BATCH,) and reader.sel.complete_groups
    assert reader.sel.advantage.kind is AdvantageKind.GRPO and reader.sel.advantage.normalize_std
    assert reader.asked == [3] and reader.acked and reader.closed
    assert [len(g) for g in out] == [2, 2, 1]
    slime_contract.validate_rollout_id_annotated(out)


def test_a_batch_done_without_all_its_groups_stops_with_the_cause() -> None:
    with pytest.raises(adapter.LedgerRolloutError, match=r"fewer than 3 of its groups.*consumer 'run' already"):
        run(slime_args(), FakeLedger(done=True, created=False), None)


def test_what_the_rollout_function_refuses() -> None:
    with pytest.raises(adapter.LedgerRolloutError, match="evaluation"):
        adapter.generate_rollout(slime_args(), 0, DataSource(2), evaluation=True, sample_cls=Sample)
    with pytest.raises(adapter.LedgerRolloutError, match="ledger_env"):
        adapter.generate_rollout(slime_args(ledger_env=None), 0, DataSource(2), sample_cls=Sample, environ={})
    if adapter.SLIME_SAMPLE is None:
        with pytest.raises(adapter.LedgerRolloutError, match="sample_cls"):
            adapter.generate_rollout(slime_args(), 0, DataSource(2))


def test_default_task() -> None:
    assert adapter.default_task(Sample(prompt="2+2?", label="4", metadata={"seed": 3})) == {"seed": 3}
    assert adapter.default_task(Sample(prompt="2+2?", label="4")) == {"prompt": "2+2?", "label": "4"}
    assert adapter.default_task(Sample(group_index=12)) == {"seed": 12}
    assert adapter.load_function("rollout_ledger.client.adapters.slime.default_task") is adapter.default_task
    assert adapter.load_function("rollout_ledger.client.adapters.slime:default_task") is adapter.default_task


# --- settings, advantages ----------------------------------------------------------------------------------------


def test_settings_from_args_then_environment() -> None:
    environ = {"ROLLOUT_SCHEDULER_URL": "http://sched:8000", "DATABASE_URL": "postgresql://db/x",
               "ROLLOUT_EXPORT_DATABASE_URL": "postgresql://ro@db/x", "ROLLOUT_SLIME_ENV": "guess-number",
               "ROLLOUT_SLIME_CONSUMER": "exp-1", "ROLLOUT_SLIME_BATCH": '{"max_turns": 3}',
               "ROLLOUT_SLIME_TIMEOUT_S": "90", "ROLLOUT_SLIME_VERSION_OFFSET": "10",
               "ROLLOUT_SLIME_SWAP_MODE": "abort"}
    s = adapter.LedgerSettings.from_args(types.SimpleNamespace(), environ)
    assert (s.url, s.database_url, s.env, s.consumer) == ("http://sched:8000", "postgresql://ro@db/x",
                                                          "guess-number", "exp-1")
    assert (s.batch, s.timeout_s, s.version_offset, s.swap_mode) == ({"max_turns": 3}, 90.0, 10, "abort")
    args = types.SimpleNamespace(ledger_url="http://other:1", ledger_env="arithmetic", ledger_batch={"max_turns": 1})
    s = adapter.LedgerSettings.from_args(args, environ)
    assert (s.url, s.env, s.batch) == ("http://other:1", "arithmetic", {"max_turns": 1})
    d = adapter.LedgerSettings.from_args(types.SimpleNamespace(), {})
    assert (d.url, d.consumer, d.database_url, d.timeout_s, d.swap_mode) == ("http://127.0.0.1:8000", "slime", None,
                                                                            None, "drain")
    long = adapter.LedgerSettings(consumer="c" * 120).batch_id(12345)
    assert len(long) <= 64 and long.endswith("-r12345")
    with pytest.raises(adapter.LedgerRolloutError, match="JSON object"):
        adapter.LedgerSettings.from_args(types.SimpleNamespace(), {"ROLLOUT_SLIME_BATCH": "[1]"})


@pytest.mark.parametrize(("estimator", "normalise", "std", "kind", "divides"), [
    ("grpo", True, True, AdvantageKind.GRPO, True), ("grpo", True, False, AdvantageKind.GRPO, False),
    ("gspo", True, True, AdvantageKind.GRPO, True), ("reinforce_plus_plus_baseline", True, True, AdvantageKind.GRPO,
                                                     False),
    ("grpo", False, True, AdvantageKind.NONE, None), ("ppo", True, True, AdvantageKind.NONE, None)])
def test_advantages_as_slime_would_compute_them(estimator: str, normalise: bool, std: bool, kind: AdvantageKind,
                                                divides: bool | None) -> None:
    spec = adapter.advantage_spec(types.SimpleNamespace(advantage_estimator=estimator, rewards_normalization=normalise,
                                                        grpo_std_normalization=std))
    assert spec.kind is kind
    if divides is not None:
        assert spec.normalize_std is divides and spec.epsilon == 1e-6


def test_reward_post_process_gives_the_ledgers_advantages() -> None:
    out = adapter.to_samples(slime_table(ledger_rows()), DataSource(2).get_samples(3), Sample)
    flat = slime_contract.flatten(out)
    raw, advantages = adapter.reward_post_process(slime_args(), flat)
    assert raw == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert advantages == pytest.approx([0.7, -0.7, 0.7, 0.7, 0.0, 0.0])  # both segments get their trajectory's


# --- the post-write hook -------------------------------------------------------------------------------------------


class PublishingLedger(LedgerClient):
    def __init__(self) -> None:
        self.published: list[tuple[Any, ...]] = []

    def publish_version(self, version: int, checkpoint: str | Path, mode: str = "drain", notes: str = "",
                        timeout_s: float | None = 600.0) -> float:
        self.published.append((version, checkpoint, mode, notes, timeout_s))
        return 0.25


def test_the_hook_serves_each_version_slime_writes(tmp_path: Path) -> None:
    ledger = PublishingLedger()
    version_dir = tmp_path / "weights" / "weight_v000007"
    version_dir.mkdir(parents=True)
    args = types.SimpleNamespace(update_weight_mode="full", ledger_swap_mode="abort", ledger_version_offset=100,
                                 ledger_serve_timeout_s=30)
    adapter.post_write_hook(args, str(version_dir), [], ledger=ledger, environ={})
    assert ledger.published == [(107, str(version_dir), "abort", "slime weight_v000007", 30.0)]
    assert adapter.version_of("/w/weight_v000123") == 123
    with pytest.raises(adapter.LedgerRolloutError, match="weight_v"):
        adapter.post_write_hook(args, str(tmp_path / "step-7"), [], ledger=ledger, environ={})
    with pytest.raises(adapter.LedgerRolloutError, match="delta"):
        adapter.post_write_hook(types.SimpleNamespace(update_weight_mode="delta"), str(version_dir), [],
                                ledger=ledger, environ={})


def test_only_rank_zero_announces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = PublishingLedger()
    rank = {"value": 1}
    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 get_rank=lambda: rank["value"])
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    args = types.SimpleNamespace(update_weight_mode="full")
    adapter.post_write_hook(args, str(tmp_path / "weight_v000002"), [], ledger=ledger, environ={})
    assert ledger.published == []
    rank["value"] = 0
    adapter.post_write_hook(args, str(tmp_path / "weight_v000002"), [], ledger=ledger, environ={})
    assert [p[0] for p in ledger.published] == [2]
