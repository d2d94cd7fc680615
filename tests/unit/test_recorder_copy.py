"""The recorder's COPY declarations against the schema, and its dumpers (rollout_ledger/services/recorder/adapters.py)
without a server: rows come out in the declared order, numpy-encoded arrays are byte for byte what psycopg writes for
the same list, and values that do not fit their column raise ``EncodeError``."""

from __future__ import annotations

import re
import struct
from datetime import UTC, datetime
from typing import Any

import numpy as np
import psycopg
import pytest
from psycopg.adapt import AdaptersMap, Transformer
from psycopg.pq import Format
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

from rollout_ledger.services.recorder import adapters
from rollout_ledger.services.recorder.adapters import EncodeError
from rollout_ledger.services.recorder.assembly import Trajectory
from rollout_ledger.services.recorder.store import STEPS, TRAJECTORIES, TURNS, CopyTable, EpisodeRow, TrajectoryWrite
from rollout_ledger.shared import db
from rollout_ledger.shared.events import FinishReason, StepCompleted, TurnGenerated
from rollout_ledger.shared.lifecycle import EpisodeStatus

TYPES = psycopg.adapters.types


def _oid(sqla_type: str) -> int:
    """The type oid of a column as SQLAlchemy compiles it (``VARCHAR(256)``, ``INTEGER[][]``, ``FLOAT``...)."""
    name = re.sub(r"\(\d+\)", "", sqla_type).replace("[][]", "[]").lower()
    return TYPES.get_oid({"float": "double precision"}.get(name, name))


@pytest.mark.parametrize(("copy", "table"), [(TURNS, db.turns), (STEPS, db.steps),
                                             (TRAJECTORIES, db.trajectories)], ids=lambda x: getattr(x, "name", ""))
def test_declared_columns_are_the_tables(copy: CopyTable[Any], table: Table) -> None:
    assert copy.name == table.name
    for name, pgtype, _ in copy.columns:
        assert name in table.columns, f"{table.name}.{name} is not a column"
        want = table.columns[name].type.compile(dialect=postgresql.dialect())
        assert TYPES.get_oid(pgtype) == _oid(want), f"{table.name}.{name}: declared {pgtype}, the table has {want}"
    for column in table.columns:
        assert column.name in copy.names or column.server_default is not None, \
            f"{table.name}.{column.name} is neither written by the COPY nor has a server default"


def test_a_swapped_type_fails_the_check() -> None:
    swapped = [(n, {"queue_ms": "int4", "attempt": "float4"}.get(n, t), s) for n, t, s in TURNS.columns]
    with pytest.raises(AssertionError, match=r"turns\.attempt: declared float4"):
        test_declared_columns_are_the_tables(CopyTable("turns", swapped), db.turns)


T = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)


def _turn(**over: Any) -> TurnGenerated:
    fields: dict[str, Any] = dict(
        event_id="b.0.0:a2:t3:r1", episode_id="b.0.0", batch_id="b", attempt=2, seq=7, produced_by="inference/w",
        time=T, request_id="b.0.0:a2:t3:r1", turn_index=3, prompt_len=11, token_ids=np.array([5, 6], "<i4"),
        logprobs=np.array([-0.5, -1.5], "<f4"), finish_reason=FinishReason.LENGTH, weight_version=4, engine="fake",
        worker_id="inf-1", queue_ms=1.25, generate_ms=2.5, cached_tokens=9)
    return TurnGenerated(**(fields | over))


def _step(**over: Any) -> StepCompleted:
    fields: dict[str, Any] = dict(
        event_id="b.0.0:a2:s3", episode_id="b.0.0", batch_id="b", attempt=2, seq=8, produced_by="env/w",
        time=T.replace(tzinfo=None), turn_index=3, turn_event_id="b.0.0:a2:t3:r1", action="act", observation="obs",
        reward=0.5, terminated=True, truncated=False, info={"k": 1}, step_ms=3.5,
        observation_token_ids=np.array([7], "<i4"), drift="assistant_render", new_segment=True)
    return StepCompleted(**(fields | over))


def test_rows_follow_the_declared_columns() -> None:
    e = _turn()
    row = dict(zip(TURNS.names, TURNS.row(e), strict=True))
    assert row == {"event_id": e.event_id, "episode_id": "b.0.0", "attempt": 2, "turn_index": 3, "prompt_len": 11,
                   "token_ids": e.token_ids, "logprobs": e.logprobs, "finish_reason": "length", "weight_version": 4,
                   "engine": "fake", "worker_id": "inf-1", "queue_ms": 1.25, "generate_ms": 2.5, "cached_tokens": 9,
                   "produced_at": T, "version_runs": None}
    s = _step()
    row = dict(zip(STEPS.names, STEPS.row(s), strict=True))
    assert row == {"event_id": s.event_id, "episode_id": "b.0.0", "attempt": 2, "turn_index": 3,
                   "turn_event_id": s.turn_event_id, "action": "act", "observation": "obs",
                   "observation_token_ids": s.observation_token_ids, "reward": 0.5, "terminated": True,
                   "truncated": False, "info": {"k": 1}, "step_ms": 3.5, "drift": "assistant_render",
                   "new_segment": True, "produced_at": T,  # a naive event time is taken as UTC
                   "reused_from": None, "env_state": None}
    traj = Trajectory(token_ids=np.array([1, 2, 3, 4, 5], "<i4"), loss_mask=np.array([0, 1, 1, 0, 1], "<i2"),
                      logprobs=np.array([0, -0.25, -0.5, 0, -1], "<f4"), weight_versions=np.array([-1, 6, 6, -1, 8]),
                      action_ranges=[[1, 3], [4, 5]], prompt_len=1, num_tokens=5, num_sampled_tokens=3, num_turns=2,
                      kept_turn_ids=(), kept_step_ids=(), distinct_weight_versions=[6, 8], step_rewards=[0.0, 1.0],
                      segments=[[0, 4], [4, 5]])
    w = TrajectoryWrite(EpisodeRow("b.0.0", "b", "b.0", "echo", EpisodeStatus.RUNNING, 2, None, T), 2, "completed",
                        None, 1.0, traj, "ok", [{"turn": 1}])
    row = dict(zip(TRAJECTORIES.names, TRAJECTORIES.row(w), strict=True))
    assert row.pop("token_ids_le") == np.array([1, 2, 3, 4, 5], "<i4").tobytes()
    assert row.pop("sampled_logprobs_le") == np.array([-0.25, -0.5, -1], "<f4").tobytes()
    assert row.pop("action_versions").tolist() == [6, 8]
    assert row == {"episode_id": "b.0.0", "episode_created_at": T, "batch_id": "b", "group_id": "b.0", "env": "echo",
                   "attempt": 2,
                   "status": "completed", "failure_class": None, "reward": 1.0, "token_ids": traj.token_ids,
                   "loss_mask": traj.loss_mask, "logprobs": traj.logprobs, "weight_versions": traj.weight_versions,
                   "action_ranges": [[1, 3], [4, 5]], "prompt_len": 1, "num_tokens": 5, "num_sampled_tokens": 3,
                   "num_turns": 2, "segments": [[0, 4], [4, 5]], "num_segments": 2, "token_check": "ok",
                   "drifts": [{"turn": 1}]}


def _dump(pgtype: str, value: Any, ours: bool = True) -> bytes:
    """``value`` as a COPY column of type ``pgtype`` is dumped: with the recorder's adapters, or psycopg's own."""
    amap = AdaptersMap(psycopg.adapters)
    if ours:
        adapters.register(amap)
    tx = Transformer(amap)
    tx.set_dumper_types([TYPES.get_oid(pgtype)], Format.BINARY)
    [out] = tx.dump_sequence([value], [])
    assert out is not None
    return bytes(out)


@pytest.mark.parametrize(("pgtype", "values"), [
    ("int4[]", [0, -1, 2**31 - 1, -(2**31), 49152]),
    ("int4[]", [[3, 5], [9, 12], [0, 1]]),
    ("float4[]", [-0.0, 1.5, -3.25e-8, float("inf"), float("-inf")]),
    ("int2[]", [0, 1, 1, 0]),
])
def test_numpy_arrays_are_what_psycopg_writes(pgtype: str, values: list[Any]) -> None:
    assert _dump(pgtype, np.array(values)) == _dump(pgtype, values, ours=False)
    assert _dump(pgtype, values) == _dump(pgtype, values, ours=False)  # lists go through numpy too


def test_empty_arrays_and_nan() -> None:
    empty_int4 = struct.pack(">iii", 0, 0, 23)
    assert _dump("int4[]", np.zeros(0, "<i4")) == _dump("int4[]", []) == _dump("int4[]", np.zeros((0, 2))) \
        == empty_int4
    assert _dump("float4[]", np.zeros(0, "<f4")) == struct.pack(">iii", 0, 0, 700)
    nan = _dump("float4[]", np.array([np.nan], "<f4"))
    assert np.isnan(np.frombuffer(nan[-4:], ">f4")[0])
    assert np.isnan(struct.unpack(">f", _dump("float4", float("nan")))[0])
    assert _dump("float4", float("-inf")) == struct.pack(">f", float("-inf"))


def test_loaded_arrays_round_trip() -> None:
    ids = np.array([0, -1, 2**31 - 1, 49152], "<i4")
    assert adapters.parse_array(adapters.int4_array(ids), "<i4").tolist() == ids.tolist()
    floats = np.array([-0.0, 1.5, np.inf], "<f4")
    got = adapters.parse_array(adapters.float4_array(floats), "<f4")
    assert got.dtype == np.dtype("<f4") and got.tobytes() == floats.tobytes()
    assert adapters.parse_array(adapters.int4_array([]), "<i4").dtype == np.dtype("<i4")
    assert adapters.Int4Array(ids).data == adapters.int4_array(ids)


def test_scalars_are_psycopgs_where_they_fit() -> None:
    for pgtype, value in (("int4", 2**31 - 1), ("int4", -(2**31)), ("float4", 3.4e38), ("float4", -1.5)):
        assert _dump(pgtype, value) == _dump(pgtype, value, ours=False), (pgtype, value)
    # jsonb: orjson, with non-string keys and numpy values, as the recorder has always written it
    assert _dump("jsonb", {3: [1, np.float32(2.5), None], "k": np.arange(2)}) == b'\x01{"3":[1,2.5,null],"k":[0,1]}'


@pytest.mark.parametrize(("pgtype", "value"), [
    ("int4", 2**31), ("int4", -(2**31) - 1), ("int4", 2**40), ("int4", 1.5),
    ("float4", 1e300), ("float4", -1e39),
    ("jsonb", {"x": b"bytes"}),
    ("int4[]", np.array([2**31], np.int64)), ("int4[]", [[1, 2], [3]]), ("int4[]", np.array([1.5])),
])
def test_values_that_do_not_fit_raise_encode_error(pgtype: str, value: Any) -> None:
    with pytest.raises(EncodeError):
        _dump(pgtype, value)

