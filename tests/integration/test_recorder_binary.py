"""The recorder's binary COPY (rollout_ledger/services/recorder/store.py declarations,
rollout_ledger/services/recorder/adapters.py dumpers) against real Postgres: every column of a COPY'd turn and step
reads back exactly, arrays round-trip both ways, and a value that does not fit makes a non-retryable ``StoreError`` (the
batch is then replayed one by one)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import psycopg
import pytest

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.recorder import adapters
from rollout_ledger.services.recorder.store import STEPS, TURNS, CopyTable, Tx
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.events import FinishReason, StepCompleted, TurnGenerated


def _conninfo(database_url: str) -> str:
    return sync_url(database_url).replace("postgresql+psycopg://", "postgresql://")


def _turn(i: int, ids: list[int], cached: int | None, runs: list[tuple[int, int]] | None = None) -> TurnGenerated:
    return TurnGenerated(
        event_id=f"b.0.0:a1:t{i}:r1", episode_id="b.0.0", batch_id="b", attempt=1, seq=2 * i + 1,
        produced_by="inference/w", time=datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC), request_id=f"r{i}",
        turn_index=i, prompt_len=10 + i, token_ids=np.array(ids, dtype="<i4"),
        logprobs=np.array([-0.5 * k - 1e-7 for k in range(len(ids))], dtype="<f4"), finish_reason=FinishReason.LENGTH,
        weight_version=-3, engine="fake", worker_id="inf-ü", queue_ms=1.25, generate_ms=0.0, cached_tokens=cached,
        version_runs=runs)


def _step(i: int, obs: list[int], reused_from: str | None = None, env_state: Any = None) -> StepCompleted:
    return StepCompleted(
        event_id=f"b.0.0:a1:s{i}", episode_id="b.0.0", batch_id="b", attempt=1, seq=2 * i + 2,
        produced_by="env/w", time=datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), turn_index=i,
        turn_event_id=f"b.0.0:a1:t{i}:r1", action="héllo\n\"x\"", observation="", reward=-1.5e-3,
        terminated=i == 1, truncated=False, info={"k": [1, 2.5, None], "nested": {"ok": True}, "3": "x"},
        step_ms=2.5, observation_token_ids=np.array(obs, dtype="<i4"), drift="assistant_render" if i == 0 else None,
        new_segment=i == 0, reused_from=reused_from, env_state=env_state)


async def _connect(database_url: str) -> psycopg.AsyncConnection[Any]:
    """A connection with the recorder's adapters, on a database holding the episode ``b.0.0`` (turns and steps
    reference their episode, migration 0011: the scheduler stores it before any event)."""
    conn = await psycopg.AsyncConnection.connect(_conninfo(database_url))
    adapters.register(conn)
    await conn.execute("INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                       "request_hash) VALUES ('b', 'echo', 1, 4, '{}'::jsonb, 1, 1, 'x') ON CONFLICT DO NOTHING")
    await conn.execute("INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task) "
                       "VALUES ('b.0.0', 'b', 'b.0', 0, 0, 'echo', '{}'::jsonb) ON CONFLICT DO NOTHING")
    await conn.commit()
    return conn


async def test_copied_turns_and_steps_read_back_exactly(database_url: str) -> None:
    # turn 0 straddles a keep swap (two version runs); step 0 carries a snapshot state, step 1 a turn carried over
    turns = [_turn(0, [5, 2**31 - 1, -(2**31), 0], 7, runs=[(0, -3), (2, 5)]), _turn(1, [], None)]
    steps = [_step(0, [1, 2, 3], env_state={"state": {"left": 3}, "observation": [{"role": "user", "content": "x"}]}),
             _step(1, [], reused_from="b.0.0:a0:s1")]
    async with await _connect(database_url) as conn:
        tx = Tx(conn)
        await tx.insert_turns(turns)
        await tx.insert_steps(steps)
        await tx.insert_turns(turns[:1])  # a redelivery: the staging table + ON CONFLICT path, nothing added
        await conn.commit()
        async with conn.cursor() as cur:
            await cur.execute(f"SELECT {TURNS.collist} FROM turns ORDER BY turn_index")
            got_turns = await cur.fetchall()
            await cur.execute(f"SELECT {STEPS.collist} FROM steps ORDER BY turn_index")
            got_steps = await cur.fetchall()
    for t, row in zip(turns, got_turns, strict=True):
        runs = [list(r) for r in t.version_runs] if t.version_runs else None
        assert row[:6] + row[7:] == (t.event_id, t.episode_id, 1, t.turn_index, t.prompt_len, t.token_ids.tolist(),
                                     "length", -3, "fake", "inf-ü", 1.25, 0.0, t.cached_tokens, t.time, runs)
        assert np.asarray(row[6], dtype="<f4").tobytes() == t.logprobs.tobytes()
    for s, row in zip(steps, got_steps, strict=True):
        assert row == (s.event_id, s.episode_id, 1, s.turn_index, s.turn_event_id, s.action, s.observation,
                       s.observation_token_ids.tolist(), s.reward, s.terminated, s.truncated,
                       s.info, 2.5, s.drift, s.new_segment, s.time, s.reused_from, s.env_state)


_ARRAYS: CopyTable[Any] = CopyTable("arrays", (
    ("ids", "int4[]", "ids"), ("floats", "float4[]", "floats"), ("mask", "int2[]", "mask"),
    ("ranges", "int4[]", "ranges"), ("no_ranges", "int4[]", "no_ranges"), ("no_ids", "int4[]", "no_ids")))


async def test_array_columns_parameters_and_results_round_trip(database_url: str) -> None:
    a = SimpleNamespace(ids=np.array([0, -1, 2**31 - 1, 49152], dtype="<i4"),
                        floats=np.array([-0.0, 1.5, -3.25e-8, np.inf], dtype="<f4"), mask=np.array([0, 1, 1], "<i2"),
                        ranges=[[3, 5], [9, 12]], no_ranges=[], no_ids=np.zeros(0, dtype="<i4"))
    async with await _connect(database_url) as conn, conn.cursor(binary=True) as cur:
        await cur.execute("CREATE TEMP TABLE arrays (ids int4[], floats float4[], mask int2[], ranges int4[], "
                          "no_ranges int4[], no_ids int4[])")
        await Tx._copy(cur, _ARRAYS, "arrays", [_ARRAYS.row(a)])
        await cur.execute("SELECT ids, floats, mask::text, ranges::text, no_ranges::text, no_ids::text, no_ids, "
                          "%b, %b::text FROM arrays", (adapters.Int4Array(a.ids), adapters.Int4Array([])))
        row = await cur.fetchone()
    assert row is not None
    assert row[0].dtype == np.dtype("<i4") and row[0].tolist() == a.ids.tolist()
    assert row[1].dtype == np.dtype("<f4") and row[1].tobytes() == a.floats.tobytes()
    assert row[2:6] == ("{0,1,1}", "{{3,5},{9,12}}", "{}", "{}")
    assert row[6].dtype == np.dtype("<i4") and row[6].size == 0
    assert row[7].dtype == np.dtype("<i4") and row[7].tolist() == a.ids.tolist()
    assert row[8] == "{}"


def test_values_that_do_not_fit_raise_encode_error() -> None:
    with pytest.raises(adapters.EncodeError):
        adapters.int4_array(np.array([2**31], dtype=np.int64))
    with pytest.raises(adapters.EncodeError):
        adapters.Int4Array(np.array([-(2**31) - 1], dtype=np.int64))


@pytest.mark.parametrize("bad", [
    _turn(0, [1], 2**40),
    _turn(0, [1], None).model_copy(update={"queue_ms": 1e300}),
    _turn(0, [1], None).model_copy(update={"worker_id": "w\udc80"}),
    _step(0, []).model_copy(update={"info": {"x": b"bytes"}}),
], ids=["int4", "float4", "surrogate", "json"])
async def test_a_value_that_does_not_fit_is_a_non_retryable_store_error(database_url: str, bad: Any) -> None:
    async with await _connect(database_url) as conn:
        tx = Tx(conn)
        good = _turn(1, [1, 2], None)
        with pytest.raises(StoreError, match=f"cannot encode .*{bad.event_id}") as err:
            if isinstance(bad, TurnGenerated):
                await tx.insert_turns([good, bad])
            else:
                await tx.insert_steps([bad])
        assert not err.value.retryable
        await conn.rollback()
        await tx.insert_turns([good])  # the connection goes on after the rollback
        await conn.commit()
        async with conn.cursor() as cur:
            await cur.execute("SELECT event_id FROM turns")
            assert await cur.fetchall() == [(good.event_id,)]
