"""Recorder COPY benchmark: the same turn, step and trajectory rows COPY'd into Postgres several ways, side by side
in one run (every round runs each way once, in turn: the machine's speed drifts between minutes, not between
neighbouring runs; each way's fastest run counts and the ratio of every round is printed too):

- ``hand-built`` (the baseline): the recorder's encoder until 2026-11-24
(``rollout_ledger/services/recorder/pgbinary.py``, kept
  below as ``_baseline_*``): each COPY row assembled by hand from ``struct`` packs and numpy-encoded arrays, with
  its column order kept apart from the column list, and the payload sent with one ``copy.write``;
- ``psycopg lists``: ``Copy.set_types`` + ``Copy.write_row`` with psycopg's own dumpers only, the arrays handed
  over as Python lists (``ndarray.tolist()``: psycopg 3.3 adapts numpy scalars, not arrays);
- ``write_row + numpy`` (the recorder now): ``set_types`` + ``write_row`` with rows from the store's table
  declarations (``store.TURNS`` / ``STEPS`` / ``TRAJECTORIES``) and the dumpers of
  ``rollout_ledger/services/recorder/adapters.py`` (numpy arrays, range-checked int4 / float4, orjson jsonb); the COPY
  itself is
  ``Tx._copy``, the recorder's own;
- ``... unchecked scalars``: the same with psycopg's C int4 / float4 dumpers, which wrap an int outside int32 and
  make a too-large float infinite without a word (what the checks cost).

Two measures per way: ``encode``, the client's CPU to turn the rows into COPY bytes (no server: psycopg's binary
formatter driven directly, as ``write_row`` drives it), and ``copy``, the COPY into Postgres end to end, committed
(turns and steps into their tables, truncated between runs; trajectories into the recorder's staging table). Both
start from the same objects (events, assembled trajectories): building the rows (and ``tolist()``) is counted. MB/s
is of the baseline's COPY stream, which the recorder's way reproduces byte for byte (checked before the rounds;
psycopg's own jsonb differs in spacing only). A last table prices the read side: binary ``int4[]`` / ``float4[]``
results loaded by the recorder's numpy loaders, or by psycopg's (lists) then made numpy arrays.

Usage (part of ``make bench``; private NATS and Postgres servers are started, as ``rollout up`` does, unless
NATS_URL / DATABASE_URL are set; a given database must have empty ``turns`` and ``steps``, which are truncated):

    python -m bench.recorder_copy               # 5 rounds
    python -m bench.recorder_copy --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import psycopg
from psycopg._copy_base import BinaryFormatter  # what Copy.write_row drives: to time the encoding alone
from psycopg.adapt import AdaptersMap, Transformer
from psycopg.pq import Format
from psycopg.types.numeric import Float4BinaryDumper, Int4BinaryDumper

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.client.source import libpq_url
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.services.recorder import adapters
from rollout_ledger.services.recorder.assembly import Trajectory
from rollout_ledger.services.recorder.store import (
    STEPS,
    TRAJECTORIES,
    TURNS,
    CopyTable,
    EpisodeRow,
    TrajectoryWrite,
    Tx,
)
from rollout_ledger.shared.events import FinishReason, StepCompleted, TurnGenerated
from rollout_ledger.shared.lifecycle import EpisodeStatus

# --- the baseline: rollout_ledger/services/recorder/pgbinary.py as it was (its COPY rows; arrays as in adapters.py) --

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" * 2
_COPY_TRAILER = b"\xff\xff"
_NULL = b"\xff\xff\xff\xff"
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_I4 = struct.Struct(">i")
_ARRAY1_HEADER = struct.Struct(">iiiii")
_ARRAY0_HEADER = struct.Struct(">iii")
_ARRAY2_HEADER = struct.Struct(">iiiiiii")
_PAIR_I4 = np.dtype([("n", ">i4"), ("v", ">i4")])
_PAIR_F4 = np.dtype([("n", ">i4"), ("v", ">f4")])
_PAIR_I2 = np.dtype([("n", ">i4"), ("v", ">i2")])
_I4_FIELD = struct.Struct(">ii")
_F4_FIELD = struct.Struct(">if")
_F8_FIELD = struct.Struct(">id")
_TS_FIELD = struct.Struct(">iq")
_BOOL2 = struct.Struct(">i?i?")
_BOOL = struct.Struct(">i?")
_NCOLS_TURN, _NCOLS_STEP, _NCOLS_TRAJECTORY = struct.pack(">h", 15), struct.pack(">h", 16), struct.pack(">h", 25)


def _baseline_array(values: np.ndarray, oid: int, pair: np.dtype[Any], size: int) -> bytes:
    n = len(values)
    if n == 0:
        return _ARRAY0_HEADER.pack(0, 0, oid)
    body = np.empty(n, pair)
    body["n"] = size
    body["v"] = values
    return _ARRAY1_HEADER.pack(1, 0, oid, n, 1) + body.tobytes()


def _baseline_int4_array(values: np.ndarray) -> bytes:
    arr = np.asarray(values)
    if arr.dtype != np.int32 and arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("int4 array value out of range")
    return _baseline_array(arr, 23, _PAIR_I4, 4)


def _baseline_float4_array(values: np.ndarray) -> bytes:
    return _baseline_array(np.asarray(values, dtype=np.float32), 700, _PAIR_F4, 4)


def _baseline_int2_array(values: np.ndarray) -> bytes:
    return _baseline_array(np.asarray(values, dtype=np.int16), 21, _PAIR_I2, 2)


def _baseline_int4_matrix(rows: Sequence[Sequence[int]], width: int) -> bytes:
    if not rows:
        return _ARRAY0_HEADER.pack(0, 0, 23)
    arr = np.asarray(rows, dtype=np.int64).reshape(len(rows), width)
    if arr.min() < -(2**31) or arr.max() >= 2**31:
        raise ValueError("int4 array value out of range")
    body = np.empty(arr.size, _PAIR_I4)
    body["n"] = 4
    body["v"] = arr.ravel()
    return _ARRAY2_HEADER.pack(2, 0, 23, len(rows), 1, width, 1) + body.tobytes()


def _text(value: str) -> bytes:
    b = value.encode()
    return _I4.pack(len(b)) + b


def _field(b: bytes) -> bytes:
    return _I4.pack(len(b)) + b


def _micros(t: datetime) -> int:
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    d = t - _PG_EPOCH
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def _jsonb(value: Any) -> bytes:
    b = b"\x01" + orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return _I4.pack(len(b)) + b


def _baseline_turn_row(e: TurnGenerated) -> bytes:
    cached = _NULL if e.cached_tokens is None else _I4_FIELD.pack(4, e.cached_tokens)
    return b"".join((
        _NCOLS_TURN, _text(e.event_id), _text(e.episode_id),
        _I4_FIELD.pack(4, e.attempt), _I4_FIELD.pack(4, e.turn_index), _I4_FIELD.pack(4, e.prompt_len),
        _field(_baseline_int4_array(e.token_ids)), _field(_baseline_float4_array(e.logprobs)),
        _text(str(e.finish_reason)), _I4_FIELD.pack(4, e.weight_version), _text(e.engine), _text(e.worker_id),
        _F4_FIELD.pack(4, e.queue_ms), _F4_FIELD.pack(4, e.generate_ms), cached, _TS_FIELD.pack(8, _micros(e.time)),
    ))


def _baseline_step_row(e: StepCompleted) -> bytes:
    return b"".join((
        _NCOLS_STEP, _text(e.event_id), _text(e.episode_id),
        _I4_FIELD.pack(4, e.attempt), _I4_FIELD.pack(4, e.turn_index), _text(e.turn_event_id),
        _text(e.action), _text(e.observation), _field(_baseline_int4_array(e.observation_token_ids)),
        _F8_FIELD.pack(8, e.reward), _BOOL2.pack(1, e.terminated, 1, e.truncated), _jsonb(e.info),
        _F4_FIELD.pack(4, e.step_ms), _NULL if e.drift is None else _text(e.drift), _BOOL.pack(1, e.new_segment),
        _TS_FIELD.pack(8, _micros(e.time)),
    ))


def _baseline_trajectory_row(w: TrajectoryWrite) -> bytes:
    traj = w.traj
    lp = np.asarray(traj.logprobs)
    sampled = np.concatenate([lp[a:b] for a, b in traj.action_ranges]) if traj.action_ranges else lp[:0]
    return b"".join((
        _NCOLS_TRAJECTORY, _text(w.ep.id), _TS_FIELD.pack(8, _micros(w.ep.created_at)), _text(w.ep.batch_id),
        _text(w.ep.group_id), _text(w.ep.env),
        _I4_FIELD.pack(4, w.attempt), _text(w.status), _NULL if w.failure_class is None else _text(w.failure_class),
        _NULL if w.reward is None else _F8_FIELD.pack(8, w.reward),
        _field(_baseline_int4_array(traj.token_ids)), _field(_baseline_int2_array(traj.loss_mask)),
        _field(_baseline_float4_array(traj.logprobs)), _field(_baseline_int4_array(traj.weight_versions)),
        _field(_baseline_int4_matrix(traj.action_ranges, 2)),
        _I4_FIELD.pack(4, traj.prompt_len), _I4_FIELD.pack(4, traj.num_tokens),
        _I4_FIELD.pack(4, traj.num_sampled_tokens), _I4_FIELD.pack(4, traj.num_turns),
        _field(_baseline_int4_matrix(traj.segments, 2)), _I4_FIELD.pack(4, len(traj.segments)),
        _NULL if w.token_check is None else _text(w.token_check), _jsonb(list(w.drifts)),
        _field(np.asarray(traj.token_ids).astype("<i4", copy=False).tobytes()),
        _field(sampled.astype("<f4", copy=False).tobytes()),
        _field(_baseline_int4_array(np.array([traj.weight_versions[a] for a, _ in traj.action_ranges], np.int64))),
    ))


# --- realistic rows ----------------------------------------------------------------------------------------------

TIME = datetime(2026, 11, 24, 10, 0, 0, 123456, tzinfo=UTC)


def turns(n: int, tokens: int) -> list[TurnGenerated]:
    rng = np.random.default_rng(tokens)
    return [TurnGenerated(
        event_id=f"bench.{i // 4}.0:a1:t{i % 4}:r1", episode_id=f"bench.{i // 4}.0", batch_id="bench", attempt=1,
        seq=i, produced_by="inference/bench-0", time=TIME, request_id=f"bench.{i // 4}.0:a1:t{i % 4}:r1",
        turn_index=i % 4, prompt_len=300 + 100 * (i % 4), token_ids=rng.integers(0, 49152, tokens, dtype=np.int32),
        logprobs=np.log(rng.random(tokens, dtype=np.float32) + 1e-6).astype(np.float32),
        finish_reason=FinishReason.STOP, weight_version=7, engine="vllm", worker_id="inference-0",
        queue_ms=0.41, generate_ms=812.5, cached_tokens=256) for i in range(n)]


def steps(n: int, obs_tokens: int = 100) -> list[StepCompleted]:
    rng = np.random.default_rng(1)
    return [StepCompleted(
        event_id=f"bench.{i // 4}.0:a1:s{i % 4}", episode_id=f"bench.{i // 4}.0", batch_id="bench", attempt=1,
        seq=i, produced_by="env/bench-0", time=TIME, turn_index=i % 4, turn_event_id=f"bench.{i // 4}.0:a1:t{i % 4}:r1",
        action="I will call the search tool with the query below.\n" * 12,
        observation='{"results": [{"title": "a page", "snippet": "some text"}]}\n' * 6, reward=0.0,
        terminated=i % 4 == 3, truncated=False, info={"tool": "search", "latency_ms": 12.5, "ok": True},
        step_ms=14.2, observation_token_ids=rng.integers(0, 49152, obs_tokens, dtype=np.int32),
        drift=None, new_segment=False) for i in range(n)]


def trajectories(n: int, prompt: int = 200, num_turns: int = 4, sampled: int = 256, obs: int = 64) -> list[Any]:
    rng = np.random.default_rng(2)
    length = prompt + num_turns * (sampled + obs)
    mask = np.zeros(length, np.int16)
    ranges = []
    for t in range(num_turns):
        a = prompt + t * (sampled + obs)
        ranges.append([a, a + sampled])
        mask[a:a + sampled] = 1
    out = []
    for i in range(n):
        lp = np.where(mask == 1, np.log(rng.random(length) + 1e-6), 0.0).astype(np.float32)
        traj = Trajectory(
            token_ids=rng.integers(0, 49152, length, dtype=np.int32), loss_mask=mask.copy(), logprobs=lp,
            weight_versions=np.where(mask == 1, 7, -1).astype(np.int32), action_ranges=[list(r) for r in ranges],
            prompt_len=prompt, num_tokens=length, num_sampled_tokens=num_turns * sampled, num_turns=num_turns,
            kept_turn_ids=(), kept_step_ids=(), distinct_weight_versions=[7], step_rewards=[0.0] * num_turns,
            segments=[[0, length]])
        ep = EpisodeRow(f"bench.{i}.0", "bench", f"bench.{i}", "search", EpisodeStatus.COMPLETED, 1, None, TIME)
        out.append(TrajectoryWrite(ep=ep, attempt=1, status="completed", failure_class=None, reward=1.0, traj=traj,
                                   token_check="ok", drifts=[]))
    return out


# --- the ways ----------------------------------------------------------------------------------------------------

def _as_lists(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v.tolist() if isinstance(v, np.ndarray) else v for v in row)


class Way:
    """One way of COPYing a table's rows: ``encode`` (client only, bytes out) and ``copy`` (into Postgres)."""

    def __init__(self, name: str, conn: psycopg.AsyncConnection[Any] | None,
                 rows: Callable[[CopyTable[Any], Sequence[Any]], list[Any]]) -> None:
        self.name, self.conn, self.rows = name, conn, rows

    def encode(self, table: CopyTable[Any], objs: Sequence[Any]) -> int:
        """Bytes of the COPY stream of these rows."""
        if self.conn is None:
            return len(b"".join([_COPY_HEADER, *self.rows(table, objs), _COPY_TRAILER]))
        return sum(map(len, _formatted(self, table, objs)))

    async def copy(self, cur: psycopg.AsyncCursor[Any], table: CopyTable[Any], into: str, objs: Sequence[Any]) -> None:
        rows = self.rows(table, objs)
        if self.conn is None:
            async with cur.copy(f"COPY {into} ({table.collist}) FROM STDIN (FORMAT BINARY)") as copy:
                await copy.write(b"".join([_COPY_HEADER, *rows, _COPY_TRAILER]))
        else:
            await Tx._copy(cur, table, into, rows)


def _formatted(way: Way, table: CopyTable[Any], objs: Sequence[Any]) -> list[Any]:
    """The COPY stream of ``write_row`` over these rows, in the chunks psycopg would send."""
    assert way.conn is not None
    tx = Transformer(way.conn)
    tx.set_dumper_types([way.conn.adapters.types.get_oid(t) for t in table.types], Format.BINARY)
    fmt = BinaryFormatter(tx)
    return [*(fmt.write_row(r) for r in way.rows(table, objs)), fmt.end()]


_BASELINE_ROW: dict[str, Callable[[Any], bytes]] = {
    "turns": _baseline_turn_row, "steps": _baseline_step_row, "trajectories": _baseline_trajectory_row}


async def connect(url: str, how: str) -> psycopg.AsyncConnection[Any]:
    conn = await psycopg.AsyncConnection.connect(libpq_url(url))
    if how != "psycopg":
        adapters.register(conn)
    if how == "unchecked":
        conn.adapters.register_dumper(None, Int4BinaryDumper)  # psycopg's C dumpers by type again
        conn.adapters.register_dumper(None, Float4BinaryDumper)
    return conn


async def ways(url: str) -> list[Way]:
    return [
        Way("hand-built (baseline)", None, lambda t, objs: [_BASELINE_ROW[t.name](o) for o in objs]),
        Way("psycopg lists", await connect(url, "psycopg"), lambda t, objs: [_as_lists(t.row(o)) for o in objs]),
        Way("write_row + numpy (now)", await connect(url, "numpy"), lambda t, objs: [t.row(o) for o in objs]),
        Way("... unchecked scalars", await connect(url, "unchecked"), lambda t, objs: [t.row(o) for o in objs]),
    ]


def psycopg_own_scalars() -> str:
    """What psycopg's own C dumpers write for values outside int4 / float4 (why the recorder checks them)."""
    tx = Transformer(AdaptersMap(psycopg.adapters))
    tx.set_dumper_types([psycopg.adapters.types.get_oid("int4"), psycopg.adapters.types.get_oid("float4")],
                        Format.BINARY)
    i4, f4 = tx.dump_sequence([2**32 + 1, 1e300], [])
    assert i4 is not None and f4 is not None
    return (f"psycopg's own dumpers: int4 2**32 + 1 -> {struct.unpack('>i', i4)[0]}, "
            f"float4 1e300 -> {struct.unpack('>f', f4)[0]} (the recorder's raise EncodeError)")


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def seed_episodes(admin: psycopg.AsyncConnection[Any], n: int) -> None:
    """The batch and episode rows the benchmark's turns and steps belong to (``bench.<i>.0``; foreign keys of
    migration 0011: a turn or step of an episode the scheduler never stored is refused)."""
    await admin.execute("INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, "
                        "request_hash) VALUES ('bench', 'bench', 1, 4, '{}'::jsonb, %s, %s, 'x') "
                        "ON CONFLICT DO NOTHING", (n, n))
    await admin.execute("INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task) "
                        "SELECT 'bench.' || i || '.0', 'bench', 'bench.' || i, 0, i, 'bench', '{}'::jsonb "
                        "FROM generate_series(0, %s) AS i ON CONFLICT DO NOTHING", (n,))


async def run(url: str, rounds: int) -> None:
    data: list[tuple[str, CopyTable[Any], Sequence[Any]]] = [
        ("turns, 256 tokens", TURNS, turns(2000, 256)),
        ("turns, 2,000 tokens", TURNS, turns(500, 2000)),
        ("steps, 100 obs tokens", STEPS, steps(2000)),
        ("trajectories, 1,480 tokens", TRAJECTORIES, trajectories(500)),
    ]
    admin = await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True)
    for table in ("turns", "steps"):
        cur = await admin.execute(f"SELECT EXISTS (SELECT 1 FROM {table})")
        row = await cur.fetchone()
        if row is None or row[0]:
            raise SystemExit(f"{table} holds rows: the benchmark truncates it, give it an empty database")
    await seed_episodes(admin, max(len(objs) for _, _, objs in data))
    all_ways = await ways(url)
    results: dict[tuple[str, str, str], list[float]] = {}
    sizes: dict[str, int] = {}
    for label, table, objs in data:
        sizes[label] = all_ways[0].encode(table, objs)
        for w in all_ways[2:]:  # the recorder's rows are the baseline's, byte for byte (psycopg lists: json.dumps)
            got = b"".join(_formatted(w, table, objs))
            assert got == b"".join([_COPY_HEADER, *all_ways[0].rows(table, objs), _COPY_TRAILER]), (w.name, label)
    for _ in range(rounds):
        for label, table, objs in data:
            for w in all_ways:
                t0 = time.perf_counter()
                w.encode(table, objs)
                results.setdefault((label, w.name, "encode"), []).append(time.perf_counter() - t0)
            for w in all_ways:
                conn = w.conn or all_ways[1].conn
                assert conn is not None
                into = "rl_stage_trajectories" if table is TRAJECTORIES else table.name
                if table is not TRAJECTORIES:
                    await admin.execute(f"TRUNCATE {table.name}")

                async def once(conn: psycopg.AsyncConnection[Any] = conn, table: CopyTable[Any] = table,
                               into: str = into, objs: Sequence[Any] = objs, w: Way = w) -> None:
                    async with conn.cursor() as cur:
                        if table is TRAJECTORIES:
                            await cur.execute(
                                "CREATE TEMP TABLE IF NOT EXISTS rl_stage_trajectories ON COMMIT DELETE ROWS AS "
                                f"SELECT {table.collist} FROM trajectories WITH NO DATA")
                        await w.copy(cur, table, into, objs)
                    await conn.commit()

                results.setdefault((label, w.name, "copy"), []).append(await timed(once))
    base = all_ways[0].name
    for measure in ("encode", "copy"):
        what = "client CPU, rows to COPY bytes" if measure == "encode" else "COPY into Postgres, committed"
        print(f"\n{measure}: {what} (fastest of {rounds}; ratio = baseline time / this way's, per round in brackets)")
        print(f"{'rows':<28}{'way':<26}{'rows/s':>10}{'MB/s':>8}{'ratio':>7}   rounds")
        for label, _, objs in data:
            for w in all_ways:
                ts, bs = results[(label, w.name, measure)], results[(label, base, measure)]
                best = min(ts)
                rr = " ".join(f"{b / t:.2f}" for b, t in zip(bs, ts, strict=True))
                print(f"{label:<28}{w.name:<26}{len(objs) / best:>10,.0f}{sizes[label] / best / 1e6:>8.1f}"
                      f"{min(bs) / best:>7.2f}   ({rr})")
    await read_side(admin, url, rounds)
    for w in all_ways:
        if w.conn is not None:
            await w.conn.close()
    await admin.close()


async def read_side(admin: psycopg.AsyncConnection[Any], url: str, rounds: int) -> None:
    """Binary ``int4[]``/``float4[]`` results as numpy arrays: the recorder's loaders against psycopg's lists."""
    await admin.execute("TRUNCATE turns")
    async with await psycopg.AsyncConnection.connect(libpq_url(url)) as conn:
        adapters.register(conn)
        async with conn.cursor() as cur:
            await Tx._copy(cur, TURNS, "turns", [TURNS.row(e) for e in turns(500, 2000)])
        await conn.commit()
    numpy_conn = await psycopg.AsyncConnection.connect(libpq_url(url))
    adapters.register(numpy_conn)
    plain_conn = await psycopg.AsyncConnection.connect(libpq_url(url))

    async def read(conn: psycopg.AsyncConnection[Any], convert: bool) -> None:
        async with conn.cursor(binary=True) as cur:
            await cur.execute("SELECT token_ids, logprobs FROM turns")
            rows = await cur.fetchall()
        if convert:
            [(np.asarray(a, "<i4"), np.asarray(b, "<f4")) for a, b in rows]
        await conn.commit()

    t_np: list[float] = []
    t_pl: list[float] = []
    for _ in range(rounds):
        t_np.append(await timed(lambda: read(numpy_conn, False)))
        t_pl.append(await timed(lambda: read(plain_conn, True)))
    print("\nread: 500 turns of 2,000 tokens, SELECT token_ids, logprobs (binary) to numpy arrays "
          f"(fastest of {rounds})")
    print(f"  numpy loaders (adapters.py): {500 / min(t_np):,.0f} rows/s; psycopg lists + np.asarray: "
          f"{500 / min(t_pl):,.0f} rows/s; ratio {min(t_pl) / min(t_np):.2f} (rounds: "
          + " ".join(f"{p / n:.2f}" for p, n in zip(t_pl, t_np, strict=True)) + ")")
    await numpy_conn.close()
    await plain_conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="runs of each way; the fastest counts (noisy machines)")
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
          f"psycopg {psycopg.__version__} ({psycopg.pq.__impl__}), numpy {np.__version__}")
    print(psycopg_own_scalars())
    with LocalInfra() as infra:
        upgrade(infra.database_url)
        asyncio.run(run(infra.database_url, args.rounds))


if __name__ == "__main__":
    main()
