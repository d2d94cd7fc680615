"""The recorder as a real process (`rollout serve recorder`): SIGKILL mid-stream loses and duplicates nothing,
SIGTERM drains and exits 0."""

from __future__ import annotations

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.kit import bus
from tests.helpers import Sql, metric, until, wait_for
from tests.integration.test_recorder import episode_events, publish, seed_episodes


async def test_sigkill_mid_stream_then_restart_loses_and_duplicates_nothing(stack: Stack, nc: bus.NATS,
                                                                           database_url: str) -> None:
    sql = Sql(database_url)
    try:
        eps = seed_episodes(sql, "kill", num_tasks=40)
        turns = [([10 + i, 11], [2, 50, 1]) for i in range(3)]
        rec = stack.start("recorder", name="recorder-1", ROLLOUT_BATCH_SIZE="8", ROLLOUT_FETCH_TIMEOUT_S="0.2")
        await publish(nc, [ev for e in eps[:20] for ev in episode_events(e, turns)])
        wait_for(lambda: sql.scalar("select count(*) from turns") >= 10, 30, "recorder writing")
        rec.kill()
        await publish(nc, [ev for e in eps[20:] for ev in episode_events(e, turns)])
        rec2 = stack.start("recorder", name="recorder-2", ROLLOUT_ACK_WAIT_S="2")
        await until(lambda: sql.scalar("select count(*) from trajectories") == 40, 60, "all trajectories")
        wait_for(lambda: metric(rec2.url, "rollout_recorder_pending") == 0, 20, "nothing pending")
        assert sql.scalar("select count(*) from turns") == 40 * 3
        assert sql.scalar("select count(*) from steps") == 40 * 3
        assert sql.scalar("select count(*) from episodes where status = 'completed'") == 40
        assert sql.scalar("select count(*) from turns where superseded") == 0
        assert sql.scalar("select count(*) from dead_letters") == 0
        lengths = {r["num_tokens"] for r in sql.rows("select num_tokens from trajectories")}
        assert lengths == {8 + 3 * 5}
        assert rec2.stop() == 0  # SIGTERM: drain and exit 0
        assert '"recorder.drained"' in rec2.log_path.read_text()
    finally:
        sql.close()
