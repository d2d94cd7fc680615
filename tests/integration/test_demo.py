"""`rollout demo` end to end on the fake engine (the real-model demo is `make demo`; the engine has its e2e suite)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from rollout_ledger.cli.demo import demo_batches, run_demo


def test_demo_runs_mixed_batch_and_prints_summary(tmp_path: Path, model_dir: str) -> None:
    console = Console(record=True, width=200, force_terminal=False)
    code = run_demo(num_tasks=2, group_size=2, out=tmp_path / "exports", engine="fake", console=console)
    out = console.export_text()
    assert code == 0, out
    envs = [batch.env for batch, _ in demo_batches(2)]
    assert envs == ["arithmetic", "guess-number", "retail-orders", "tau2:retail", "rg:basic_arithmetic"]
    for env in envs:
        assert env in out
    assert "20/20 trajectories stored: ok" in out  # 2x2 + 2x2 + 1x2 + 1x2 + 4x2
    assert "prefix cache hit rate" in out and "tok/s end to end" in out
    assert len(list((tmp_path / "exports").glob("*.jsonl"))) == 5
    assert "select env, status" in out  # the example SQL
    assert out.count("/viewer/#/batch/") == 5 and "rollout demo --stay" in out  # a viewer link per batch
