"""The capacity benchmark's measurement (bench/capacity.py) at CI size: its counts add up on a real stack.

A small run (40 episodes of 4 turns, one of each service, its own private NATS and Postgres) checks what the
sizing tables rest on: every event and work item counted once, the tokens the shape asks for, CPU and bytes found
for every part, and each table's growth (partitioned or not) seen.
"""

from __future__ import annotations

import pytest

from bench.capacity import PG_TABLES, SERVERS, SERVICES, Assumptions, Figures, Shape, measure, sizing


def test_a_small_capacity_run_adds_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)  # the run reads the private servers' monitoring and stats
    monkeypatch.delenv("DATABASE_URL", raising=False)
    shape = Shape(episodes=40, turns=4, prompt_tokens=600, sampled_tokens=16, in_flight=8)
    # 8 episodes in flight at 50-150 ms a turn: a couple of seconds of turns, so the window is not one recorder batch
    run = measure(1, shape, fake_delay_s=0.05, timeout_s=120)
    turns = shape.episodes * shape.turns

    tokens = run["tokens"]
    assert tokens["turns"] == turns
    assert tokens["sampled"] == turns * shape.sampled_tokens  # min_tokens = max_tokens: exactly that many a turn
    assert 500 <= tokens["prompt"] / shape.episodes <= 700  # the random-word topic lands near the asked size
    assert tokens["stored"] > tokens["prompt"] + tokens["sampled"]  # plus observation and template ids
    assert tokens["input_tokens_sent"] > tokens["prompt"] * shape.turns  # every turn sends its whole context

    nats = run["nats"]
    # per episode: EpisodeStarted, a TurnGenerated and a StepCompleted per turn, EpisodeFinished
    assert nats["events_msgs"] == shape.episodes * (2 + 2 * shape.turns)
    assert nats["work_items"] == shape.episodes
    assert nats["work_bytes_per_episode"] > 4 * 600 / 3  # the task carries its prompt text
    assert nats["wire_bytes_per_turn"] > nats["events_bytes_per_turn"] > 0

    pg = run["postgres"]
    for table in ("turns", "steps", "trajectories", "episodes"):
        assert pg["bytes_by_table"][table] > 0, table
    assert set(pg["bytes_by_table"]) == set(PG_TABLES)
    assert pg["bytes_per_turn"] == pytest.approx(sum(pg["bytes_by_table"].values()) / turns, abs=0.1)
    assert pg["wal_bytes_per_turn_whole_run"] > 0

    assert 0 < run["window"]["turns"] <= turns
    whole = run["cpu_ms_per_turn_whole_run"]
    for kind in ("env-worker", "inference-worker", "recorder", *SERVERS):
        assert whole[kind] > 0, kind
    assert set(whole) == {*SERVICES, *SERVERS}

    # the model takes the run as it is stored
    row = sizing(Figures.from_run(run), 64, Assumptions(turns_per_gpu_s=1.0))
    assert row.pg_gb_per_day == pytest.approx(64 * pg["bytes_per_turn"] * 86_400 / 1e9)
