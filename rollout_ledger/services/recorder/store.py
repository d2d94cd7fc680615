"""The recorder's SQL: one transaction per batch, bulk COPY of turns and steps, episode and trajectory writes.

Each table written by binary COPY is declared once (``CopyTable``: every column with its Postgres type and where its
value comes from, in order); the COPY column list, psycopg's ``Copy.set_types`` and each ``write_row`` tuple all
come from that declaration. Arrays go through the numpy dumpers of ``adapters`` (registered on every connection).
Turns and steps are COPY'd straight into their tables inside a savepoint and only a duplicate event id (a
redelivery or replay) takes the staging table + ``ON CONFLICT DO NOTHING`` path (on ``(event_id, produced_at)``:
both tables are partitioned by the event's ``produced_at``, which a redelivery repeats).

``Store.transaction()`` opens a transaction on a pooled connection and hands out a ``Tx`` whose methods are the
only SQL the recorder runs. Driver errors are translated into ``StoreError`` at this boundary: connection loss,
server restarts, a server turned read-only (its connection is dropped: the retry reconnects through the multi-host
DSN to the new primary), deadlocks and serialisation failures are ``retryable``; data and integrity errors are not.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import numpy as np
import psycopg
import sqlalchemy.exc
from psycopg.types.json import Jsonb
from sqlalchemy.ext.asyncio import AsyncEngine

from rollout_ledger.shared.db import check_schema, stale_connection
from rollout_ledger.shared.errors import StoreError
from rollout_ledger.shared.events import EpisodeStarted, StepCompleted, TurnGenerated
from rollout_ledger.shared.lifecycle import TERMINAL, EpisodeStatus, allowed_sources

from . import adapters
from .adapters import EncodeError
from .assembly import StepRecord, Trajectory, TurnRecord

TERMINAL_STATUSES = sorted(str(s) for s in TERMINAL)

_T = TypeVar("_T")


class CopyTable(Generic[_T]):
    """A table written by binary COPY: its columns in order, each ``(name, Postgres type, source)``, where the
    source is an attribute path of the object a row is made from (``"ep.id"``) or a function of it.

    The one place that says which column gets which value and how psycopg encodes it (``Copy.set_types``), so
    two columns cannot be swapped in one place and not the other. ``tests/unit/test_recorder_copy.py`` checks
    the names and types against ``shared/db.py``.
    """

    def __init__(self, name: str, columns: Sequence[tuple[str, str, str | Callable[[_T], Any]]]) -> None:
        self.name = name
        self.columns = tuple(columns)
        self.names = tuple(c[0] for c in self.columns)
        self.types = tuple(c[1] for c in self.columns)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"{name}: a column declared twice")
        self._get = tuple(operator.attrgetter(src) if isinstance(src, str) else src for _, _, src in self.columns)

    @property
    def collist(self) -> str:
        return ", ".join(self.names)

    def row(self, obj: _T) -> tuple[Any, ...]:
        """The values of one row, in column order."""
        return tuple([get(obj) for get in self._get])


def _runs(value: Any) -> tuple[tuple[int, int], ...] | None:
    """``turns.version_runs`` as stored (jsonb) -> ((start, version), ...), or None."""
    if not value:
        return None
    return tuple((int(a), int(b)) for a, b in value)


def _utc(t: datetime) -> datetime:
    """``timestamptz`` value of an event time (a naive time is taken as UTC)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


TURNS: CopyTable[TurnGenerated] = CopyTable("turns", (
    ("event_id", "varchar", "event_id"),
    ("episode_id", "varchar", "episode_id"),
    ("attempt", "int4", "attempt"),
    ("turn_index", "int4", "turn_index"),
    ("prompt_len", "int4", "prompt_len"),
    ("token_ids", "int4[]", "token_ids"),
    ("logprobs", "float4[]", "logprobs"),
    ("finish_reason", "varchar", lambda e: str(e.finish_reason)),
    ("weight_version", "int4", "weight_version"),
    ("engine", "varchar", "engine"),
    ("worker_id", "text", "worker_id"),
    ("queue_ms", "float4", "queue_ms"),
    ("generate_ms", "float4", "generate_ms"),
    ("cached_tokens", "int4", "cached_tokens"),
    ("produced_at", "timestamptz", lambda e: _utc(e.time)),
    ("version_runs", "jsonb", lambda e: None if e.version_runs is None else [list(r) for r in e.version_runs]),
))

STEPS: CopyTable[StepCompleted] = CopyTable("steps", (
    ("event_id", "varchar", "event_id"),
    ("episode_id", "varchar", "episode_id"),
    ("attempt", "int4", "attempt"),
    ("turn_index", "int4", "turn_index"),
    ("turn_event_id", "varchar", "turn_event_id"),
    ("action", "text", "action"),
    ("observation", "text", "observation"),
    ("observation_token_ids", "int4[]", "observation_token_ids"),
    ("reward", "float8", "reward"),
    ("terminated", "bool", "terminated"),
    ("truncated", "bool", "truncated"),
    ("info", "jsonb", "info"),
    ("step_ms", "float4", "step_ms"),
    ("drift", "varchar", "drift"),
    ("new_segment", "bool", "new_segment"),
    ("produced_at", "timestamptz", lambda e: _utc(e.time)),
    ("reused_from", "varchar", "reused_from"),
    ("env_state", "jsonb", "env_state"),
))


def classify(exc: BaseException) -> StoreError:
    """A ``StoreError`` for a driver/pool error, retryable unless the server rejected the data itself."""
    orig: BaseException = exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
        orig = exc.orig
    retryable = isinstance(orig, (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError,
                                  sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError))
    if (isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated) or stale_connection(orig):
        retryable = True  # a new connection (the multi-host DSN's writable host) can take the write
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
    created_at: datetime
    """When the scheduler stored it: its trajectory's partition key (``trajectories.episode_created_at``)."""


@dataclass(frozen=True)
class EpisodeOwner:
    """What the recorder checks an event against before writing a row for it: the episode's stored batch."""

    batch_id: str
    batch_cancelled: bool
    """The scheduler stamped the batch's ``cancelled_at`` (the only authority for ``episode.cancelled``)."""


@dataclass(frozen=True)
class DeadLetter:
    """A message the recorder gave up on, with why."""

    source: str
    subject: str
    stream_seq: int | None
    reason: str
    payload: bytes
    headers: dict[str, str] | None


@dataclass(frozen=True)
class Finish:
    """One terminal status write of ``Tx.finish_episodes`` (through the lifecycle table)."""

    episode_id: str
    status: EpisodeStatus
    attempt: int
    time: datetime
    reward: float | None = None
    num_turns: int | None = None
    stop_reason: str | None = None
    failure_class: str | None = None
    failure_reason: str | None = None
    weight_versions: list[int] | None = None


@dataclass(frozen=True)
class AttemptFailure:
    """One row of ``attempt_failures``: a failed attempt, its class and reason, and whether another followed."""

    event_id: str
    """The ``EpisodeFailed`` event (or ``{event id}:recorder`` for a failure the recorder decided)."""
    episode_id: str
    batch_id: str
    attempt: int
    failure_class: str
    reason: str
    retried: bool
    produced_at: datetime


@dataclass(frozen=True)
class TrajectoryWrite:
    """One trajectory upsert of ``Tx.upsert_trajectories``."""

    ep: EpisodeRow
    attempt: int
    status: str
    failure_class: str | None
    reward: float | None
    traj: Trajectory
    token_check: str | None = None
    """``ok`` / ``mismatch`` as the env worker checked it (``EpisodeFinished.info``); None when not checked."""
    drifts: list[dict[str, Any]] = field(default_factory=list)


def _action_versions(w: TrajectoryWrite) -> np.ndarray:
    return np.array([w.traj.weight_versions[a] for a, _ in w.traj.action_ranges], np.int64)


def _sampled_logprobs_le(w: TrajectoryWrite) -> bytes:
    """The logprobs of the sampled tokens (the action ranges, in order) packed little-endian (migration 0008)."""
    lp, ranges = np.asarray(w.traj.logprobs), w.traj.action_ranges
    return (np.concatenate([lp[a:b] for a, b in ranges]) if len(ranges) else lp[:0]).astype("<f4", copy=False).tobytes()


TRAJECTORIES: CopyTable[TrajectoryWrite] = CopyTable("trajectories", (
    ("episode_id", "varchar", "ep.id"),
    ("episode_created_at", "timestamptz", "ep.created_at"),
    ("batch_id", "varchar", "ep.batch_id"),
    ("group_id", "varchar", "ep.group_id"),
    ("env", "varchar", "ep.env"),
    ("attempt", "int4", "attempt"),
    ("status", "varchar", "status"),
    ("failure_class", "varchar", "failure_class"),
    ("reward", "float8", "reward"),
    ("token_ids", "int4[]", "traj.token_ids"),
    ("loss_mask", "int2[]", "traj.loss_mask"),
    ("logprobs", "float4[]", "traj.logprobs"),
    ("weight_versions", "int4[]", "traj.weight_versions"),
    ("action_ranges", "int4[]", "traj.action_ranges"),  # 2-d
    ("prompt_len", "int4", "traj.prompt_len"),
    ("num_tokens", "int4", "traj.num_tokens"),
    ("num_sampled_tokens", "int4", "traj.num_sampled_tokens"),
    ("num_turns", "int4", "traj.num_turns"),
    ("segments", "int4[]", "traj.segments"),  # 2-d
    ("num_segments", "int4", lambda w: len(w.traj.segments)),
    ("token_check", "varchar", "token_check"),
    ("drifts", "jsonb", lambda w: list(w.drifts)),
    ("token_ids_le", "bytea", lambda w: np.asarray(w.traj.token_ids).astype("<i4", copy=False).tobytes()),
    ("sampled_logprobs_le", "bytea", _sampled_logprobs_le),
    ("action_versions", "int4[]", _action_versions),
))

_TRAJECTORY_KEPT = ("episode_id", "episode_created_at", "batch_id", "group_id", "env")
"""Columns an existing trajectory keeps when a higher attempt replaces it (every other one is replaced)."""

_UPSERT_TRAJECTORIES = (  # the key carries the partition key (migration 0018; 0017's unique index before it)
    f"INSERT INTO trajectories ({TRAJECTORIES.collist}) SELECT {TRAJECTORIES.collist} FROM rl_stage_trajectories "
    "ON CONFLICT (episode_id, episode_created_at) DO UPDATE SET "
    + "".join(f"{c} = excluded.{c}, " for c in TRAJECTORIES.names if c not in _TRAJECTORY_KEPT)
    + "created_at = now() WHERE trajectories.attempt < excluded.attempt"
)

_FINISH_EPISODES = (
    "UPDATE episodes e SET status = f.status, attempt = GREATEST(e.attempt, f.attempt), reward = f.reward, "
    "num_turns = f.num_turns, stop_reason = f.stop_reason, failure_class = f.failure_class, "
    "failure_reason = f.failure_reason, weight_versions = f.weight_versions::int4[], finished_at = f.time, "
    "updated_at = now() "
    "FROM unnest(%s::text[], %s::text[], %s::int4[], %s::float8[], %s::int4[], %s::text[], %s::text[], "
    "%s::text[], %s::text[], %s::timestamptz[], %s::text[]) AS f(id, status, attempt, reward, num_turns, "
    "stop_reason, failure_class, failure_reason, weight_versions, time, sources) "
    "WHERE e.id = f.id AND e.status = ANY(f.sources::text[]) AND e.attempt <= f.attempt"
)


def _pg_text(value: str) -> str:
    """``value`` as Postgres text and jsonb take it: NUL and lone surrogates (hostile subjects, headers, or reasons
    quoting them) escaped as ``\\x00`` / ``\\udc80``, so a dead letter can always be stored."""
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _int4_literal(values: Sequence[int] | None) -> str | None:
    """``int4[]`` text literal of a short list (``None`` stays NULL)."""
    return None if values is None else "{" + ",".join(str(int(v)) for v in values) + "}"


def _text_literal(values: Sequence[str]) -> str:
    """``text[]`` literal of simple words (lifecycle status names: no quoting needed)."""
    return "{" + ",".join(values) + "}"


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
                [(d.source, _pg_text(d.subject), d.stream_seq, _pg_text(d.reason), d.payload,
                  Jsonb({_pg_text(str(k)): _pg_text(str(v)) for k, v in d.headers.items()})
                  if d.headers is not None else None) for d in letters],
            )

    async def add_attempt_failures(self, rows: Sequence[AttemptFailure]) -> Counter[tuple[str, bool]]:
        """One row per failed attempt; a replayed event (same ``event_id``) adds nothing. Returns the rows this call
        inserted, counted by (failure class, retried): what ``rollout_attempt_failures`` counts."""
        inserted: Counter[tuple[str, bool]] = Counter()
        if not rows:
            return inserted
        async with self.pg.cursor() as cur:
            await cur.executemany(
                "INSERT INTO attempt_failures (event_id, episode_id, batch_id, attempt, failure_class, reason, "
                "retried, produced_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (event_id) DO NOTHING "
                "RETURNING failure_class, retried",
                [(r.event_id, r.episode_id, r.batch_id, r.attempt, r.failure_class, r.reason, r.retried,
                  r.produced_at) for r in rows],
                returning=True,
            )
            while True:
                for failure_class, retried in await cur.fetchall():
                    inserted[(str(failure_class), bool(retried))] += 1
                if not cur.nextset():
                    break
        return inserted

    async def dead_letter_payload(self, source: str, stream_seq: int, subject: str) -> bytes | None:
        async with self.pg.cursor() as cur:
            await cur.execute("SELECT payload FROM dead_letters WHERE source = %s AND stream_seq = %s AND subject = %s",
                              (source, stream_seq, subject))
            row = await cur.fetchone()
        return bytes(row[0]) if row else None

    async def apply_started(self, events: Sequence[EpisodeStarted]) -> None:
        """Episodes -> running for each started attempt not older than the episode's (events in stream order)."""
        if not events:
            return
        sources = allowed_sources(EpisodeStatus.RUNNING)
        try:
            params = [(e.attempt, e.worker_id, e.time, adapters.Int4Array(e.prompt_token_ids),
                       e.prompt_text, e.episode_id, sources, e.attempt) for e in events]
        except EncodeError as exc:
            raise StoreError(f"cannot encode episode.started: {exc}", retryable=False) from exc
        async with self.pg.cursor() as cur:
            await cur.executemany(
                "UPDATE episodes SET status = 'running', attempt = %s, worker_id = %s, "
                "started_at = %s, prompt_token_ids = %b, prompt_text = %s, updated_at = now(), "
                "published_at = COALESCE(published_at, now()) "  # it started: it was published (store.mark_published)
                "WHERE id = %s AND status = ANY(%s) AND attempt <= %s",
                params,
            )
            resumes = [(e.episode_id, e.attempt, e.batch_id, str(e.resume.mode), e.resume.from_attempt,
                        e.resume.turns_recorded, e.resume.turns_reused, e.resume.turns_unstepped,
                        _pg_text(e.resume.reason)[:2000], e.time) for e in events if e.resume is not None]
            if resumes:
                await cur.executemany(
                    "INSERT INTO attempt_resumes (episode_id, attempt, batch_id, mode, from_attempt, turns_recorded, "
                    "turns_reused, turns_unstepped, reason, produced_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, "
                    "%s) ON CONFLICT (episode_id, attempt) DO NOTHING", resumes)

    @staticmethod
    async def _copy(cur: psycopg.AsyncCursor[Any], table: CopyTable[Any], into: str,
                    rows: Iterable[tuple[Any, ...]]) -> None:
        """Binary COPY of ``rows`` (``table``'s columns) into ``into``; a value that cannot be encoded raises
        ``EncodeError`` naming the row's first column (its key) and aborts the COPY."""
        async with cur.copy(f"COPY {into} ({table.collist}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(table.types)
            for row in rows:
                try:
                    await copy.write_row(row)
                except (EncodeError, UnicodeError) as exc:  # UnicodeError: a str that is not UTF-8 (surrogates)
                    raise EncodeError(f"{table.name} {row[0]}: {exc}") from exc

    async def _copy_rows(self, table: CopyTable[_T], objs: Sequence[_T], what: str) -> None:
        """COPY straight into ``table`` inside a savepoint; on a duplicate event id, stage + ``ON CONFLICT``."""
        rows = [table.row(o) for o in objs]
        try:
            async with self.pg.cursor() as cur:
                await cur.execute("SAVEPOINT rl_copy")
                try:
                    await self._copy(cur, table, table.name, rows)
                except psycopg.errors.UniqueViolation:
                    # A redelivered or replayed event: write the new rows only (rare, so the slower path is fine).
                    await cur.execute("ROLLBACK TO SAVEPOINT rl_copy")
                    await self._copy_upsert(cur, table, rows)
                await cur.execute("RELEASE SAVEPOINT rl_copy")
        except EncodeError as exc:
            raise StoreError(f"cannot encode {what}: {exc}", retryable=False) from exc

    @classmethod
    async def _copy_upsert(cls, cur: psycopg.AsyncCursor[Any], table: CopyTable[Any],
                           rows: Sequence[tuple[Any, ...]]) -> None:
        stage, collist = f"rl_stage_{table.name}", table.collist
        await cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
            f"SELECT {collist} FROM {table.name} WITH NO DATA"
        )
        await cls._copy(cur, table, stage, rows)
        # the key includes the partition key (migration 0016): a redelivered event has the same produced_at
        await cur.execute(f"INSERT INTO {table.name} ({collist}) SELECT {collist} FROM {stage} "
                          "ON CONFLICT (event_id, produced_at) DO NOTHING")
        await cur.execute(f"DELETE FROM {stage}")

    async def insert_turns(self, events: Sequence[TurnGenerated]) -> None:
        if events:
            await self._copy_rows(TURNS, events, "turn.generated")

    async def insert_steps(self, events: Sequence[StepCompleted]) -> None:
        if events:
            await self._copy_rows(STEPS, events, "step.completed")

    async def episode_owners(self, episode_ids: Sequence[str]) -> dict[str, EpisodeOwner]:
        """Which of these episodes the scheduler stored: each one's batch and whether that batch is cancelled."""
        if not episode_ids:
            return {}
        async with self.pg.cursor() as cur:
            await cur.execute(
                "SELECT e.id, e.batch_id, b.cancelled_at IS NOT NULL FROM episodes e "
                "JOIN batches b ON b.id = e.batch_id WHERE e.id = ANY(%s)", (sorted(set(episode_ids)),))
            rows = await cur.fetchall()
        return {r[0]: EpisodeOwner(r[1], bool(r[2])) for r in rows}

    async def lock_episodes(self, episode_ids: Sequence[str]) -> dict[str, EpisodeRow]:
        """The episode rows of these ids, locked FOR NO KEY UPDATE in id order, so concurrent recorders never
        deadlock: no key is updated, and the weaker lock leaves the foreign-key checks of turn and step inserts
        (FOR KEY SHARE of their episode) unblocked; FOR UPDATE would make them a second lock order."""
        if not episode_ids:
            return {}
        async with self.pg.cursor(binary=True) as cur:
            await cur.execute(
                "SELECT id, batch_id, group_id, env, status, attempt, prompt_token_ids, created_at FROM episodes "
                "WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE", (sorted(set(episode_ids)),))
            rows = await cur.fetchall()
        return {r[0]: EpisodeRow(r[0], r[1], r[2], r[3], EpisodeStatus(r[4]), int(r[5]), r[6], r[7]) for r in rows}

    async def attempt_records(
        self, wanted: Sequence[tuple[str, int, int]]
    ) -> dict[str, tuple[list[StepRecord], dict[str, TurnRecord]]]:
        """For each (episode, attempt, num_turns): steps of turns ``< num_turns`` of that attempt, and the turns
        they name (one query for all; each episode at most once)."""
        out: dict[str, tuple[list[StepRecord], dict[str, TurnRecord]]] = {eid: ([], {}) for eid, _, _ in wanted}
        if not wanted:
            return out
        async with self.pg.cursor(binary=True) as cur:
            await cur.execute(
                "SELECT s.episode_id, s.event_id, s.turn_index, s.turn_event_id, s.observation_token_ids, s.reward, "
                "t.event_id, t.turn_index, t.prompt_len, t.token_ids, t.logprobs, t.weight_version, s.new_segment, "
                "t.version_runs "
                "FROM unnest(%s::text[], %s::int4[], %s::int4[]) AS q(eid, att, n) "
                "JOIN steps s ON s.episode_id = q.eid AND s.attempt = q.att AND s.turn_index < q.n "
                "LEFT JOIN turns t ON t.event_id = s.turn_event_id AND t.episode_id = s.episode_id "
                "ORDER BY s.episode_id, s.turn_index",
                ([w[0] for w in wanted], [w[1] for w in wanted], [w[2] for w in wanted]))
            rows = await cur.fetchall()
        for r in rows:
            steps, turns = out[r[0]]
            steps.append(StepRecord(r[1], int(r[2]), r[3], r[4], float(r[5]), new_segment=bool(r[12])))
            if r[6] is not None:
                turns[r[6]] = TurnRecord(r[6], int(r[7]), int(r[8]), r[9], r[10], int(r[11]),
                                         version_runs=_runs(r[13]))
        return out

    async def upsert_trajectories(self, writes: Sequence[TrajectoryWrite]) -> int:
        """Insert each trajectory; replace an existing one only from a higher attempt. Returns rows written.

        One binary COPY into a session-local staging table, then one ``INSERT ... ON CONFLICT DO UPDATE``.
        """
        if not writes:
            return 0
        rows = [TRAJECTORIES.row(w) for w in writes]
        async with self.pg.cursor() as cur:
            await cur.execute(
                "CREATE TEMP TABLE IF NOT EXISTS rl_stage_trajectories ON COMMIT DELETE ROWS AS "
                f"SELECT {TRAJECTORIES.collist} FROM trajectories WITH NO DATA"
            )
            try:
                await self._copy(cur, TRAJECTORIES, "rl_stage_trajectories", rows)
            except EncodeError as exc:
                raise StoreError(f"cannot encode a trajectory: {exc}", retryable=False) from exc
            await cur.execute(_UPSERT_TRAJECTORIES)
            written = max(0, cur.rowcount)
            await cur.execute("DELETE FROM rl_stage_trajectories")
        return written

    async def finish_episodes(self, finishes: Sequence[Finish]) -> None:
        """Move episodes to a terminal status through the lifecycle table (a no-op where it is not allowed).

        One ``UPDATE ... FROM unnest(...)``: the episodes must be distinct (one round of terminal events).
        """
        if not finishes:
            return
        async with self.pg.cursor() as cur:
            await cur.execute(_FINISH_EPISODES, (
                [f.episode_id for f in finishes], [str(f.status) for f in finishes], [f.attempt for f in finishes],
                [f.reward for f in finishes], [f.num_turns for f in finishes], [f.stop_reason for f in finishes],
                [f.failure_class for f in finishes], [f.failure_reason for f in finishes],
                [_int4_literal(f.weight_versions) for f in finishes], [f.time for f in finishes],
                [_text_literal(allowed_sources(f.status)) for f in finishes]))

    async def unsettled(self, rows: Sequence[tuple[str, int]]) -> set[str]:
        """Episodes among these (episode, attempt of a row just written) whose new rows may need ``superseded``.

        A new turn or step row starts with ``superseded = false``, which is already right when its attempt is
        the episode's current one, the episode is not terminal and has no trajectory: the common case, where
        no reconciliation is needed.
        """
        if not rows:
            return set()
        async with self.pg.cursor() as cur:
            await cur.execute(
                "SELECT DISTINCT q.eid FROM unnest(%s::text[], %s::int4[]) AS q(eid, att) "
                "JOIN episodes e ON e.id = q.eid "
                "WHERE q.att <> e.attempt OR e.status = ANY(%s) "
                "OR EXISTS (SELECT 1 FROM trajectories tr WHERE tr.episode_id = q.eid)",
                ([r[0] for r in rows], [r[1] for r in rows], TERMINAL_STATUSES))
            return {r[0] for r in await cur.fetchall()}

    async def reconcile_superseded(self, episode_ids: Sequence[str]) -> None:
        """Set ``superseded`` on every turn and step of these episodes from the current state.

        With a trajectory: kept = the trajectory attempt's steps of turns < num_turns and the turns they name.
        Without one: rows of attempts other than the episode's latest are superseded (older ones always, newer
        ones once the episode is terminal: an attempt the lifecycle did not let start), except the turns the
        latest attempt's steps name (turns a resumed attempt carried over).
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
                "   ELSE (t2.attempt < e.attempt OR (e.status = ANY(%(terminal)s) AND t2.attempt > e.attempt))"
                "     AND NOT EXISTS (SELECT 1 FROM steps k WHERE k.episode_id = t2.episode_id"
                "       AND k.turn_event_id = t2.event_id AND k.attempt = e.attempt) END"
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
        self._adapted: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()

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
                if pg not in self._adapted:
                    adapters.register(pg)
                    self._adapted.add(pg)
                try:
                    yield Tx(pg)
                except psycopg.Error as exc:
                    if stale_connection(exc):  # the server turned read-only: never hand this connection out again
                        await conn.invalidate()
                    raise
        except StoreError:
            raise
        except (sqlalchemy.exc.SQLAlchemyError, psycopg.Error, OSError) as exc:
            raise classify(exc) from exc

    async def dispose(self) -> None:
        await self.engine.dispose()
