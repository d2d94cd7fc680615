"""The chaos benchmark (bench/chaos.py) on a three-node JetStream cluster at CI size: 90 episodes through real service
processes while the node leading the work stream is killed with SIGKILL (restarted 2 s later), then the events
stream's leader (another node), then all three nodes are restarted one by one with SIGTERM. Every service must ride
out each election: nothing lost, nothing stored twice, every episode completed, no attempt run twice; the longest
stall (no turn recorded, no episode ended, while episodes were outstanding) is printed and bounded. A failure says
what the services logged during the longest stall, or about each episode that ran a second attempt
(bench/chaos_logs.py)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from bench.chaos import Chaos, ChaosConfig
from bench.chaos_logs import episode_report, stall_report


def test_chaos_cluster_rides_out_node_kills_and_a_rolling_restart(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    cfg = ChaosConfig(episodes=90, turns=4, nats_cluster=3, nats_down_s=2.0, gap_s=1.5, fake_delay_s=0.3,
                      concurrency=3, env_workers=2, inference_workers=2, quiesce_timeout_s=120.0, log_level="INFO",
                      keep_logs=str(logs))
    result = Chaos(cfg).run()
    print(asdict(result))
    print(f"longest stall {result.longest_stall_s} s; per fault: {result.stalls}")
    assert len(result.faults) == 5, result.faults  # two node kills, three restarts of the rolling restart
    assert result.terminal == 90 and result.lost == 0
    assert result.statuses == {"completed": 90}
    assert result.duplicated == 0
    assert result.turns >= 90 * 4
    # no episode failed over to a new attempt once it had begun: the elections were ridden out, not restarted
    # around. A work item lost on its way to a worker with a node (SIGKILL) is delivered again after the ack wait as
    # attempt 2 (the attempt counts deliveries); it starts from nothing recorded, so nothing is resumed or redone.
    reruns = "\n".join(episode_report(logs, e) for e in result.rerun)
    assert result.attempts_after_started == 0, reruns
    assert result.regenerated_by_superseded_attempts == 0 and result.recorded_turns_generated_again == 0, reruns
    # an election takes ~5 s (NATS's raft); a stall of 30 s is a request that waited for its timeout instead
    assert result.longest_stall_s < 20.0, f"{result.stalls}\n{stall_report(logs)}"
