"""The recorder's SQL: one transaction per batch, bulk COPY of turns and steps, episode and trajectory writes.

``Store.transaction()`` opens a transaction on a pooled connection and hands out a ``Tx`` whose methods are the
only SQL the recorder runs. Driver errors are translated into ``StoreError`` at this boundary: connection loss,
server restarts, deadlocks and serialisation failures are ``retryable``; data and integrity errors are not.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import psycopg
import sqlalchemy.exc
from psycopg.types.json import Jsonb
from sqlalchemy.ext.asyncio import AsyncEngine

from rollout_ledger.shared.db import check_schema
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.events import StepCompleted, TurnGenerated
from rollout_ledger.shared.lifecycle import TERMINAL, EpisodeStatus, allowed_sources

from .assembly import StepRecord, Trajectory, TurnRecord

TERMINAL_STATUSES = sorted(str(s) for s in TERMINAL)

_TURN_COLS = ("event_id", "episode_id", "attempt", "turn_index", "prompt_len", "token_ids", "logprobs",
              "finish_reason", "weight_version", "engine", "worker_id", "queue_ms", "generate_ms", "cached_tokens",
              "produced_at")
_TURN_TYPES = ("text", "text", "int4", "int4", "int4", "int4[]", "float4[]", "text", "int4", "text", "text",
               "float4", "float4", "int4", "timestamptz")
_STEP_COLS = ("event_id", "episode_id", "attempt", "turn_index", "turn_event_id", "action", "observation",
              "observation_token_ids", "reward", "terminated", "truncated", "info", "step_ms", "produced_at")
_STEP_TYPES = ("text", "text", "int4", "int4", "text", "text", "text", "int4[]", "float8", "bool", "bool", "jsonb",
               "float4", "timestamptz")


def classify(exc: BaseException) -> StoreError:
    """A ``StoreError`` for a driver/pool error, retryable unless the server rejected the data itself."""
    orig: BaseException = exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
        orig = exc.orig
    retryable = isinstance(orig, (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError,
                                  sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError))
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        retryable = True
    return StoreError(f"{type(orig).__name__}: {str(orig).strip()[:500]}", retryable=retryable)


@dataclass(frozen=True)
class EpisodeRow:
    """The episode columns the terminal rules look at (row locked FOR UPDATE)."""

    id: str
    batch_id: str
    group_id: str
    env: str
    status: EpisodeStatus
    attempt: int
    prompt_token_ids: np.ndarray | None


@dataclass(frozen=True)
class DeadLetter:
    """A message the recorder gave up on, with why."""

    source: str
    subject: str
    stream_seq: int | None
    reason: str
    payload: bytes
    headers: dict[str, str] | None


class Tx:
    """SQL of one open transaction (a psycopg connection inside a SQLAlchemy transaction)."""

    def __init__(self, pg: psycopg.AsyncConnection[Any]) -> None:
        self.pg = pg

    async def add_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        async with self.pg.cursor() as cur:
            await cur.executemany(
                "INSERT INTO dead_letters (source, subject, stream_seq, reason, payload, headers) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (source, stream_seq) DO NOTHING",
                [(d.source, d.subject, d.stream_seq, d.reason, d.payload,
                  Jsonb(d.headers) if d.headers is not None else None) for d in letters],
            )

    async def dead_letter_payload(self, source: str, stream_seq: int) -> bytes | None:
        async with self.pg.cursor() as cur:
            await cur.execute("SELECT payload FROM dead_letters WHERE source = %s AND stream_seq = %s",
                              (source, stream_seq))
            row = await cur.fetchone()
        return bytes(row[0]) if row else None

    async def apply_started(self, rows: Sequence[dict[str, Any]]) -> None:
        """Episodes -> running for each started attempt not older than the episode's (rows in stream order)."""
        if not rows:
            return
        sources = allowed_sources(EpisodeStatus.RUNNING)
        async with self.pg.cursor() as cur:
            await cur.executemany(
                "UPDATE episodes SET status = 'running', attempt = %(attempt)s, worker_id = %(worker_id)s, "
                "started_at = %(time)s, prompt_token_ids = %(prompt)s::int4[], prompt_text = %(prompt_text)s, "
                "updated_at = now() "
                "WHERE id = %(episode_id)s AND status = ANY(%(sources)s) AND attempt <= %(attempt)s",
                [dict(r, sources=sources) for r in rows],
            )

    async def _copy_upsert(self, table: str, cols: Sequence[str], types: Sequence[str],
                           rows: Iterable[Sequence[Any]]) -> None:
        stage = f"rl_stage_{table}"
        collist = ", ".join(cols)
        async with self.pg.cursor() as cur:
            await cur.execute(
                f"CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
                f"SELECT {collist} FROM {table} WITH NO DATA"
            )
            async with cur.copy(f"COPY {stage} ({collist}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(list(types))
                for row in rows:
                    await copy.write_row(row)
            await cur.execute(f"INSERT INTO {table} ({collist}) SELECT {collist} FROM {stage} "
                              "ON CONFLICT (event_id) DO NOTHING")
            await cur.execute(f"DELETE FROM {stage}")

    async def insert_turns(self, events: Sequence[TurnGenerated]) -> None:
        if events:
            await self._copy_upsert("turns", _TURN_COLS, _TURN_TYPES, (
                (e.event_id, e.episode_id, e.attempt, e.turn_index, e.prompt_len, e.token_ids.tolist(),
                 e.logprobs.tolist(), str(e.finish_reason), e.weight_version, e.engine, e.worker_id, e.queue_ms,
                 e.generate_ms, e.cached_tokens, e.time) for e in events))

    async def insert_steps(self, events: Sequence[StepCompleted]) -> None:
        if events:
            await self._copy_upsert("steps", _STEP_COLS, _STEP_TYPES, (
                (e.event_id, e.episode_id, e.attempt, e.turn_index, e.turn_event_id, e.action, e.observation,
                 e.observation_token_ids.tolist(), e.reward, e.terminated, e.truncated, Jsonb(e.info), e.step_ms,
                 e.time) for e in events))

    async def lock_episode(self, episode_id: str) -> EpisodeRow | None:
        async with self.pg.cursor() as cur:
            await cur.execute(
                "SELECT id, batch_id, group_id, env, status, attempt, prompt_token_ids FROM episodes "
                "WHERE id = %s FOR UPDATE", (episode_id,))
            row = await cur.fetchone()
        if row is None:
            return None
        prompt = None if row[6] is None else np.asarray(row[6], dtype="<i4")
        return EpisodeRow(row[0], row[1], row[2], row[3], EpisodeStatus(row[4]), int(row[5]), prompt)

    async def trajectory_attempt(self, episode_id: str) -> int | None:
        async with self.pg.cursor() as cur:
            await cur.execute("SELECT attempt FROM trajectories WHERE episode_id = %s", (episode_id,))
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def attempt_records(self, episode_id: str, attempt: int,
                              num_turns: int) -> tuple[list[StepRecord], dict[str, TurnRecord]]:
        """Steps of turns ``< num_turns`` of one attempt, and the turns they name."""
        async with self.pg.cursor() as cur:
            await cur.execute(
                "SELECT s.event_id, s.turn_index, s.turn_event_id, s.observation_token_ids, s.reward, "
                "t.event_id, t.turn_index, t.prompt_len, t.token_ids, t.logprobs, t.weight_version "
                "FROM steps s LEFT JOIN turns t ON t.event_id = s.turn_event_id AND t.episode_id = s.episode_id "
                "WHERE s.episode_id = %s AND s.attempt = %s AND s.turn_index < %s ORDER BY s.turn_index",
                (episode_id, attempt, num_turns))
            rows = await cur.fetchall()
        steps: list[StepRecord] = []
        turns: dict[str, TurnRecord] = {}
        for r in rows:
            steps.append(StepRecord(r[0], int(r[1]), r[2], np.asarray(r[3], dtype="<i4"), float(r[4])))
            if r[5] is not None:
                turns[r[5]] = TurnRecord(r[5], int(r[6]), int(r[7]), np.asarray(r[8], dtype="<i4"),
                                         np.asarray(r[9], dtype="<f4"), int(r[10]))
        return steps, turns

    async def upsert_trajectory(self, ep: EpisodeRow, attempt: int, status: str, failure_class: str | None,
                                reward: float | None, traj: Trajectory) -> bool:
        """Insert the trajectory; replace an existing one only from a higher attempt. True when written."""
        async with self.pg.cursor() as cur:
            await cur.execute(
                "INSERT INTO trajectories (episode_id, batch_id, group_id, env, attempt, status, failure_class, "
                "reward, token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
                "num_sampled_tokens, num_turns) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s::int4[], %s::int2[], "
                "%s::float4[], %s::int4[], %s::int4[], %s, %s, %s, %s) "
                "ON CONFLICT (episode_id) DO UPDATE SET attempt = excluded.attempt, status = excluded.status, "
                "failure_class = excluded.failure_class, reward = excluded.reward, token_ids = excluded.token_ids, "
                "loss_mask = excluded.loss_mask, logprobs = excluded.logprobs, "
                "weight_versions = excluded.weight_versions, action_ranges = excluded.action_ranges, "
                "prompt_len = excluded.prompt_len, num_tokens = excluded.num_tokens, "
                "num_sampled_tokens = excluded.num_sampled_tokens, num_turns = excluded.num_turns, created_at = now() "
                "WHERE trajectories.attempt < excluded.attempt",
                (ep.id, ep.batch_id, ep.group_id, ep.env, attempt, status, failure_class, reward,
                 traj.token_ids.tolist(), traj.loss_mask.tolist(), traj.logprobs.tolist(),
                 traj.weight_versions.tolist(), traj.action_ranges, traj.prompt_len, traj.num_tokens,
                 traj.num_sampled_tokens, traj.num_turns))
            return cur.rowcount > 0

    async def finish_episode(self, episode_id: str, *, status: EpisodeStatus, attempt: int, time: datetime,
                             reward: float | None = None, num_turns: int | None = None, stop_reason: str | None = None,
                             failure_class: str | None = None, failure_reason: str | None = None,
                             weight_versions: list[int] | None = None) -> bool:
        """Move the episode to a terminal status through the lifecycle table; True when the row changed."""
        async with self.pg.cursor() as cur:
            await cur.execute(
                "UPDATE episodes SET status = %(status)s, attempt = GREATEST(attempt, %(attempt)s), "
                "reward = %(reward)s, num_turns = %(num_turns)s, stop_reason = %(stop_reason)s, "
                "failure_class = %(failure_class)s, failure_reason = %(failure_reason)s, "
                "weight_versions = %(weight_versions)s::int4[], finished_at = %(time)s, updated_at = now() "
                "WHERE id = %(id)s AND status = ANY(%(sources)s) AND attempt <= %(attempt)s",
                {"status": str(status), "attempt": attempt, "reward": reward, "num_turns": num_turns,
                 "stop_reason": stop_reason, "failure_class": failure_class, "failure_reason": failure_reason,
                 "weight_versions": weight_versions, "time": time, "id": episode_id,
                 "sources": allowed_sources(status)})
            return cur.rowcount > 0

    async def reconcile_superseded(self, episode_ids: Sequence[str]) -> None:
        """Set ``superseded`` on every turn and step of these episodes from the current state.

        With a trajectory: kept = the trajectory attempt's steps of turns < num_turns and the turns they name.
        Without one: rows of attempts other than the episode's latest are superseded (older ones always, newer
        ones once the episode is terminal: an attempt the lifecycle did not let start).
        """
        if not episode_ids:
            return
        ids = sorted(set(episode_ids))
        async with self.pg.cursor() as cur:
            await cur.execute(
                "UPDATE steps s SET superseded = x.want FROM ("
                " SELECT s2.event_id, CASE WHEN tr.episode_id IS NOT NULL"
                "   THEN NOT (s2.attempt = tr.attempt AND s2.turn_index < tr.num_turns)"
                "   ELSE (s2.attempt < e.attempt OR (e.status = ANY(%(terminal)s) AND s2.attempt > e.attempt)) END"
                "   AS want"
                " FROM steps s2 JOIN episodes e ON e.id = s2.episode_id"
                " LEFT JOIN trajectories tr ON tr.episode_id = s2.episode_id"
                " WHERE s2.episode_id = ANY(%(ids)s)) x "
                "WHERE s.event_id = x.event_id AND s.superseded IS DISTINCT FROM x.want",
                {"ids": ids, "terminal": TERMINAL_STATUSES})
            await cur.execute(
                "UPDATE turns t SET superseded = x.want FROM ("
                " SELECT t2.event_id, CASE WHEN tr.episode_id IS NOT NULL"
                "   THEN NOT EXISTS (SELECT 1 FROM steps k WHERE k.episode_id = t2.episode_id"
                "     AND k.turn_event_id = t2.event_id AND k.attempt = tr.attempt AND k.turn_index < tr.num_turns)"
                "   ELSE (t2.attempt < e.attempt OR (e.status = ANY(%(terminal)s) AND t2.attempt > e.attempt)) END"
                "   AS want"
                " FROM turns t2 JOIN episodes e ON e.id = t2.episode_id"
                " LEFT JOIN trajectories tr ON tr.episode_id = t2.episode_id"
                " WHERE t2.episode_id = ANY(%(ids)s)) x "
                "WHERE t.event_id = x.event_id AND t.superseded IS DISTINCT FROM x.want",
                {"ids": ids, "terminal": TERMINAL_STATUSES})


class Store:
    """The recorder's Postgres: schema check, and transactions that translate driver errors to ``StoreError``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def check(self) -> None:
        """Raise ``StoreError`` when unreachable, ``SchemaVersionError`` when not at the code's revision."""
        await check_schema(self.engine)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """A ``Tx`` committed when the block exits normally, rolled back when it raises."""
        try:
            async with self.engine.begin() as conn:
                raw = await conn.get_raw_connection()
                pg = raw.driver_connection
                if pg is None:
                    raise StoreError("no driver connection", retryable=True)
                yield Tx(pg)
        except StoreError:
            raise
        except (sqlalchemy.exc.SQLAlchemyError, psycopg.Error, OSError) as exc:
            raise classify(exc) from exc

    async def dispose(self) -> None:
        await self.engine.dispose()
