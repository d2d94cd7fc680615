"""Library and user envs as real processes on real NATS + Postgres: an ``rg:`` (reasoning-gym) batch and batches of
user env classes (``ROLLOUT_ENV_CLASSES``, sync and async gymnasium-style classes from tests/envs_user.py) through
an env worker, an inference worker on the fake engine, the recorder and the scheduler; the recorded rewards are
the library's (and the classes') verdicts on the recorded actions. A worker given a class that does not fit
refuses to start."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import httpx
import reasoning_gym

from rollout_ledger.cli.stack.supervisor import Stack
from tests.helpers import AUTH, Sql
from tests.integration.test_pipeline import check_token_exact, submit_and_wait

REPO = str(Path(__file__).resolve().parents[2])
PYTHONPATH = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
CLASSES = "adder=tests.envs_user:SyncAdder,guess=tests.envs_user:AsyncGuess"


def library_reward(dataset: str, task: dict[str, Any], action: str) -> tuple[float, Any]:
    """reasoning-gym's own score of ``action`` for the task's entry, and the entry's answer."""
    ds = reasoning_gym.create_dataset(dataset, seed=task["seed"])
    entry = ds[task["index"]]
    try:
        score = float(ds.score_answer(reasoning_gym.utils.extract_answer(action), entry))
    except Exception:
        score = 0.0
    return score, entry["answer"]


def episodes(sql: Sql, batch_id: str) -> list[dict[str, Any]]:
    return sql.rows("select e.id, e.task, e.status, e.reward, s.action, s.reward as step_reward, s.info "
                    "from episodes e join steps s on s.episode_id = e.id and not s.superseded "
                    "where e.batch_id = :b order by e.id, s.turn_index", b=batch_id)


def test_rg_and_user_class_batches_through_a_stack(stack: Stack, database_url: str) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    stack.start("env-worker", PYTHONPATH=PYTHONPATH, ROLLOUT_RG_DATASETS="basic_arithmetic,chain_sum",
                ROLLOUT_ENV_CLASSES=CLASSES)
    stack.start("recorder")
    url = stack.start("scheduler").url
    listed = httpx.get(f"{url}/v1/envs", headers=AUTH, timeout=10).json()
    envs = {e["name"]: e for e in listed["envs"]}  # the rg family is one entry listing its members
    assert {"rg:*", "adder", "guess"} <= set(envs) and not any(n.startswith("rg:") and n != "rg:*" for n in envs)
    assert envs["rg:*"]["members"] == ["rg:basic_arithmetic", "rg:chain_sum"]
    assert envs["guess"]["example_task"] == {"seed": 1, "high": 10, "tries": 6} and not envs["adder"]["multi_turn"]

    rg_tasks = [{"seed": 0, "index": i} for i in range(8)]
    rg_batch = submit_and_wait(url, env="rg:basic_arithmetic", tasks=rg_tasks, group_size=2, max_turns=1,
                               sampling={"max_tokens": 48})
    adder = submit_and_wait(url, env="adder", tasks=[{"a": i, "b": 3 * i} for i in range(6)], group_size=2,
                            max_turns=1, sampling={"max_tokens": 24})
    guess = submit_and_wait(url, env="guess", tasks=[{"seed": i, "high": 10, "tries": 5} for i in range(4)],
                            max_turns=6, sampling={"max_tokens": 24})
    sql = Sql(database_url)
    try:
        rows = episodes(sql, str(rg_batch["batch_id"]))
        assert len(rows) == 16 and {r["status"] for r in rows} == {"completed"}
        for row in rows:  # the recorded reward is reasoning-gym's score of the recorded action
            score, expected = library_reward("basic_arithmetic", row["task"], row["action"])
            assert row["reward"] == row["step_reward"] == score, row
            assert row["info"]["expected"] == expected and row["info"]["dataset"] == "basic_arithmetic"
        assert check_token_exact(sql, str(rg_batch["batch_id"])) == 16

        rows = episodes(sql, str(adder["batch_id"]))
        assert len(rows) == 12 and {r["status"] for r in rows} == {"completed"}
        for row in rows:
            found = re.findall(r"-?\d+", row["action"])
            right = bool(found) and int(found[-1]) == row["task"]["a"] + row["task"]["b"]
            assert row["reward"] == float(right) and row["info"]["expected"] == 4 * row["task"]["a"], row
        assert 0 < sum(r["reward"] for r in rows) < 12  # the fake answers some sums right, some off by one

        rows = episodes(sql, str(guess["batch_id"]))
        ends = {r["id"]: r for r in rows}  # the last step of each episode
        assert len(ends) == 4 and {r["status"] for r in ends.values()} <= {"completed", "truncated"}
        assert any(r["reward"] == 1.0 and r["status"] == "completed" for r in ends.values())
        assert check_token_exact(sql, str(guess["batch_id"])) == 4
    finally:
        sql.close()


async def test_a_worker_with_a_misfit_class_refuses_to_start(stack: Stack) -> None:
    proc = stack.start("env-worker", wait=False, PYTHONPATH=PYTHONPATH,
                       ROLLOUT_ENV_CLASSES="bad=tests.envs_user:OldReset")
    assert proc.proc is not None
    assert await asyncio.to_thread(proc.proc.wait, 60) != 0
    log = proc.log_path.read_text()
    assert "ROLLOUT_ENV_CLASSES entry bad=tests.envs_user:OldReset" in log
    assert "cannot be called as reset(seed=..., options=...)" in log
