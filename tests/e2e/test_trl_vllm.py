"""The real, pinned TRL trains from the ledger (issue 26, part 2): ``rollout demo --trl`` runs TRL's
``GRPOTrainer`` (examples/trl/train.py, fed by ``rollout_ledger.client.adapters.trl``) against a stack of its own on
vLLM for two optimizer steps, on-policy. Versions advance 0 -> 1 -> 2 and every inference worker serves them; step
2's episodes were sampled by version 1 (step 1's weights), every token of them; TRL's importance-sampling correction
ran on the ledger's stored logprobs, and its own recomputation agrees with them (the gap TRL logs is float32 noise,
on weights vLLM loaded live from TRL's checkpoint).

The stack has NATS and Postgres of its own (private servers), never the session's (the e2e package's in-process
vLLM worker follows the policy announcements on the session NATS and would load the trainer's checkpoints too).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psycopg
import pytest
from rich.console import Console

from rollout_ledger.client.source import libpq_url
from tests.e2e.conftest import require_vllm

if TYPE_CHECKING:
    from rollout_ledger.cli.stack.devstack import DevStack

pytestmark = pytest.mark.e2e

GAP_BOUND = 1e-3
"""TRL's ``sampling/sampling_logp_difference/mean`` (mean |TRL's logprob - the ledger's stored logprob| over the
sampled tokens), float32 on both sides; the e2e closed loop measures ~5e-6 for the same pair."""


def test_trl_trains_two_steps_from_the_ledger(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import trl  # the pinned extra (make install has it): missing, the test fails

    from rollout_ledger.cli.demo import run_trl_demo
    from rollout_ledger.cli.modelstore import fetch

    assert trl.__version__ == "1.16.0"
    require_vllm()
    fetch(Path(model_dir), with_weights=True)
    for name in ("NATS_URL", "DATABASE_URL"):  # private servers of its own (module docstring)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROLLOUT_MODEL", model_dir)
    seen: dict[str, Any] = {}

    def inspect(stack: DevStack, results: list[dict[str, Any]]) -> None:
        seen["results"] = results
        seen["policy"] = httpx.get(f"{stack.scheduler_url}/v1/policy", timeout=30,
                                   headers={"Authorization": f"Bearer {stack.api_token}"}).json()
        with psycopg.connect(libpq_url(stack.infra.database_url)) as conn:
            seen["versions"] = [r[0] for r in conn.execute("SELECT version FROM policy_versions ORDER BY 1")]
            seen["batch_versions"] = conn.execute(
                "SELECT e.batch_id, array_agg(DISTINCT t.weight_version ORDER BY t.weight_version), "
                "count(DISTINCT e.id) FROM turns t JOIN episodes e ON e.id = t.episode_id WHERE NOT t.superseded "
                "GROUP BY 1 ORDER BY 1").fetchall()
            seen["delivered"] = conn.execute(
                "SELECT consumer, delivered FROM export_cursors WHERE consumer LIKE 'trl-%'").fetchall()

    console = Console(record=True, width=220, force_terminal=False)
    began = time.monotonic()
    code = run_trl_demo(steps=2, num_tasks=4, group_size=4, console=console, inspect=inspect)
    out = console.export_text()
    print(out)
    print(f"TRL on the ledger: {time.monotonic() - began:.1f}s")
    assert code == 0, out
    assert "2/2 steps: ok" in out
    results = seen["results"]
    assert [(r["step"], r["published"], r["groups"]) for r in results] == [(1, 1, 4), (2, 2, 4)], results
    assert all(r["mean_reward"] is not None and r["sampled_tokens"] > 0 for r in results), results
    # TRL's importance-sampling correction ran on the ledger's logprobs, and agrees with them on the version that
    # sampled them (TRL holds those weights when it recomputes: on-policy)
    for r in results:
        gap = r["trl"]["sampling/sampling_logp_difference/mean"]
        assert gap < GAP_BOUND, r
        assert 0.5 < r["trl"]["sampling/importance_sampling_ratio/mean"] < 2.0, r
    # versions advance and every worker serves the last
    assert seen["versions"] == [1, 2]
    policy = seen["policy"]
    assert policy["current"]["version"] == 2
    assert policy["workers"] and all(w["serving"] == 2 for w in policy["workers"]), policy
    # two batches, one per step: step 1 sampled by version 0, step 2 by version 1 (step 1's weights), every token
    batches = seen["batch_versions"]
    assert [(versions, n) for _, versions, n in batches] == [([0], 16), ([1], 16)], batches
    # each trajectory delivered once through the adapter's consumer
    assert [d for _, d in seen["delivered"]] == [32]


def test_trl_asynchronous_the_ledger_generates_ahead_within_max_staleness(model_dir: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--max-staleness 1``: one batch for the run, bounded at admission; each step reads exactly its groups, every
    episode trained once; the next step's groups are generated while TRL trains (admitted one version ahead), and
    TRL's importance-sampling correction weighs what is stale."""
    from rollout_ledger.cli.demo import run_trl_demo
    from rollout_ledger.cli.modelstore import fetch

    require_vllm()
    fetch(Path(model_dir), with_weights=True)
    for name in ("NATS_URL", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROLLOUT_MODEL", model_dir)
    seen: dict[str, Any] = {}

    def inspect(stack: DevStack, results: list[dict[str, Any]]) -> None:
        seen["results"] = results
        with psycopg.connect(libpq_url(stack.infra.database_url)) as conn:
            seen["batches"] = conn.execute("SELECT id, max_staleness, episodes_per_version FROM batches").fetchall()
            seen["versions"] = dict(conn.execute(
                "SELECT episode_id, array_agg(DISTINCT weight_version ORDER BY weight_version) FROM turns "
                "WHERE NOT superseded GROUP BY 1").fetchall())
            seen["episode_admitted"] = dict(conn.execute("SELECT id, admitted_version FROM episodes").fetchall())
            seen["admitted"] = dict(conn.execute(
                "SELECT admitted_version, count(*) FROM episodes GROUP BY 1").fetchall())

    console = Console(record=True, width=220, force_terminal=False)
    code = run_trl_demo(steps=3, num_tasks=2, group_size=4, console=console, inspect=inspect,
                        trainer_args=("--max-staleness", "1"))
    out = console.export_text()
    print(out)
    assert code == 0, out
    (batch,) = seen["batches"]
    assert batch[1:] == (1, 8), "one batch for the run: max_staleness 1, one step's episodes per version"
    results = seen["results"]
    assert [(r["step"], r["published"], r["groups"]) for r in results] == [(1, 1, 2), (2, 2, 2), (3, 3, 2)]
    taken = [e for r in results for e in r["episodes"]]
    assert len(taken) == len(set(taken)) == 24, "each step its own groups, every episode trained once"
    # generating ahead, bounded at admission: two steps' episodes (k + 1 versions' worth) started on version 0,
    # before TRL had trained anything; one step's more on version 1; nothing waits for version 2
    assert seen["admitted"] == {0: 16, 1: 8}, seen["admitted"]
    for r in results:
        holds = r["step"] - 1  # the version TRL holds while it trains step s (it publishes s after)
        for episode in r["episodes"]:
            versions = seen["versions"][episode]
            # sampled after its admission, and before TRL read it (so by no version TRL had not published yet)
            assert seen["episode_admitted"][episode] <= min(versions) and max(versions) <= holds, (r, versions)
