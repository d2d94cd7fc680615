"""The closed loop on the real engine (issue 15, part 4): ``rollout demo --rl``'s GRPO trainer example
(examples/grpo/train.py) runs on the trainers' stack on vLLM (conftest.py) for two small iterations, pipelined (one
batch bounded at admission with max_staleness 0: the second iteration's episodes wait until every worker serves the
version the trainer pushed). From the version v the workers served when it began, versions advance v -> v+1 -> v+2
and every inference worker serves them, the second iteration's episodes carry v+1, the trainer wrote its audit rows,
and its logprobs match vLLM's on the weights it pushed while the weights it started from do not: the engine really
loaded the trainer's checkpoint (tied head included).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import psycopg
import pytest
import torch
from rich.console import Console

from examples.grpo.train import Trajectory, token_logprobs
from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.audit import audit_batch, load_model, recompute
from tests.e2e.trainers.conftest import served_version

if TYPE_CHECKING:
    from rollout_ledger.cli.stack.devstack import DevStack

pytestmark = pytest.mark.e2e

GAP_MEAN_BOUND = 1e-4
"""Mean |Δlogprob| between the trainer (transformers, float32) and vLLM (float32) on the version the trainer
holds. Measured in `make demo-rl` runs: 4e-6..6e-6 per iteration (max 7e-5), every version after the first one
loaded live. Before the worker extension re-packed the tied lm_head, the gap grew to ~5e-3 after a few versions."""
GAP_MAX_BOUND = 5e-4
"""Max |Δlogprob| over the same tokens (measured: up to 7e-5)."""
WEIGHTS_MOVED = 10
"""The same tokens against the weights the trainer started from (version v) differ at least this many times more
than against the version that sampled them: the engine serves the pushed weights, not the old ones."""


def test_the_trainers_batched_recomputation_is_the_audits(model_dir: str) -> None:
    """``token_logprobs`` (segments as right-padded rows of one forward pass, only the sampled positions through
    the vocabulary projection) gives the audit's per-segment recomputation."""
    from rollout_ledger.cli.modelstore import fetch

    fetch(Path(model_dir), with_weights=True)
    model = load_model(model_dir)
    rng = np.random.default_rng(7)

    def trajectory(n: int, segments: list[list[int]], positions: list[int]) -> Trajectory:
        ids = rng.integers(3, 49_000, n).astype(np.int64)
        zeros = np.zeros(len(positions), np.float32)
        return Trajectory("e", 1, "b", "g", 0.0, 1.0, ids, segments, np.asarray(positions), zeros,
                          np.zeros(len(positions), np.int32))

    trajectories = [trajectory(40, [[0, 40]], list(range(30, 40))),
                    trajectory(36, [[0, 14], [14, 36]], [10, 11, 13, 30, 35]),  # two segments, two contexts
                    trajectory(12, [[0, 12]], [11])]
    with torch.no_grad():
        got = token_logprobs(model, trajectories)
    for t, values in zip(trajectories, got, strict=True):
        reference = recompute(model, t.token_ids, t.segments, t.positions)
        assert values.shape == (t.positions.size,)
        np.testing.assert_allclose(values.double().numpy(), reference, atol=1e-4)


@pytest.mark.usefixtures("trainer_env")
def test_two_grpo_iterations_train_through_the_ledger(trainer_stack: DevStack, model_dir: str) -> None:
    from rollout_ledger.cli.demo import run_rl_demo

    v, started_from = served_version(trainer_stack)
    started_from = started_from or model_dir  # the weights of version v: what the trainer starts from
    seen: dict[str, Any] = {}

    def inspect(stack: DevStack, results: list[dict[str, Any]]) -> None:
        seen["results"] = results
        seen["policy"] = httpx.get(f"{stack.scheduler_url}/v1/policy", timeout=30,
                                   headers={"Authorization": f"Bearer {stack.api_token}"}).json()
        batches = sorted({r["batch_id"] for r in results})
        url = libpq_url(stack.infra.database_url)
        with psycopg.connect(url) as conn:
            seen["versions"] = [r[0] for r in conn.execute(
                "SELECT version FROM policy_versions WHERE version > %s ORDER BY 1", (v,))]
            seen["worker_states"] = conn.execute(
                "SELECT version, worker_id, state FROM policy_worker_states WHERE version > %s ORDER BY 1, 2",
                (v,)).fetchall()
            seen["turn_versions"] = dict(conn.execute(
                "SELECT e.admitted_version, array_agg(DISTINCT t.weight_version ORDER BY t.weight_version) "
                "FROM turns t JOIN episodes e ON e.id = t.episode_id WHERE NOT t.superseded AND e.batch_id = ANY(%s) "
                "GROUP BY 1", (batches,)).fetchall())
            seen["admitted"] = dict(conn.execute(
                "SELECT admitted_version, count(*) FROM episodes WHERE batch_id = ANY(%s) GROUP BY 1",
                (batches,)).fetchall())
            seen["batches"] = conn.execute(
                "SELECT id, max_staleness, episodes_per_version FROM batches WHERE id = ANY(%s)", (batches,)).fetchall()
            seen["audits"] = conn.execute(
                "SELECT batch_id, min_version, max_version, count(*), avg(mean_abs_delta), max(max_abs_delta) "
                "FROM logprob_audits WHERE source = 'trainer' AND batch_id = ANY(%s) GROUP BY 1, 2, 3 ORDER BY 2",
                (batches,)).fetchall()
            seen["audits_per_token"] = conn.execute(  # the rows that keep a logprob for every sampled token
                "SELECT count(*) FROM logprob_audits a JOIN trajectories t ON t.episode_id = a.episode_id "
                "AND t.attempt = a.attempt WHERE a.source = 'trainer' AND a.batch_id = ANY(%s) "
                "AND cardinality(a.token_logprobs) = t.num_sampled_tokens", (batches,)).fetchone()[0]
        if len(results) == 2:
            # the second batch (sampled by version v+1) against the weights the trainer started from (version v)
            # (sample: the whole batch, both iterations: the audit takes only version v+1's 16)
            stale = audit_batch(stack.infra.database_url, results[1]["batch_id"], started_from, sample=32,
                                version=v + 1)
            seen["gap_to_start"] = float(np.mean([r.mean_abs_delta for r in stale.rows])) if stale.rows else None

    console = Console(record=True, width=220, force_terminal=False)
    began = time.monotonic()
    code = run_rl_demo(iterations=2, num_tasks=4, group_size=4, console=console, inspect=inspect,
                       trainer_args=("--max-staleness", "0"), stack=trainer_stack)
    out = console.export_text()
    print(out)
    print(f"closed loop: {time.monotonic() - began:.1f}s")
    assert code == 0, out
    assert f"starting from policy version {v} " in out
    results = seen["results"]
    assert [(r["version"], r["pushed_version"]) for r in results] == [(v, v + 1), (v + 1, v + 2)]
    assert [r["episodes"] for r in results] == [16, 16]
    # versions advance and every worker serves them
    assert seen["versions"] == [v + 1, v + 2]
    policy = seen["policy"]
    assert policy["current"]["version"] == v + 2
    assert policy["workers"] and all(w["serving"] == v + 2 for w in policy["workers"]), policy
    states = {(version, s) for version, _, s in seen["worker_states"]}
    assert (v + 2, "serving") in states and ((v + 1, "serving") in states or (v + 1, "retired") in states), states
    # one batch bounded at admission (k = 0, one iteration's episodes per version): the first 16 episodes start at
    # once on version v, the next 16 wait until every worker serves version v+1 (the trainer's first push)
    (batch,) = seen["batches"]
    assert batch[1:] == (0, 16) and {r["batch_id"] for r in results} == {batch[0]}
    assert "16 admitted now, 16 waiting for the trainer" in out
    assert seen["admitted"] == {v: 16, v + 1: 16}
    # every token of iteration 1 was generated by version v, every token of iteration 2 by version v+1
    assert seen["turn_versions"] == {v: [v], v + 1: [v + 1]}
    assert [r["token_versions"] for r in results] == [[v], [v + 1]]
    assert [r["staleness"] for r in results] == [0, 0]
    # the trainer's audit rows: one per trajectory, on the version that sampled it (all of them: on-policy loop)
    audits = {(batch, lo, hi): (n, mean, worst) for batch, lo, hi, n, mean, worst in seen["audits"]}
    for r in results:
        assert r["on_policy"] == r["trajectories"] == 16, r
    assert audits[(batch[0], v, v)][0] == audits[(batch[0], v + 1, v + 1)][0] == 16
    assert seen["audits_per_token"] == 32  # each keeps its recomputed logprobs, one per sampled token
    # the trainer-vs-vLLM gap on version v+1, which vLLM loaded live from the trainer's checkpoint
    on_next = results[1]
    assert on_next["gap_mean"] < GAP_MEAN_BOUND, on_next
    assert on_next["gap_max"] < GAP_MAX_BOUND, on_next
    # ... while the weights the trainer started from are far from what sampled iteration 2: the engine loaded new
    # weights
    assert seen["gap_to_start"] is not None
    print(f"iteration 2 (version {v + 1}): mean |Δlogprob| {on_next['gap_mean']:.1e} against the trainer's version "
          f"{v + 1}, {seen['gap_to_start']:.1e} against version {v}")
    assert seen["gap_to_start"] > WEIGHTS_MOVED * on_next["gap_mean"], (seen["gap_to_start"], on_next["gap_mean"])
    assert "2/2 iterations: ok" in out
