"""The verl adapter (rollout_ledger/client/adapters/verl.py) under verl 0.9.1's own code, against a real ledger: verl's
dataset, trainer batch, AgentLoopManager and AgentLoopWorkers run our agent loop in ``.venv-verl`` (``make verl``;
tests/verl_driver.py), and the tensors of the ``DataProto`` they make are checked here against the trajectories
the ledger stored: token-exact ids, the mask exactly on sampled ids, the engine's logprobs verbatim, the reward on
the last response token, one ledger group per verl uid. Its checkpoint engine and manager publish two steps'
weights, which the inference worker then serves; step 2's episodes run on step 1's weights.

``ROLLOUT_VERL_PYTHON`` names another interpreter with verl 0.9.1 and this project installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.client.reader import Selection, TrajectoryReader
from rollout_ledger.client.records import samples
from tests.helpers import API_TOKEN, AUTH, Sql, wait_for

REPO = Path(__file__).resolve().parents[2]
N, PROMPTS = 3, 2
"""tests/verl_driver.py: rollout.n and prompts per step."""
PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256


def verl_python() -> Path:
    """The interpreter with verl; fails the test with the fix when it is missing."""
    python = Path(os.environ.get("ROLLOUT_VERL_PYTHON", REPO / ".venv-verl" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"no verl interpreter at {python}: run `make verl` (a venv of its own for verl 0.9.1) or point "
                    "ROLLOUT_VERL_PYTHON at a python with verl==0.9.1 and this project installed")
    return python


def _serving(url: str, version: int) -> bool:
    workers = httpx.get(f"{url}/v1/policy", headers=AUTH, timeout=10).json()["workers"]
    return bool(workers) and all(w["serving"] == version for w in workers)


def _run_verl(url: str, model_dir: str, work: Path) -> dict[str, Any]:
    env = {**os.environ, "ROLLOUT_API_TOKEN": API_TOKEN, "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(verl_python()), "-m", "tests.verl_driver", "--url", url, "--model", model_dir,
                           "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, f"verl driver failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    result: dict[str, Any] = json.loads((work / "verl.json").read_text())
    return result


def _check_row(row: dict[str, Any], traj: dict[str, Any]) -> tuple[int, int, int]:
    """One row of verl's batch against its stored trajectory; the row's (start, prompt_end, end)."""
    found = samples(traj)
    assert len(found) == 1, "the episodes here have one segment each"
    s, p, e = found[-1].start, found[-1].prompt_end, found[-1].end
    ids, mask = np.asarray(traj["token_ids"]), np.asarray(traj["loss_mask"])
    logprobs = np.asarray(traj["logprobs"], np.float32)
    attn = np.asarray(row["attention_mask"])
    prompt_attn, response_attn = attn[:PROMPT_LENGTH], attn[PROMPT_LENGTH:]
    n_prompt, n_response = p - s, e - p
    assert n_response <= RESPONSE_LENGTH
    # left-padded prompt, right-padded response, token-exact
    assert prompt_attn.tolist() == [0] * (PROMPT_LENGTH - n_prompt) + [1] * n_prompt
    assert response_attn.tolist() == [1] * n_response + [0] * (RESPONSE_LENGTH - n_response)
    assert row["prompts"][PROMPT_LENGTH - n_prompt:] == ids[s:p].tolist()
    assert row["responses"][:n_response] == ids[p:e].tolist()
    assert row["input_ids"] == row["prompts"] + row["responses"]
    assert row["position_ids"] == np.clip(np.cumsum(attn) - 1, 0, None).tolist()
    # the mask: 1 exactly on sampled ids (inside an action range), 0 on observations and padding
    sampled = np.zeros(len(ids), bool)
    for a, b in traj["action_ranges"]:
        sampled[a:b] = True
    response_mask = np.asarray(row["response_mask"])
    assert response_mask[:n_response].tolist() == mask[p:e].tolist() == sampled[p:e].astype(int).tolist()
    assert not response_mask[n_response:].any()
    # the engine's logprobs verbatim (float32), 0.0 where nothing was sampled
    got = np.asarray(row["rollout_log_probs"], np.float32)
    assert got[:n_response].tobytes() == logprobs[p:e].tobytes()
    assert not got[n_response:].any() and not got[:n_response][~sampled[p:e]].any()
    assert (got[:n_response][sampled[p:e]] < 0).all()
    # the reward on the last response token only
    scores = np.asarray(row["rm_scores"], np.float32)
    expected = np.zeros(RESPONSE_LENGTH, np.float32)
    expected[n_response - 1] = traj["reward"] or 0.0
    assert scores.tobytes() == expected.tobytes()
    return s, p, e


def test_verl_agent_loop_and_checkpoint_engine_on_a_real_ledger(stack: Stack, database_url: str, model_dir: str,
                                                                tmp_path: Path) -> None:
    if not (Path(model_dir) / "model.safetensors").is_file():
        pytest.fail(f"{model_dir} has no weights to publish: run `make model`")
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_POLICY_REPORT_S="0.5")
    stack.start("env-worker", ROLLOUT_POLICY_REPORT_S="0.5")
    stack.start("recorder")
    url = stack.start("scheduler").url
    wait_for(lambda: _serving(url, 0), 30, "the inference worker to report version 0")

    result = _run_verl(url, model_dir, tmp_path)
    assert (result["engine"], result["manager"]) == ("LedgerCheckpointEngine", "LedgerCheckpointManager")
    sql = Sql(database_url)
    try:
        trajs = {r["episode_id"]: r for r in sql.rows(
            "select episode_id, batch_id, group_id, status, reward, token_ids, loss_mask, logprobs, action_ranges, "
            "segments, weight_versions from trajectories")}
        episodes = sql.rows("select id, group_id, status from episodes")
        members = Counter(r["group_id"] for r in episodes)
        statuses = {r["id"]: r["status"] for r in episodes}
        metadata = {r["id"]: r["metadata"] for r in sql.rows("select id, metadata from batches")}
    finally:
        sql.close()

    observed = 0
    for step in result["steps"]:
        rows = step["rows"]
        assert len(rows) == N * PROMPTS
        # groups: verl's rows of one uid are one ledger group (its batch named after the uid), each row another
        # episode of it, and every episode of the group is a row
        by_uid: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            by_uid[row["uid"]].append(row)
        assert len(by_uid) == PROMPTS and all(len(g) == N for g in by_uid.values())
        for uid, group in by_uid.items():
            group_ids = {r["ledger_group_id"] for r in group}
            assert len(group_ids) == 1
            (group_id,) = group_ids
            assert members[group_id] == N
            assert len({r["ledger_episode_id"] for r in group}) == N
            assert {trajs[r["ledger_episode_id"]]["group_id"] for r in group} == {group_id}
            assert metadata[group[0]["ledger_batch_id"]]["verl_uid"] == uid
        assert len({r["ledger_group_id"] for r in rows}) == PROMPTS
        for row in rows:
            traj = trajs[row["ledger_episode_id"]]
            _, p, e = _check_row(row, traj)
            assert row["ledger_status"] == traj["status"] and row["ledger_reward"] == traj["reward"]
            response_mask = row["response_mask"][: e - p]
            observed += any(response_mask[i] == 0 and 1 in response_mask[i:] for i in range(len(response_mask)))
            # the weights each step sampled with: step 1 the base model, step 2 what step 1 published
            versions = {int(v) for v in traj["weight_versions"] if v >= 0}
            assert versions == {step["step"] - 1} == {row["ledger_min_version"], row["ledger_max_version"]}
        assert step["meta"]["reward_extra_keys"] == []  # rm_scores came with every row
    assert observed, "no multi-turn row with environment tokens between sampled ones"

    # a task the env refuses: its episodes fail before their first turn and store no trajectory; each row is one of
    # them, with verl's own rendering of the prompt, no response and nothing to train on
    refused = result["refused"]["rows"]
    assert len(refused) == N and len({r["uid"] for r in refused}) == 1
    assert len({r["ledger_group_id"] for r in refused}) == 1
    assert len({r["ledger_episode_id"] for r in refused}) == N
    for row in refused:
        assert row["ledger_episode_id"] not in trajs and statuses[row["ledger_episode_id"]] == "failed"
        assert (row["ledger_status"], row["ledger_reward"], row["ledger_num_samples"]) == ("failed", None, 0)
        n_prompt = sum(row["attention_mask"][:PROMPT_LENGTH])
        assert row["prompts"][PROMPT_LENGTH - n_prompt:] == result["refused"]["verl_prompt"]
        assert not any(row["attention_mask"][PROMPT_LENGTH:]) and not any(row["response_mask"])
        assert not any(row["rm_scores"]) and not any(row["rollout_log_probs"])

    # the exporter's verl shape (TrajectoryReader) gives the same samples as the agent loop did
    batches = tuple(sorted({r["ledger_batch_id"] for s in result["steps"] for r in s["rows"]}))
    with TrajectoryReader(database_url, consumer="verl-test", fmt="verl",
                          selection=Selection(batch_ids=batches)) as reader:
        exported = {}
        for batch in reader.batches():
            for rec in batch.table.to_pylist():
                exported[rec["episode_id"]] = rec
            batch.ack()
    for row in (r for s in result["steps"] for r in s["rows"]):
        rec = exported[row["ledger_episode_id"]]
        n_prompt, n_response = len(rec["prompts"]), len(rec["responses"])
        assert rec["uid"] == row["ledger_group_id"]
        assert row["prompts"][PROMPT_LENGTH - n_prompt:] == rec["prompts"]
        assert row["responses"][:n_response] == rec["responses"]
        assert row["response_mask"][:n_response] == rec["response_mask"]
        assert (np.asarray(row["rollout_log_probs"][:n_response], np.float32).tobytes()
                == np.asarray(rec["rollout_log_probs"], np.float32).tobytes())

    # weights: step 0 is the base model (not published); steps 1 and 2 are, as HF directories the worker loaded
    assert result["actor_modes"] == ["rollout_ledger"] * 3
    assert result["updates"][0] == {"rollout_ledger/published": 0}
    assert [u["rollout_ledger/version"] for u in result["updates"][1:]] == [1, 2]
    assert result["checkpoints"] == ["v000001", "v000002"]
    for name, check in result["weights"].items():
        assert check["names_equal"] and check["tensors_equal"], name
        assert "model.safetensors.index.json" in check["files"] and "config.json" in check["files"]
        assert "tokenizer.json" in check["files"] and len([f for f in check["files"] if f.endswith(".safetensors")]) > 1
    policy = httpx.get(f"{url}/v1/policy", headers=AUTH, timeout=10).json()
    assert policy["current"]["version"] == 2
    assert policy["current"]["checkpoint"] == str(tmp_path / "ckpt" / "v000002")
    assert all(w["serving"] == 2 for w in policy["workers"])
