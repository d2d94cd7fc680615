"""Every export format from a real Postgres, read back with pyarrow and checked field by field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest
from atif import Trajectory
from typer.testing import CliRunner

from rollout_ledger.cli.main import app
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.reader import TrajectoryReader
from rollout_ledger.client.records import SCHEMAS, Unit
from rollout_ledger.client.selection import Selection
from rollout_ledger.services.exporter.export import export, export_batch
from rollout_ledger.shared.errors import SchemaError
from tests.integration.export_data import Traj, arrays, run, seed_batch, seed_turns
from tests.integration.test_pipeline import REWRITING_TEMPLATE, start_all, submit_and_wait

SEGMENTED = Traj(reward=0.0, status="truncated", segments=((4, ((3, 2), (2, 1))), (6, ((2, 0),))), versions=(1, 2, 2))
PLAIN = Traj(reward=1.0)


@pytest.fixture
def seeded(database_url: str) -> str:
    seed_batch(database_url, "fb", [[PLAIN, SEGMENTED]])
    return database_url


def read(path: Path, file_type: str) -> pa.Table:
    if file_type == "parquet":
        return pq.read_table(path)
    return pajson.read_json(path)


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_openrlhf(seeded: str, tmp_path: Path, file_type: str) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / f"o.{file_type}", "openrlhf", file_type)
    rows = read(res.path, file_type).to_pylist()
    assert res.records == len(rows) == 3  # plain: one segment; segmented: two
    a, b = arrays(PLAIN, 0), arrays(SEGMENTED, 1)
    plain, seg0, seg1 = rows
    assert plain["observation_tokens"] == a.token_ids.tolist()
    assert plain["action_ranges"] == a.action_ranges
    assert plain["rollout_log_probs"] == pytest.approx(a.logprobs.tolist())
    assert (plain["reward"], plain["truncated"], plain["status"]) == (1.0, False, "completed")
    (s0, e0), (s1, e1) = b.segments
    assert seg0["observation_tokens"] == b.token_ids[s0:e0].tolist()
    assert seg0["action_ranges"] == [[4, 7], [9, 11]]
    assert seg0["rollout_log_probs"] == pytest.approx(b.logprobs[s0:e0].tolist())
    assert seg1["observation_tokens"] == b.token_ids[s1:e1].tolist()
    assert seg1["action_ranges"] == [[6, 8]]
    assert (seg0["sample_index"], seg1["sample_index"], seg1["num_samples"]) == (0, 1, 2)
    for r in (seg0, seg1):
        assert (r["reward"], r["truncated"], r["episode_id"], r["group_id"]) == (0.0, True, "fb.0.1", "fb.0")
        assert r["advantage"] == pytest.approx(-0.5 / 0.5 ** 0.5, rel=1e-5)  # rewards (1, 0): std 1/sqrt 2
    logs = seg1["extra_logs"] if file_type == "jsonl" else json.loads(seg1["extra_logs"])
    assert logs["weight_versions"] == [2] and logs["reward_source"] == "rollout"
    assert json.loads(plain["label"]) == {"seed": 0} and plain["prompt"] == "prompt 0"


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_slime(seeded: str, tmp_path: Path, file_type: str) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / f"s.{file_type}", "slime", file_type)
    plain, seg0, seg1 = read(res.path, file_type).to_pylist()
    a, b = arrays(PLAIN, 0), arrays(SEGMENTED, 1)
    assert plain["tokens"] == a.token_ids.tolist()
    assert plain["response_length"] == len(a.token_ids) - a.prompt_len
    assert plain["loss_mask"] == a.loss_mask[a.prompt_len:].tolist()
    assert plain["rollout_log_probs"] == pytest.approx(a.logprobs[a.prompt_len:].tolist())
    assert (plain["status"], plain["weight_versions"], plain["index"]) == ("completed", ["1"], 0)
    (s0, e0), (s1, e1) = b.segments
    assert seg0["tokens"] == b.token_ids[s0:e0].tolist() and seg0["response_length"] == e0 - 4
    assert seg0["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 0]
    assert seg0["weight_versions"] == ["1", "2"]
    assert seg1["tokens"] == b.token_ids[s1:e1].tolist() and seg1["response_length"] == 2
    assert seg1["loss_mask"] == [1, 1] and seg1["rollout_log_probs"] == pytest.approx(b.logprobs[e1 - 2:e1].tolist())
    assert seg1["status"] == "truncated" and seg1["weight_versions"] == ["2"]


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_verl(seeded: str, tmp_path: Path, file_type: str) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / f"v.{file_type}", "verl", file_type)
    plain, seg0, seg1 = read(res.path, file_type).to_pylist()
    a, b = arrays(PLAIN, 0), arrays(SEGMENTED, 1)
    p = a.prompt_len
    assert plain["prompts"] == a.token_ids[:p].tolist() and plain["responses"] == a.token_ids[p:].tolist()
    assert plain["response_mask"] == a.loss_mask[p:].tolist()
    assert plain["attention_mask"] == [1] * len(a.token_ids)
    assert plain["position_ids"] == list(range(len(a.token_ids)))
    assert plain["rollout_log_probs"] == pytest.approx(a.logprobs[p:].tolist())
    assert plain["uid"] == seg0["uid"] == "fb.0"
    s1, e1 = b.segments[1]
    assert seg1["prompts"] == b.token_ids[s1:e1 - 2].tolist() and seg1["responses"] == b.token_ids[e1 - 2:e1].tolist()
    assert seg1["position_ids"] == list(range(e1 - s1))


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_trl(seeded: str, tmp_path: Path, file_type: str) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / f"t.{file_type}", "trl", file_type)
    plain, seg0, _ = read(res.path, file_type).to_pylist()
    a, b = arrays(PLAIN, 0), arrays(SEGMENTED, 1)
    p = a.prompt_len
    assert plain["prompt_ids"] == a.token_ids[:p].tolist() and plain["completion_ids"] == a.token_ids[p:].tolist()
    assert plain["completion_mask"] == [1] * (len(a.token_ids) - p)
    assert plain["tool_mask"] == a.loss_mask[p:].tolist()
    assert plain["logprobs"] == pytest.approx(a.logprobs[p:].tolist())
    _, e0 = b.segments[0]
    assert seg0["tool_mask"] == b.loss_mask[4:e0].tolist()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_full_record(seeded: str, tmp_path: Path, fmt: str) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / f"f.{fmt}", fmt)
    rows = read(res.path, fmt).to_pylist()
    assert res.records == len(rows) == 2
    b = arrays(SEGMENTED, 1)
    seg = rows[1]
    assert seg["token_ids"] == b.token_ids.tolist() and seg["loss_mask"] == b.loss_mask.tolist()
    assert seg["logprobs"] == pytest.approx(b.logprobs.tolist())
    assert seg["weight_versions"] == b.weight_versions.tolist()
    assert seg["segments"] == b.segments and seg["num_segments"] == 2 and seg["action_ranges"] == b.action_ranges
    assert (seg["status"], seg["reward"], seg["group_size"], seg["num_turns"]) == ("truncated", 0.0, 2, 3)
    if fmt == "parquet":
        assert pq.read_schema(res.path).remove_metadata() == SCHEMAS["full"]


def test_per_turn_unit_and_batch_helper(seeded: str, tmp_path: Path) -> None:
    res = export(seeded, Selection(batch_ids=("fb",)), tmp_path / "turns.parquet", "trl", unit=Unit.TURN)
    rows = pq.read_table(res.path).to_pylist()
    assert len(rows) == 4  # 1 turn + 3 turns
    b = arrays(SEGMENTED, 1)
    second_turn = rows[2]
    assert second_turn["prompt_ids"] == b.token_ids[0:9].tolist()
    assert second_turn["completion_ids"] == b.token_ids[9:11].tolist() and second_turn["tool_mask"] == [1, 1]
    demo = export_batch(seeded, "fb", tmp_path / "demo", "jsonl")
    assert demo.path.name == "fb.jsonl" and demo.records == 3


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_every_record_carries_its_task_and_task_index(database_url: str, tmp_path: Path, file_type: str) -> None:
    """A stored batch of three tasks: every shape carries each record's task (JSON text in Parquet and the Python
    API, the value in JSONL) and the task's index in its batch (``episodes.task_index``)."""
    seed_batch(database_url, "tk", [[PLAIN, SEGMENTED], [PLAIN], [SEGMENTED, PLAIN]])
    want = {"tk.0.0": 0, "tk.0.1": 0, "tk.1.0": 1, "tk.2.0": 2, "tk.2.1": 2}
    assert run(database_url, "SELECT id, task_index FROM episodes ORDER BY id") == sorted(want.items())
    for fmt in ("openrlhf", "slime", "verl", "trl", file_type):
        res = export(database_url, Selection(batch_ids=("tk",)), tmp_path / f"{fmt}.{file_type}", fmt, file_type)
        rows = read(res.path, file_type).to_pylist()
        assert len(rows) == (5 if fmt == file_type else 7)  # trainer shapes: a sample per segment
        for r in rows:
            ti = want[r["episode_id"]]
            assert r["task_index"] == ti, (fmt, r["episode_id"])
            assert r["task"] == ({"seed": ti} if file_type == "jsonl" else '{"seed":' + str(ti) + "}"), fmt
            if "label" in r:
                assert json.loads(r["label"]) == {"seed": ti}
        if file_type == "parquet":
            schema = pq.read_schema(res.path)
            assert schema.field("task_index").type == pa.int32()
            assert schema.field("task").metadata == {b"rollout_ledger.json": b"true"}
    with TrajectoryReader(database_url, "tasks", fmt="verl") as reader:  # a consumer's read takes them too
        batch = reader.next_batch()
        assert batch is not None
        got = dict(zip(batch.table.column("episode_id").to_pylist(), batch.table.column("task_index").to_pylist(),
                       strict=False))
        assert got == want and batch.numpy()["task_index"].dtype.name == "int32"
        assert set(batch.table.column("task").to_pylist()) == {'{"seed":0}', '{"seed":1}', '{"seed":2}'}
        batch.ack()


TOOL_TURN = Traj(reward=0.5, segments=((5, ((4, 3), (3, 0))),), versions=(3, 4), actions=(
    'Let me look. <tool_call>{"name": "get_order", "arguments": {"order_id": "A1"}}</tool_call>', "It shipped."))


def exported_atif(database_url: str, sel: Selection, path: Path) -> list[Trajectory]:
    """``sel`` exported as ATIF, every line checked: the ``atif`` models accept it, and it is token-exact: each agent
    step's ids, logprobs, weight version and context length are those of the turn Postgres holds for it, and its ids
    and logprobs the full record's (of the same selection) at its place; the prompt followed by every step's sampled
    and observation ids is the trajectory."""
    res = export(database_url, sel, path, "atif")
    lines = res.path.read_text().splitlines()
    assert res.records == len(lines)
    docs = [Trajectory.model_validate_json(line) for line in lines]
    full_path = export(database_url, sel, path.with_suffix(".full.jsonl"), "jsonl").path
    full = [json.loads(x) for x in full_path.read_text().splitlines()]
    kept = {(r[0], r[1], r[2]): r[3:] for r in run(
        database_url, "SELECT s.episode_id, s.attempt, s.turn_index, t.token_ids, t.logprobs, t.weight_version, "
                      "t.prompt_len FROM trajectories tr JOIN steps s ON s.episode_id = tr.episode_id AND "
                      "s.attempt = tr.attempt AND s.turn_index < tr.num_turns JOIN turns t ON t.event_id = "
                      "s.turn_event_id")}
    for doc, rec in zip(docs, full, strict=True):
        eid, attempt, extra = rec["episode_id"], rec["attempt"], doc.extra or {}
        assert (doc.schema_version, doc.session_id, doc.trajectory_id) == ("ATIF-v1.8", eid, f"{eid}:a{attempt}")
        assert (extra["episode_id"], extra["batch_id"], extra["group_id"], extra["attempt"]) == (
            eid, rec["batch_id"], rec["group_id"], attempt)
        assert (extra["reward"], extra["status"], extra["segments"]) == (rec["reward"], rec["status"], rec["segments"])
        assert doc.steps[0].source == "user" and doc.steps[0].message == rec["prompt_text"]
        agent = doc.steps[1:]
        assert [s.source for s in agent] == ["agent"] * rec["num_turns"]
        ids, lps = rec["token_ids"], np.array(rec["logprobs"], np.float32)
        rebuilt = ids[:rec["prompt_len"]]
        for k, step in enumerate(agent):
            m = step.metrics
            assert m is not None and step.extra is not None and m.logprobs is not None
            sampled_ids, sampled_lps, version, prompt_len = kept[(eid, attempt, k)]
            a, b = step.extra["sampled_range"]
            assert m.completion_token_ids == sampled_ids == ids[a:b]
            assert np.array_equal(np.array(m.logprobs, np.float32), np.array(sampled_lps, np.float32))
            assert np.array_equal(np.array(m.logprobs, np.float32), lps[a:b])
            assert (m.extra or {})["weight_version"] == version
            seg_start = rec["segments"][step.extra["segment"]][0]
            assert m.prompt_token_ids == ids[seg_start:a] and m.prompt_tokens == a - seg_start == prompt_len
            obs = (step.observation.results[0].extra or {})["token_ids"] if step.observation else []
            rebuilt = rebuilt + m.completion_token_ids + obs
        assert rebuilt == ids
        assert doc.final_metrics is not None and doc.final_metrics.total_completion_tokens == rec["num_sampled_tokens"]
    return docs


def test_atif(database_url: str, tmp_path: Path) -> None:
    """Every trajectory as one ATIF v1.8 line, token-exact (``exported_atif``), with its segments, tool calls and
    reward."""
    groups = [[PLAIN, SEGMENTED], [TOOL_TURN]]
    seed_batch(database_url, "at", groups)
    seed_turns(database_url, "at", groups)
    docs = exported_atif(database_url, Selection(batch_ids=("at",)), tmp_path / "at.atif.jsonl")
    assert len(docs) == 3
    seg = docs[1]
    assert [s.extra["segment"] for s in seg.steps[1:] if s.extra] == [0, 0, 1]
    tool = docs[2]
    step = tool.steps[1]
    assert step.message == "Let me look." and step.tool_calls is not None
    (call,) = step.tool_calls
    assert (call.function_name, call.arguments) == ("get_order", {"order_id": "A1"})
    assert step.observation is not None and step.observation.results[0].source_call_id == call.tool_call_id
    assert tool.steps[2].message == "It shipped." and tool.steps[2].tool_calls is None
    assert (tool.extra or {})["reward"] == 0.5 and [(s.metrics.extra or {})["weight_version"]
                                                   for s in tool.steps[1:] if s.metrics] == [3, 4]


def test_atif_of_recorded_episodes(stack: Stack, database_url: str, tmp_path: Path) -> None:
    """Episodes the pipeline ran and the recorder stored (the fake engine; a history-rewriting template, so every
    turn after the first starts a new segment) export as token-exact ATIF: each turn's context is its segment."""
    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING_TEMPLATE)
    url = start_all(stack, ROLLOUT_CHAT_TEMPLATE=str(template))
    info = submit_and_wait(url, env="fixed-turns", tasks=[{"turns": 3}], group_size=2, max_turns=4,
                           sampling={"max_tokens": 12})
    docs = exported_atif(database_url, Selection(batch_ids=(str(info["batch_id"]),)), tmp_path / "run.atif.jsonl")
    assert len(docs) == 2
    for doc in docs:
        assert [(s.extra or {})["segment"] for s in doc.steps[1:]] == [0, 1, 2]
        assert [(s.extra or {})["new_segment"] for s in doc.steps[1:]] == [True, True, False]


def test_atif_refuses_what_it_cannot_write(database_url: str, tmp_path: Path) -> None:
    """ATIF is JSONL only; a trajectory whose turns are not stored, or disagree with it, is an error naming it
    (and no file is left), never a line skipped."""
    groups = [[PLAIN, SEGMENTED]]
    seed_batch(database_url, "ax", groups)
    sel = Selection(batch_ids=("ax",))
    with pytest.raises(ValueError, match="JSONL only"):
        export(database_url, sel, tmp_path / "a.parquet", "atif", "parquet")
    with pytest.raises(SchemaError, match=r"trajectory ax\.0\.0 attempt 1: the step of turn 0 is not stored"):
        export(database_url, sel, tmp_path / "a.jsonl", "atif")
    assert not list(tmp_path.iterdir())
    seed_turns(database_url, "ax", groups)
    run(database_url, "UPDATE turns SET token_ids[1] = token_ids[1] + 1 WHERE episode_id = 'ax.0.1' AND turn_index = 1")
    with pytest.raises(SchemaError, match=r"trajectory ax\.0\.1 attempt 1: the sampled ids of turn 1"):
        export(database_url, sel, tmp_path / "a.jsonl", "atif")
    assert not list(tmp_path.iterdir())
    runner, env = CliRunner(), {"DATABASE_URL": database_url}
    bad = runner.invoke(app, ["export", "--batch", "ax", "--format", "atif", "--file-type", "parquet"], env=env)
    assert bad.exit_code == 2 and "JSONL only" in bad.output, bad.output
    bad = runner.invoke(app, ["export", "--consumer", "c", "--format", "atif"], env=env)
    assert bad.exit_code == 2 and "one-shot export" in bad.output, bad.output
    bad = runner.invoke(app, ["export", "--batch", "ax", "--format", "atif", "--out", str(tmp_path)], env=env)
    assert bad.exit_code == 1 and "trajectory ax.0.1 attempt 1" in bad.output, bad.output
