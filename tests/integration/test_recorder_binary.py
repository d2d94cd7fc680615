"""The recorder's hand-built binary encoding (services/recorder/pgbinary.py) against real Postgres: every column
of a COPY'd turn and step reads back exactly, arrays round-trip both ways, and bad values raise ``EncodeError``."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import psycopg
import pytest

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.recorder import pgbinary
from rollout_ledger.services.recorder.store import _STEP_COLS, _TURN_COLS
from rollout_ledger.shared.events import FinishReason, StepCompleted, TurnGenerated


def _conninfo(database_url: str) -> str:
    return sync_url(database_url).replace("postgresql+psycopg://", "postgresql://")


def _turn(i: int, ids: list[int], cached: int | None) -> TurnGenerated:
    return TurnGenerated(
        event_id=f"b.0.0:a1:t{i}:r1", episode_id="b.0.0", batch_id="b", attempt=1, seq=2 * i + 1,
        produced_by="inference/w", time=datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC), request_id=f"r{i}",
        turn_index=i, prompt_len=10 + i, token_ids=np.array(ids, dtype="<i4"),
        logprobs=np.array([-0.5 * k - 1e-7 for k in range(len(ids))], dtype="<f4"), finish_reason=FinishReason.LENGTH,
        weight_version=-3, engine="fake", worker_id="inf-ü", queue_ms=1.25, generate_ms=0.0, cached_tokens=cached)


def _step(i: int, obs: list[int]) -> StepCompleted:
    return StepCompleted(
        event_id=f"b.0.0:a1:s{i}", episode_id="b.0.0", batch_id="b", attempt=1, seq=2 * i + 2,
        produced_by="env/w", time=datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), turn_index=i,
        turn_event_id=f"b.0.0:a1:t{i}:r1", action="héllo\n\"x\"", observation="", reward=-1.5e-3,
        terminated=i == 1, truncated=False, info={"k": [1, 2.5, None], "nested": {"ok": True}, "3": "x"},
        step_ms=2.5, observation_token_ids=np.array(obs, dtype="<i4"), drift="assistant_render" if i == 0 else None,
        new_segment=i == 0)


def test_copied_turns_and_steps_read_back_exactly(database_url: str) -> None:
    turns = [_turn(0, [5, 2**31 - 1, -(2**31), 0], 7), _turn(1, [], None)]
    steps = [_step(0, [1, 2, 3]), _step(1, [])]
    with psycopg.connect(_conninfo(database_url)) as conn, conn.cursor() as cur:
        for table, cols, rows in (("turns", _TURN_COLS, [pgbinary.turn_row(t) for t in turns]),
                                  ("steps", _STEP_COLS, [pgbinary.step_row(s) for s in steps])):
            with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(b"".join([pgbinary.COPY_HEADER, *rows, pgbinary.COPY_TRAILER]))
        cur.execute(f"SELECT {', '.join(_TURN_COLS)} FROM turns ORDER BY turn_index")
        got_turns = cur.fetchall()
        cur.execute(f"SELECT {', '.join(_STEP_COLS)} FROM steps ORDER BY turn_index")
        got_steps = cur.fetchall()
    for t, row in zip(turns, got_turns, strict=True):
        assert row[:6] + row[7:] == (t.event_id, t.episode_id, 1, t.turn_index, t.prompt_len, t.token_ids.tolist(),
                                     "length", -3, "fake", "inf-ü", 1.25, 0.0, t.cached_tokens, t.time)
        assert np.asarray(row[6], dtype="<f4").tobytes() == t.logprobs.tobytes()
    for s, row in zip(steps, got_steps, strict=True):
        assert row == (s.event_id, s.episode_id, 1, s.turn_index, s.turn_event_id, s.action, s.observation,
                       s.observation_token_ids.tolist(), s.reward, s.terminated, s.truncated,
                       s.info, 2.5, s.drift, s.new_segment, s.time)


def test_array_parameters_and_results_round_trip(database_url: str) -> None:
    ids = np.array([0, -1, 2**31 - 1, 49152], dtype="<i4")
    floats = np.array([-0.0, 1.5, -3.25e-8, np.inf], dtype="<f4")
    with psycopg.connect(_conninfo(database_url)) as conn:
        pgbinary.register(conn)
        with conn.cursor(binary=True) as cur:
            cur.execute("SELECT %b, %b, %b::text, %b::text, %b::text, %b::text, %b",
                        (pgbinary.Int4Array(pgbinary.int4_array(ids)),
                         pgbinary.Float4Array(pgbinary.float4_array(floats)),
                         pgbinary.Int2Array(pgbinary.int2_array(np.array([0, 1, 1], dtype="<i2"))),
                         pgbinary.Int4Matrix(pgbinary.int4_matrix([[3, 5], [9, 12]], 2)),
                         pgbinary.Int4Matrix(pgbinary.int4_matrix([], 2)),
                         pgbinary.Int4Array(pgbinary.int4_array(np.zeros(0, dtype="<i4"))),
                         pgbinary.Int4Array(pgbinary.int4_array(np.zeros(0, dtype="<i4")))))
            row = cur.fetchone()
    assert row is not None
    assert row[0].dtype == np.dtype("<i4") and row[0].tolist() == ids.tolist()
    assert row[1].dtype == np.dtype("<f4") and row[1].tobytes() == floats.tobytes()
    assert row[2:6] == ("{0,1,1}", "{{3,5},{9,12}}", "{}", "{}")
    assert row[6].dtype == np.dtype("<i4") and row[6].size == 0


def test_values_that_do_not_fit_raise_encode_error() -> None:
    with pytest.raises(pgbinary.EncodeError):
        pgbinary.int4_array(np.array([2**31], dtype=np.int64))
    with pytest.raises(pgbinary.EncodeError):
        pgbinary.turn_row(_turn(0, [1], 2**40))
    with pytest.raises(pgbinary.EncodeError):
        pgbinary.step_row(_step(0, []).model_copy(update={"info": {"x": b"bytes"}}))
