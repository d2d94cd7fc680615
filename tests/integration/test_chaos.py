"""The chaos benchmark (bench/chaos.py) at CI size: 160 episodes through its own private NATS and Postgres while one
env worker, one inference worker, the recorder and the scheduler are each killed with SIGKILL, NATS is killed and
restarted and Postgres is stopped for 3 s. Nothing may be lost or stored twice, and nothing may be generated twice
but the work the killed env worker had in hand (its episodes run again as new attempts)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from bench.chaos import Chaos, ChaosConfig


def test_chaos_small_loses_nothing_duplicates_nothing(tmp_path: Path) -> None:
    cfg = ChaosConfig(episodes=160, turns=4, kills=1, nats_down_s=2.0, pg_down_s=3.0, gap_s=2.0, fake_delay_s=0.5,
                      concurrency=3, env_workers=2, inference_workers=2, quiesce_timeout_s=120.0, log_level="INFO",
                      keep_logs=str(tmp_path / "logs"))
    result = Chaos(cfg).run()
    print(asdict(result))
    assert result.terminal == 160 and result.lost == 0
    assert result.statuses == {"completed": 160}
    assert result.duplicated == 0
    assert result.turns >= 160 * 4
    # re-generated: only the episodes the killed env worker was running ran again (one new attempt each), and
    # within the attempts kept no turn was generated twice (a NATS restart re-generates nothing)
    assert result.attempts_after_first <= result.cut_by_kills
    assert result.regenerated_by_superseded_attempts <= result.cut_by_kills * cfg.turns
    assert result.regenerated_within_final_attempt / result.turns < 0.005
