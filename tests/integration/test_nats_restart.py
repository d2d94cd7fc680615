"""NATS killed (SIGKILL) and restarted while episodes run: every episode still running keeps its work item, so no
turn is generated twice and no episode is lost (the episode leases of rollout_ledger/services/env_worker/leases.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_ledger.cli.stack.servers import PrivateNats
from rollout_ledger.cli.stack.supervisor import Stack
from tests.helpers import Sql, metric, wait_for
from tests.integration.test_crash import batch, post, wait_done

EPISODES = 24
TURNS = 8


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    """A NATS server of this test's own (the session's server is shared and must not be killed)."""
    server = PrivateNats(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(own_nats: PrivateNats) -> str:
    """The ``stack`` fixture's NATS: this test's own."""
    return own_nats.url


def test_nats_kill_and_restart_generates_no_turn_twice(own_nats: PrivateNats, stack: Stack,
                                                        database_url: str) -> None:
    # 0.4 s per turn, 8 turns: an episode runs > 3 s, so the NATS outage (2 s down, more than the 1.5 s ack wait
    # below) lands while every episode is mid-way; two env workers, so a redelivery can reach the other one.
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.4")
    workers = [stack.start("env-worker", name=f"env-worker-{n}", ROLLOUT_ACK_WAIT_S="1.5") for n in "ab"]
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = post(url, env="fixed-turns", tasks=[{"turns": TURNS}] * EPISODES, group_size=1,
                    max_turns=TURNS, sampling={"max_tokens": 8})
    sql = Sql(database_url)
    try:
        wait_for(lambda: sum(metric(w.url, "rollout_episodes_in_flight") for w in workers) >= EPISODES
                 and sum(metric(w.url, "rollout_turn_latency_seconds_count") for w in workers) >= EPISODES,
                 60, "every episode mid-way")
        own_nats.kill()
        time.sleep(2.0)
        own_nats.start()
        info = wait_done(url, batch_id, 120)
        assert info["counts"] == {**info["counts"], "completed": EPISODES}  # type: ignore[dict-item]
        assert batch(url, batch_id)["done"] is True
        wait_for(lambda: sql.scalar("select count(*) from trajectories where batch_id = :b", b=batch_id)
                 == EPISODES, 60, "every trajectory")
        # every turn generated once: no attempt ran beside another of the same episode
        turns = sql.scalar("select count(*) from turns t join episodes e on e.id = t.episode_id "
                           "where e.batch_id = :b", b=batch_id)
        assert turns == EPISODES * TURNS
        assert sql.scalar("select max(attempt) from episodes where batch_id = :b", b=batch_id) == 1
        fenced = sum(metric(w.url, "rollout_work_items_fenced_total") for w in workers)
        print(f"redeliveries held while their episode ran: {fenced}")
    finally:
        sql.close()
