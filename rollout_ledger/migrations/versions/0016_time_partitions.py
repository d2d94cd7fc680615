"""time partitions: turns and steps by ``produced_at``, trajectory_feed by ``logged_at`` (monthly, UTC), a default
partition each, ``rl_ensure_partitions`` to create months ahead, and ``archives`` (what `rollout archive` moved to
Parquet)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 11:00:00

Why these keys. Postgres enforces a unique index across partitions only when it contains the partition key, and the
recorder's idempotency is the primary key. The key of a turn or step is ``produced_at``, a field of its event: a
redelivery or re-publish of an event carries the same bytes, so the same ``(event_id, produced_at)`` lands in the
same partition and meets its first copy (``ON CONFLICT DO NOTHING``). The feed's key is ``logged_at`` (``now()`` of
the writing transaction, filled by its default): nothing upserts the feed.

``trajectories`` stays one table in this revision: the previous release's recorder (still running during a rolling
upgrade, tests/integration/test_rolling_upgrade.py) upserts it with ``ON CONFLICT (episode_id)``, which no
partitioned table can serve (its unique index would have to contain the partition key). `rollout archive` moves
its archived rows to Parquet and deletes them in the transaction that drops the period's partitions; an index on
``trajectories.created_at`` finds a month's rows.

Existing rows are carried in place: each table is renamed ``<table>_legacy`` and attached as the first partition
(``MINVALUE`` up to the first month boundary after its newest row and now), so the migration copies nothing (an
empty table is dropped instead: a new database has monthly partitions from the current month on); the
attach builds the new primary key on it and checks its bound and foreign key once, and 0011's ``NOT VALID``
reward check is validated (a partition's checks must be). Downgrade copies every row back into a plain
table (what an archive took is not brought back: it lies in its Parquet files).
"""

from __future__ import annotations

from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

PARTITIONED = {
    # table: (partition key, primary key before, other indexes (name, columns), foreign key to episodes)
    "turns": ("produced_at", "event_id", (("ix_turns_episode", "episode_id, attempt, turn_index"),),
              "fk_turns_episode"),
    "steps": ("produced_at", "event_id", (("ix_steps_episode", "episode_id, attempt, turn_index"),),
              "fk_steps_episode"),
    "trajectory_feed": ("logged_at", "seq", (("ix_trajectory_feed_position", "xid, seq"),
                                             ("ix_trajectory_feed_group", "group_id")), None),
}

GRANTS = {
    # 0012's grants of these tables (a new table has none of them)
    "turns": {"rollout_scheduler": "SELECT", "rollout_recorder": "SELECT, INSERT, UPDATE"},
    "steps": {"rollout_scheduler": "SELECT", "rollout_recorder": "SELECT, INSERT, UPDATE"},
    "trajectory_feed": {"rollout_scheduler": "INSERT", "rollout_recorder": "INSERT", "rollout_pruner": "DELETE"},
}
READER = "rollout_reader"
MONTHS_AHEAD = 3
SCHEMA = "rl_partitions"
"""Where the partitions live (the parents stay in ``public``): the schema the models describe stays the models'."""

COMMENTS = {
    "turns.produced_at":
        "the event''s time: the partition key (a redelivery carries the same, so it meets its first copy)",
    "steps.produced_at": "the partition key (as of turns)",
    "trajectory_feed.logged_at": "the partition key",
    "archives.url": "where the period''s Parquet files and manifest are",
    "archives.manifest": "the manifest''s URL",
    "archives.tables": "rows archived per table",
    "archives.batch_ids": "batches with trajectories in the archive (where a reader looks for them)",
}

ENSURE = """
CREATE FUNCTION rl_ensure_partitions(months_ahead integer DEFAULT 3, months_back integer DEFAULT 0) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET timezone = 'UTC' AS $$
DECLARE
    spec record;
    lo timestamptz;
    hi timestamptz;
    part text;
    made integer := 0;
BEGIN
    IF months_ahead < 0 OR months_ahead > 120 OR months_back < 0 OR months_back > 120 THEN
        RAISE EXCEPTION 'months_ahead and months_back must be between 0 and 120, got % and %', months_ahead,
            months_back;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('rl_ensure_partitions', 0));  -- one maker at a time
    FOR spec IN SELECT * FROM (VALUES ('turns', 'produced_at'), ('steps', 'produced_at'),
                                      ('trajectory_feed', 'logged_at')) AS s(tab, col) LOOP
        FOR i IN -months_back..months_ahead LOOP
            lo := date_trunc('month', now()) + make_interval(months => i);
            hi := lo + interval '1 month';
            part := format('%s_p%s', spec.tab, to_char(lo, 'YYYYMM'));
            CONTINUE WHEN to_regclass('rl_partitions.' || part) IS NOT NULL;
            -- a month the first partition (the table before 0016) still covers needs none
            CONTINUE WHEN EXISTS (
                SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = spec.tab::regclass AND c.relname = spec.tab || '_legacy'
                AND rl_partition_upper(c.oid) >= hi);
            -- a month `rollout archive` took stays archived: what arrives for it later waits in the default partition
            CONTINUE WHEN EXISTS (SELECT 1 FROM archives a WHERE a.period_start < hi AND a.period_end > lo);
            -- rows the default partition took for this month move into the new one (else the attach fails)
            EXECUTE format('CREATE TABLE rl_partitions.%I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part,
                           spec.tab);
            EXECUTE format('WITH moved AS (DELETE FROM rl_partitions.%I WHERE %I >= %L AND %I < %L RETURNING *) '
                           'INSERT INTO rl_partitions.%I SELECT * FROM moved', spec.tab || '_default', spec.col, lo,
                           spec.col, hi, part);
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION rl_partitions.%I FOR VALUES FROM (%L) TO (%L)', spec.tab,
                           part, lo, hi);
            made := made + 1;
        END LOOP;
    END LOOP;
    RETURN made;
END $$;
"""

UPPER = """
CREATE FUNCTION rl_partition_upper(part oid) RETURNS timestamptz LANGUAGE sql STABLE SET timezone = 'UTC' AS $$
    SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz
    FROM pg_class c WHERE c.oid = part
$$;
"""


def _dependent_views(tables: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, definition) of every view that reads one of ``tables``, in creation order (a view binds to its table,
    not its name: each is re-created on the table of the same name afterwards)."""
    rows = op.get_bind().exec_driver_sql(
        "SELECT DISTINCT v.oid, v.relname, pg_get_viewdef(v.oid) FROM pg_depend d "
        "JOIN pg_rewrite r ON r.oid = d.objid JOIN pg_class v ON v.oid = r.ev_class "
        "JOIN pg_class t ON t.oid = d.refobjid WHERE t.relname = ANY(%(t)s) "
        "AND t.relnamespace = 'public'::regnamespace AND v.relkind = 'v' AND v.oid <> t.oid ORDER BY v.oid",
        {"t": list(tables)}).fetchall()
    return [(str(name), str(body)) for _, name, body in rows]


def _rebind(views: list[tuple[str, str]]) -> None:
    for name, body in views:  # same columns: CREATE OR REPLACE keeps the view's grants
        op.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


def _grant(table: str) -> None:
    for role, privileges in GRANTS[table].items():
        op.execute(f"GRANT {privileges} ON {table} TO {role}")
    op.execute(f"GRANT SELECT ON {table} TO {READER}")


def _boundary(table: str, key: str) -> str:
    """The first month boundary (UTC) after both now and the table's newest key: the first partition's upper bound."""
    row = op.get_bind().exec_driver_sql(
        f"SELECT to_char(date_trunc('month', greatest(now(), max({key})) AT TIME ZONE 'UTC') + interval '1 month', "
        f"'YYYY-MM-DD\"T\"00:00:00+00') FROM {table}").fetchone()
    assert row is not None
    return str(row[0])


def upgrade() -> None:
    views = _dependent_views(tuple(PARTITIONED))
    empty: list[str] = []
    op.execute(f"CREATE SCHEMA {SCHEMA}")
    op.execute("""
CREATE TABLE archives (
    period_start timestamptz NOT NULL,
    period_end timestamptz NOT NULL,
    url text NOT NULL,
    manifest text NOT NULL,
    tables jsonb NOT NULL,
    batch_ids text[] NOT NULL,
    schema_revision text NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (period_start),
    CONSTRAINT ck_archives_period CHECK (period_start < period_end)
)""")
    op.execute("COMMENT ON TABLE archives IS 'periods `rollout archive` moved to Parquet: where the manifest is, "
               "row counts per table and the batches whose trajectories it holds (readers find archived rows here)'")
    op.execute(f"GRANT SELECT ON archives TO {READER}, rollout_scheduler")
    # what an archive of a month (and an export's --since/--until) reads trajectories by
    op.execute("CREATE INDEX ix_trajectories_created ON trajectories (created_at)")
    op.execute(UPPER)
    for table, (key, pk, indexes, fk) in PARTITIONED.items():
        legacy = f"{table}_legacy"
        bound = _boundary(table, key)
        op.execute(f"ALTER TABLE {table} RENAME TO {legacy}")
        op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {table}_pkey")  # the attach builds ({pk}, {key})
        for name, _ in indexes:
            op.execute(f"ALTER INDEX {name} RENAME TO {name.replace(table, legacy, 1)}")
        op.execute(f"CREATE TABLE {table} (LIKE {legacy} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS "
                   f"INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE ({key})")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY ({pk}, {key})")
        for name, columns in indexes:
            op.execute(f"CREATE INDEX {name} ON {table} ({columns})")
        if fk is not None:
            op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {fk}")
            op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {fk} FOREIGN KEY (episode_id) REFERENCES episodes (id) "
                       "ON DELETE CASCADE")
        if table == "trajectory_feed":
            op.execute("ALTER SEQUENCE trajectory_feed_seq_seq OWNED BY trajectory_feed.seq")
        for (check,) in op.get_bind().exec_driver_sql(
                "SELECT conname FROM pg_constraint WHERE conrelid = %(t)s::regclass AND contype = 'c' "
                "AND NOT convalidated", {"t": legacy}).fetchall():
            op.execute(f"ALTER TABLE {legacy} VALIDATE CONSTRAINT {check}")  # a partition's checks are valid
        if op.get_bind().exec_driver_sql(f"SELECT EXISTS (SELECT 1 FROM {legacy})").scalar():
            op.execute(f"ALTER TABLE {legacy} SET SCHEMA {SCHEMA}")
            op.execute(f"ALTER TABLE {table} ATTACH PARTITION {SCHEMA}.{legacy} FOR VALUES FROM (MINVALUE) "
                       f"TO ('{bound}')")
        else:  # a new database: monthly partitions from this month on (dropped once no view reads it)
            empty.append(legacy)
        op.execute(f"CREATE TABLE {SCHEMA}.{table}_default PARTITION OF {table} DEFAULT")
        _grant(table)
    op.execute("COMMENT ON TABLE trajectory_feed IS 'one row per trajectory written or replaced (filled by triggers "
               "on trajectories): consumer cursors'")
    op.execute(ENSURE)
    op.execute("REVOKE ALL ON FUNCTION rl_ensure_partitions(integer, integer) FROM PUBLIC")
    op.execute("GRANT EXECUTE ON FUNCTION rl_ensure_partitions(integer, integer) "
               "TO rollout_recorder, rollout_scheduler")
    op.execute(f"SELECT rl_ensure_partitions({MONTHS_AHEAD})")
    _rebind(views)
    for legacy in empty:
        op.execute(f"DROP TABLE {legacy}")
    for column, comment in COMMENTS.items():
        op.execute(f"COMMENT ON COLUMN {column} IS '{comment}'")


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS archives")
    op.execute("DROP INDEX IF EXISTS ix_trajectories_created")
    views = _dependent_views(tuple(PARTITIONED))
    op.execute("DROP FUNCTION IF EXISTS rl_ensure_partitions(integer, integer)")
    for table, (_key, pk, indexes, fk) in PARTITIONED.items():
        part = f"{table}_part"
        op.execute(f"ALTER TABLE {table} RENAME TO {part}")
        op.execute(f"ALTER INDEX {table}_pkey RENAME TO {part}_pkey")
        for name, _ in indexes:
            op.execute(f"ALTER INDEX {name} RENAME TO {name.replace(table, part, 1)}")
        op.execute(f"CREATE TABLE {table} (LIKE {part} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS "
                   "INCLUDING STORAGE INCLUDING COMPRESSION)")
        op.execute(f"INSERT INTO {table} SELECT * FROM {part}")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY ({pk})")
        for name, columns in indexes:
            op.execute(f"CREATE INDEX {name} ON {table} ({columns})")
        if fk is not None:
            op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {fk} FOREIGN KEY (episode_id) REFERENCES episodes (id) "
                       "ON DELETE CASCADE")
        if table == "trajectory_feed":
            op.execute("ALTER SEQUENCE trajectory_feed_seq_seq OWNED BY trajectory_feed.seq")
        _rebind(views)
        op.execute(f"DROP TABLE {part}")
        _grant(table)
    op.execute("DROP FUNCTION IF EXISTS rl_partition_upper(oid)")
    op.execute(f"DROP SCHEMA {SCHEMA}")
