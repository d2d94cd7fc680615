"""The Postgres schema (SQLAlchemy Core tables, the Alembic target) and the engine factory with its revision check.

Token arrays are ``int4[]``, logprobs ``float4[]``; a trajectory's arrays are aligned position by position.
A trajectory also keeps its token ids packed little-endian (``token_ids_le``: ``numpy.frombuffer(b, "<i4")``), the
logprobs of its sampled tokens (the action ranges, in order) packed the same way (``sampled_logprobs_le``, ``"<f4"``)
and the weight version of each action range (``action_versions``): what the exporter reads, because Postgres
serialises ``int4[]`` element by element and a per-token array is stored out of line.

``turns``, ``steps``, ``trajectory_feed`` (migration 0016) and ``trajectories`` (0018) are range-partitioned by month
(the partitions, made by ``rl_ensure_partitions``, live in schema ``rl_partitions`` and are not models): each
primary key carries the partition key, a time that never changes for the row (an event's ``produced_at``, a feed
entry's ``logged_at``, a trajectory's ``episode_created_at``: its episode's ``created_at``, which every attempt
shares).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    event,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, REAL
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from rollout_ledger.shared.errors import SchemaVersionError, StoreError

metadata = MetaData()

INT4_ARRAY = ARRAY(Integer, dimensions=1)


def _finite_reward(table: str, col: str) -> CheckConstraint:
    """A reward column refuses NaN and +/-Infinity (migration 0011; Postgres orders NaN equal to itself)."""
    return CheckConstraint(f"{col} IS NULL OR {col} NOT IN ('NaN'::float8, 'Infinity'::float8, '-Infinity'::float8)",
                           name=f"ck_{table}_{col}_finite")


REAL_ARRAY = ARRAY(REAL, dimensions=1)

batches = Table(
    "batches",
    metadata,
    Column("id", String(128), primary_key=True, comment="client-supplied or generated batch id"),
    Column("env", String(128), nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("max_turns", Integer, nullable=False),
    Column("sampling", JSONB, nullable=False),
    Column("context", JSONB, comment="context policy of every episode (null: full history)"),
    Column("num_tasks", Integer, nullable=False),
    Column("num_episodes", Integer, nullable=False),
    Column("request_hash", String(64), nullable=False, comment="sha256 of the request, for idempotent POSTs"),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("cancelled_at", DateTime(timezone=True)),
    Column("max_staleness", Integer,
           comment="k: an episode starts only while (current version - the version it would run on) <= k"),
    Column("episodes_per_version", Integer,
           comment="B: run-ahead bound, at most (current - base + k + 1) x B episodes admitted"),
    Column("admission_base_version", Integer,
           comment="the announced version when the batch was stored (the run-ahead's base)"),
    CheckConstraint("max_staleness IS NULL OR max_staleness >= 0", name="ck_batches_max_staleness"),
    CheckConstraint("episodes_per_version IS NULL OR episodes_per_version >= 1",
                    name="ck_batches_episodes_per_version"),
)

episodes = Table(
    "episodes",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("batch_id", String(128), ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
    Column("group_id", String(160), nullable=False, comment="GRPO group: one task's samples in a batch"),
    Column("group_index", Integer, nullable=False),
    Column("task_index", Integer, nullable=False),
    Column("env", String(128), nullable=False),
    Column("task", JSONB, nullable=False),
    Column("status", String(16), nullable=False, server_default="requested", comment="see shared/lifecycle.py"),
    Column("attempt", Integer, nullable=False, server_default="0", comment="latest attempt started"),
    Column("reward", Float),
    Column("num_turns", Integer),
    Column("stop_reason", Text),
    Column("failure_class", String(16)),
    Column("failure_reason", Text),
    Column("worker_id", Text, comment="env worker of the latest attempt"),
    Column("weight_versions", INT4_ARRAY, comment="distinct weight versions that sampled its kept turns"),
    Column("prompt_token_ids", INT4_ARRAY),
    Column("prompt_text", Text),
    Column("published_at", DateTime(timezone=True), comment="when the work item reached the work queue"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("admitted_version", Integer,
           comment="the announced version when admission let the episode start (null: not bounded)"),
    _finite_reward("episodes", "reward"),
    Index("ix_episodes_batch_status", "batch_id", "status"),
    Index("ix_episodes_waiting", "batch_id", postgresql_where=text("status = 'waiting'")),
    Index("ix_episodes_group", "group_id"),
)

turns = Table(
    "turns",
    metadata,
    Column("event_id", String(256), primary_key=True, comment="= request id; unique per try"),
    Column("episode_id", String(128), ForeignKey("episodes.id", ondelete="CASCADE", name="fk_turns_episode"),
           nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("turn_index", Integer, nullable=False),
    Column("prompt_len", Integer, nullable=False),
    Column("token_ids", INT4_ARRAY, nullable=False, comment="sampled ids, verbatim"),
    Column("logprobs", REAL_ARRAY, nullable=False, comment="inference logprob of each sampled id"),
    Column("finish_reason", String(16), nullable=False),
    Column("weight_version", Integer, nullable=False),
    Column("engine", String(32), nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("queue_ms", REAL, nullable=False),
    Column("generate_ms", REAL, nullable=False),
    Column("cached_tokens", Integer),
    Column("superseded", Boolean, nullable=False, server_default=text("false"),
           comment="true for a try or attempt the episode did not keep"),
    Column("produced_at", DateTime(timezone=True), primary_key=True,
           comment="the event's time: the partition key (a redelivery carries the same, so it meets its first copy)"),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("version_runs", JSONB, comment="[[start, version], ...] when the turn straddles a weight swap in mode "
           "keep (from id start on, sampled by version); null: every id by weight_version (migration 0015)"),
    Index("ix_turns_episode", "episode_id", "attempt", "turn_index"),
    postgresql_partition_by="RANGE (produced_at)",
)

steps = Table(
    "steps",
    metadata,
    Column("event_id", String(256), primary_key=True),
    Column("episode_id", String(128), ForeignKey("episodes.id", ondelete="CASCADE", name="fk_steps_episode"),
           nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("turn_index", Integer, nullable=False),
    Column("turn_event_id", String(256), nullable=False, comment="the turn whose ids were kept"),
    Column("action", Text, nullable=False),
    Column("observation", Text, nullable=False),
    Column("observation_token_ids", INT4_ARRAY, nullable=False),
    Column("reward", Float, nullable=False),
    Column("terminated", Boolean, nullable=False),
    Column("truncated", Boolean, nullable=False),
    Column("info", JSONB, nullable=False),
    Column("step_ms", REAL, nullable=False),
    Column("drift", String(32), comment="drift class when the turn's rendering did not extend the context"),
    Column("new_segment", Boolean, nullable=False, server_default=text("false"),
           comment="observation_token_ids is the re-rendered context that starts a new segment"),
    Column("superseded", Boolean, nullable=False, server_default=text("false")),
    Column("produced_at", DateTime(timezone=True), primary_key=True, comment="the partition key (as of turns)"),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("reused_from", String(256),
           comment="a resumed attempt carried this turn over: the recorded step it repeats (migration 0015)"),
    Column("env_state", JSONB, comment="a snapshot env's state after this step (migration 0015)"),
    _finite_reward("steps", "reward"),
    Index("ix_steps_episode", "episode_id", "attempt", "turn_index"),
    postgresql_partition_by="RANGE (produced_at)",
)

trajectories = Table(
    "trajectories",
    metadata,
    Column("episode_id", String(128),
           ForeignKey("episodes.id", ondelete="CASCADE", name="fk_trajectories_episode"), primary_key=True),
    Column("episode_created_at", DateTime(timezone=True), primary_key=True,
           comment="its episode's created_at: the partition key (a replacement by a higher attempt keeps it)"),
    Column("batch_id", String(128), nullable=False),
    Column("group_id", String(160), nullable=False),
    Column("env", String(128), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False, comment="completed | truncated | aborted | failed"),
    Column("failure_class", String(16)),
    Column("reward", Float),
    Column("token_ids", INT4_ARRAY, nullable=False, comment="prompt + sampled + observation ids, in order"),
    Column("loss_mask", ARRAY(SmallInteger, dimensions=1), nullable=False, comment="1 exactly on sampled ids"),
    Column("logprobs", REAL_ARRAY, nullable=False, comment="inference logprob at sampled positions, 0 elsewhere"),
    Column("weight_versions", INT4_ARRAY, nullable=False, comment="per token; -1 on non-sampled positions"),
    Column("action_ranges", ARRAY(Integer, dimensions=2), nullable=False,
           comment="[start, end) of each sampled span"),
    Column("prompt_len", Integer, nullable=False),
    Column("num_tokens", Integer, nullable=False),
    Column("num_sampled_tokens", Integer, nullable=False),
    Column("num_turns", Integer, nullable=False),
    Column("segments", ARRAY(Integer, dimensions=2), nullable=False,
           comment="[start, end) of each segment (a context the policy saw; one training sample each)"),
    Column("num_segments", Integer, nullable=False, server_default=text("1")),
    Column("token_check", String(16),
           comment="ok: decode(ids) equals the chat template's rendering, per segment; mismatch; NULL: not checked"),
    Column("drifts", JSONB, nullable=False, server_default=text("'[]'::jsonb"),
           comment='turns whose rendering did not extend the context: [{"turn": t, "class": ...}]'),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("token_ids_le", LargeBinary, nullable=False,
           comment="token_ids packed as little-endian int32 (the exporter's copy; filled when not given)"),
    Column("sampled_logprobs_le", LargeBinary, nullable=False,
           comment="logprobs of the sampled tokens (inside action_ranges, in order) packed as little-endian float32 "
                   "(the exporter's copy; filled when not given)"),
    Column("action_versions", INT4_ARRAY, nullable=False,
           comment="weight version of each action range (NULL for an empty range; filled when not given)"),
    CheckConstraint("octet_length(token_ids_le) = 4 * cardinality(token_ids)", name="ck_trajectories_token_ids_le"),
    CheckConstraint("octet_length(sampled_logprobs_le) = 4 * rl_sampled_count(action_ranges)",
                    name="ck_trajectories_sampled_logprobs_le"),
    CheckConstraint("cardinality(action_versions) = coalesce(array_length(action_ranges, 1), 0)",
                    name="ck_trajectories_action_versions"),
    _finite_reward("trajectories", "reward"),
    Index("ix_trajectories_batch", "batch_id"),
    Index("ix_trajectories_group", "group_id"),
    Index("ix_trajectories_created", "created_at"),
    postgresql_partition_by="RANGE (episode_created_at)",
)

attempt_failures = Table(
    "attempt_failures",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", String(256), nullable=False, unique=True, comment="the EpisodeFailed event"),
    Column("episode_id", String(128),
           ForeignKey("episodes.id", ondelete="CASCADE", name="fk_attempt_failures_episode"), nullable=False),
    Column("batch_id", String(128), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("failure_class", String(16), nullable=False, comment="infra | inference | env | agent | timeout"),
    Column("reason", Text, nullable=False),
    Column("retried", Boolean, nullable=False, comment="another attempt followed (the class's budget was not spent)"),
    Column("produced_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_attempt_failures_episode", "episode_id"),
    Index("ix_attempt_failures_class", "failure_class", "produced_at"),
)

attempt_resumes = Table(
    "attempt_resumes",
    metadata,
    Column("episode_id", String(128),
           ForeignKey("episodes.id", ondelete="CASCADE", name="fk_attempt_resumes_episode"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("batch_id", String(128), nullable=False),
    Column("mode", String(16), nullable=False, comment="replay | snapshot | agent_replay | restart"),
    Column("from_attempt", Integer, nullable=False, comment="the attempt whose recorded turns were read (0: none)"),
    Column("turns_recorded", Integer, nullable=False, comment="turns of that attempt recorded with their steps"),
    Column("turns_reused", Integer, nullable=False,
           comment="turns carried over at the start (an agent replay counts its steps' reused_from instead)"),
    Column("turns_unstepped", Integer, nullable=False,
           comment="turns of that attempt generated without a recorded step (generated again)"),
    Column("reason", Text, nullable=False, comment="why it fell back to restart, or what limited the reuse"),
    Column("produced_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_attempt_resumes_batch", "batch_id"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("source", String(64), nullable=False, comment="consumer or advisory that gave up on it"),
    Column("subject", Text, nullable=False),
    Column("stream_seq", BigInteger),
    Column("reason", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("headers", JSONB),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ux_dead_letters_source_seq", "source", "stream_seq", unique=True),
)


SCHEMA_REVISION = "0018"
"""The Alembic revision these tables describe and this code expects: the newest file in migrations/versions
(tests/unit/test_schema_revision.py fails when a migration is added without moving it)."""
EXPAND_REVISION = "0017"
"""The revision of an upgrade in progress this code also runs on: the expand half, applied before the services
roll, while pods of the previous release still write; ``SCHEMA_REVISION`` is applied once they are gone
(docs/deploy.md, "Upgrading")."""


def create_engine(database_url: str, *, pool_size: int = 5, echo: bool = False) -> AsyncEngine:
    """An async engine on psycopg 3 whose pool never hands out a connection to a server that cannot take writes.

    ``pool_pre_ping`` replaces a connection that died (a restart, a failover: with a multi-host DSN and
    ``target_session_attrs=read-write`` the new one lands on the new primary). A connection that lives but reaches a
    server that turned read-only (a primary demoted in place) answers the ping and then refuses every write:
    ``stale_connection`` errors count as disconnects, so SQLAlchemy drops that connection and the pool's older ones
    and the caller's retry connects afresh."""
    engine = create_async_engine(database_url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
                                 echo=echo)
    event.listen(engine.sync_engine, "handle_error", _read_only_is_a_disconnect)
    return engine


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn SQLAlchemy/psycopg failures of the block into ``StoreError`` naming the operation (the Postgres side's
    ``bus_errors``)."""
    try:
        yield
    except DBAPIError as exc:
        raise StoreError(f"{what}: {exc.orig or exc}") from exc
    except SQLAlchemyError as exc:
        raise StoreError(f"{what}: {exc}") from exc


def stale_connection(exc: BaseException) -> bool:
    """True for an error that says this connection's server no longer takes writes (SQLSTATE 25006, a demoted or
    recovering server): a new connection (to the multi-host DSN's writable host) is the cure, not the same one."""
    return isinstance(exc, psycopg.errors.ReadOnlySqlTransaction)


def _read_only_is_a_disconnect(context: ExceptionContext) -> None:
    if stale_connection(context.original_exception):
        context.is_disconnect = True


async def check_schema(engine: AsyncEngine) -> None:
    """Refuse to run against a database whose schema is not at this code's head revision (or the expand revision of
    an upgrade in progress, ``EXPAND_REVISION``)."""
    expected = SCHEMA_REVISION
    try:
        async with engine.connect() as conn:
            exists = (await conn.execute(text("select to_regclass('alembic_version')"))).scalar()
            current = None
            if exists is not None:
                current = (await conn.execute(text("select version_num from alembic_version"))).scalar()
    except Exception as exc:
        if "permission denied for table alembic_version" in str(exc):
            # a service login before migration 0012 made its role (or a login outside every service role)
            raise SchemaVersionError(
                f"this login may not read the schema revision: the database is older than this code's {expected} "
                "(which grants it to the service roles) or the login is in none of them: run `rollout db upgrade` "
                "(or `make migrate`) as the owner, then `rollout db create-logins`") from exc
        raise StoreError(f"cannot reach Postgres: {exc}") from exc
    if current not in (expected, EXPAND_REVISION):
        raise SchemaVersionError(
            f"database schema is at revision {current or 'none'}, this code needs {expected}: "
            "run `rollout db upgrade` (or `make migrate`) against this DATABASE_URL first"
        )


def row_dict(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


# --- the exporter's tables (migration 0003; the views and the rollout_reader role are created there too) ---

trajectory_feed = Table(
    "trajectory_feed",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=True, comment="insert order within a transaction"),
    Column("xid", BigInteger, nullable=False,
           comment="pg_current_xact_id() of the writing transaction: readers take only xid < snapshot xmin"),
    Column("episode_id", String(128), nullable=False),
    Column("attempt", Integer, nullable=False,
           comment="the trajectory version this entry announces; 0: its episode ended without a trajectory (a group "
                   "marker)"),
    Column("group_id", String(160), nullable=False),
    Column("batch_id", String(128), nullable=False),
    Column("logged_at", DateTime(timezone=True), primary_key=True, server_default=func.now(),
           comment="the partition key"),
    Index("ix_trajectory_feed_position", "xid", "seq"),
    Index("ix_trajectory_feed_group", "group_id"),
    postgresql_partition_by="RANGE (logged_at)",
    comment="one row per trajectory written or replaced (filled by triggers on trajectories): consumer cursors",
)

export_cursors = Table(
    "export_cursors",
    metadata,
    Column("consumer", String(128), primary_key=True),
    Column("xid", BigInteger, nullable=False, server_default=text("0"), comment="position: last feed entry taken"),
    Column("seq", BigInteger, nullable=False, server_default=text("0")),
    Column("deliveries", BigInteger, nullable=False, server_default=text("0"),
           comment="batches delivered (numbers the files of `rollout export --follow`)"),
    Column("delivered", BigInteger, nullable=False, server_default=text("0"), comment="records delivered"),
    Column("selection", JSONB, comment="the selection the consumer was last served with"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

reward_scores = Table(
    "reward_scores",
    metadata,
    Column("episode_id", String(128), ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True),
    Column("reward_name", String(128), primary_key=True),
    Column("reward_version", String(64), primary_key=True),
    Column("attempt", Integer, nullable=False, comment="the trajectory attempt that was scored"),
    Column("score", Float),
    Column("info", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("scored_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_reward_scores_name", "reward_name", "reward_version"),
    comment="re-scores of stored trajectories by a named, versioned reward function (rollout rescore)",
)

policy_versions = Table(
    "policy_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False, comment="the policy (weight) version"),
    Column("checkpoint", Text, nullable=False, comment="where the weights are (a directory the workers can read)"),
    Column("mode", String(8), nullable=False, comment="drain | abort | keep: how running engines swap to it"),
    Column("notes", Text, nullable=False, server_default=text("''")),
    Column("request_hash", String(64), nullable=False, comment="of the announcing request (idempotent POST)"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("version >= 0", name="ck_policy_versions_version"),
    CheckConstraint("mode IN ('drain', 'abort', 'keep')", name="ck_policy_versions_mode"),
)

policy_worker_states = Table(
    "policy_worker_states",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("worker_id", String(128), primary_key=True),
    Column("state", String(16), nullable=False, comment="announced | loading | serving | failed | retired"),
    Column("error", Text, nullable=False, server_default=text("''"), comment="why the load failed"),
    Column("engine", String(32), nullable=False, server_default=text("''")),
    Column("reported_at", DateTime(timezone=True), nullable=False, comment="the worker's time of the report"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("state IN ('announced', 'loading', 'serving', 'failed', 'retired')",
                    name="ck_policy_worker_states_state"),
    Index("ix_policy_worker_states_worker", "worker_id", "version"),
)

archives = Table(
    "archives",
    metadata,
    Column("period_start", DateTime(timezone=True), primary_key=True),
    Column("period_end", DateTime(timezone=True), nullable=False),
    Column("url", Text, nullable=False, comment="where the period's Parquet files and manifest are"),
    Column("manifest", Text, nullable=False, comment="the manifest's URL"),
    Column("tables", JSONB, nullable=False, comment="rows archived per table"),
    Column("batch_ids", ARRAY(Text, dimensions=1), nullable=False,
           comment="batches with trajectories in the archive (where a reader looks for them)"),
    Column("schema_revision", Text, nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("period_start < period_end", name="ck_archives_period"),
    comment="periods `rollout archive` moved to Parquet: where the manifest is, row counts per table and the "
            "batches whose trajectories it holds (readers find archived rows here)",
)

logprob_audits = Table(
    "logprob_audits",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("episode_id", String(128), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("batch_id", String(128), nullable=False),
    Column("source", String(16), nullable=False, comment="audit (rollout audit) | trainer (the trainer's own pass)"),
    Column("checkpoint", Text, nullable=False, comment="the weights the logprobs were recomputed with"),
    Column("engine", String(64), nullable=False, comment="the engine(s) that sampled the trajectory"),
    Column("min_version", Integer, comment="lowest weight version of its sampled tokens"),
    Column("max_version", Integer, comment="highest weight version of its sampled tokens"),
    Column("num_tokens", Integer, nullable=False, comment="sampled (loss-mask 1) tokens compared"),
    Column("mean_abs_delta", Float, nullable=False, comment="mean |recomputed - stored logprob| over them"),
    Column("p99_abs_delta", Float, nullable=False),
    Column("max_abs_delta", Float, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("token_logprobs", REAL_ARRAY,
           comment="recomputed logprob of each sampled (loss-mask 1) token, in order; NaN: not recomputed"),
    Index("ux_logprob_audits_key", "episode_id", "attempt", "source", "checkpoint", unique=True),
    Index("ix_logprob_audits_batch", "batch_id"),
)

