"""trajectories range-partitioned by month of ``episode_created_at`` (contract: apply once no pod of the previous
release runs)

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 03:10:00

The primary key becomes ``(episode_id, episode_created_at)`` (0017's key: its episode's ``created_at``, the same for
every attempt, so a replacement lands on its first version in the same partition). No unique index on
``episode_id`` alone can exist on a partitioned table, so the previous release's recorder, which upserts ``ON
CONFLICT (episode_id)``, cannot write here: this revision is the contract step of the upgrade (docs/deploy.md,
"Upgrading"): `rollout db upgrade --revision 0017`, roll every service, then `rollout db upgrade`. Every writer
gives the key from now on (0017's filling trigger is dropped: a BEFORE trigger cannot choose the partition).

Existing rows are carried in place, as 0016 carried turns: the table becomes the first partition (``MINVALUE`` up
to the first partition bound of turns if 0016 made one, else the first month boundary after now and its newest
key), so nothing is copied but the rows at or above that bound (episodes created since 0016 ran, when the two ran
in different months), which go into the default partition and from there into their months. The feed's statement
triggers move to the parent (their transition tables see the rows of every partition) and the packing trigger is
cloned into each partition. ``rl_ensure_partitions`` makes trajectories' months too.
"""

from __future__ import annotations

from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

TABLE = "trajectories"
KEY = "episode_created_at"
SCHEMA = "rl_partitions"
INDEXES = (("ix_trajectories_batch", "batch_id"), ("ix_trajectories_group", "group_id"),
           ("ix_trajectories_created", "created_at"))
FK = "fk_trajectories_episode"
MONTHS_AHEAD = 3

FILL = """
CREATE FUNCTION rl_trajectory_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.episode_created_at IS NULL THEN  -- a writer of the previous release: the key comes from the episode
        SELECT e.created_at INTO NEW.episode_created_at FROM episodes e WHERE e.id = NEW.episode_id;
    END IF;
    RETURN NEW;
END $$;
"""
"""0017's trigger function (dropped here, made again by the downgrade)."""

ENSURE = """
CREATE OR REPLACE FUNCTION rl_ensure_partitions(months_ahead integer DEFAULT 3, months_back integer DEFAULT 0)
RETURNS integer
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
    FOR spec IN SELECT * FROM (VALUES __TABLES__) AS s(tab, col) LOOP
        FOR i IN -months_back..months_ahead LOOP
            lo := date_trunc('month', now()) + make_interval(months => i);
            hi := lo + interval '1 month';
            part := format('%s_p%s', spec.tab, to_char(lo, 'YYYYMM'));
            CONTINUE WHEN to_regclass('rl_partitions.' || part) IS NOT NULL;
            -- a month the first partition (the table before 0016 or 0018) still covers needs none
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
PARTITIONED_0016 = "('turns', 'produced_at'), ('steps', 'produced_at'), ('trajectory_feed', 'logged_at')"
PARTITIONED = f"{PARTITIONED_0016}, ('trajectories', 'episode_created_at')"


def _scalar(sql: str, params: dict[str, object] | None = None) -> object:
    row = op.get_bind().exec_driver_sql(sql, params or {}).fetchone()
    return None if row is None else row[0]


def _dependent_views() -> list[tuple[str, str]]:
    """(name, definition) of every view that reads trajectories, in creation order (a view binds to its table, not
    its name: each is re-created on the table of the same name afterwards)."""
    rows = op.get_bind().exec_driver_sql(
        "SELECT DISTINCT v.oid, v.relname, pg_get_viewdef(v.oid) FROM pg_depend d "
        "JOIN pg_rewrite r ON r.oid = d.objid JOIN pg_class v ON v.oid = r.ev_class "
        "JOIN pg_class t ON t.oid = d.refobjid WHERE t.relname = %(t)s "
        "AND t.relnamespace = 'public'::regnamespace AND v.relkind = 'v' AND v.oid <> t.oid ORDER BY v.oid",
        {"t": TABLE}).fetchall()
    return [(str(name), str(body)) for _, name, body in rows]


def _rebind(views: list[tuple[str, str]]) -> None:
    for name, body in views:  # same columns: CREATE OR REPLACE keeps the view's grants
        op.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


def _grants() -> list[tuple[str, str]]:
    """(role, privilege) granted on trajectories to roles other than its owner."""
    rows = op.get_bind().exec_driver_sql(
        "SELECT r.rolname, a.privilege_type FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a "
        "JOIN pg_roles r ON r.oid = a.grantee WHERE c.oid = %(t)s::regclass AND a.grantee <> c.relowner "
        "ORDER BY 1, 2", {"t": TABLE}).fetchall()
    return [(str(role), str(privilege)) for role, privilege in rows]


def _grant(grants: list[tuple[str, str]]) -> None:
    for role, privilege in grants:
        op.execute(f'GRANT {privilege} ON {TABLE} TO "{role}"')


def _triggers(table: str) -> list[tuple[str, str]]:
    """(name, CREATE TRIGGER statement) of the table's own triggers (not the constraint triggers of its keys, not
    the clones a partition gets from its parent)."""
    rows = op.get_bind().exec_driver_sql(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %(t)s::regclass AND NOT tgisinternal "
        "AND tgparentid = 0 ORDER BY tgname", {"t": table}).fetchall()
    return [(str(name), str(body)) for name, body in rows]


def _fk_name(table: str) -> str:
    return str(_scalar("SELECT conname FROM pg_constraint WHERE conrelid = %(t)s::regclass AND contype = 'f' "
                       "AND confrelid = 'episodes'::regclass", {"t": table}))


def upgrade() -> None:
    views = _dependent_views()
    grants = _grants()
    triggers = [(n, body) for n, body in _triggers(TABLE) if n != "trajectories_key"]
    legacy = f"{TABLE}_legacy"
    # the first partition ends where turns' first one does (one archive period), else as 0016 would have made it
    bound = _scalar("SELECT to_char(rl_partition_upper(c.oid) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"00:00:00+00') "
                    "FROM pg_class c WHERE c.oid = to_regclass('rl_partitions.turns_legacy')")
    if bound is None:
        bound = _scalar(f"SELECT to_char(date_trunc('month', greatest(now(), max({KEY})) AT TIME ZONE 'UTC') "
                        f"+ interval '1 month', 'YYYY-MM-DD\"T\"00:00:00+00') FROM {TABLE}")
    old_fk = _fk_name(TABLE)
    op.execute(f"ALTER TABLE {TABLE} RENAME TO {legacy}")
    for name, _ in _triggers(legacy):
        op.execute(f"DROP TRIGGER {name} ON {legacy}")
    op.execute("DROP FUNCTION rl_trajectory_key()")
    op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {TABLE}_pkey")  # the attach builds (episode_id, {KEY})
    op.execute("DROP INDEX ux_trajectories_episode_key")
    for name, _ in INDEXES:
        op.execute(f"ALTER INDEX {name} RENAME TO {name.replace(TABLE, legacy, 1)}")
    op.execute(f"CREATE TABLE {TABLE} (LIKE {legacy} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS "
               f"INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE ({KEY})")
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_pkey PRIMARY KEY (episode_id, {KEY})")
    for name, columns in INDEXES:
        op.execute(f"CREATE INDEX {name} ON {TABLE} ({columns})")
    op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {old_fk}")
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {FK} FOREIGN KEY (episode_id) REFERENCES episodes (id) "
               "ON DELETE CASCADE")
    for (check,) in op.get_bind().exec_driver_sql(
            "SELECT conname FROM pg_constraint WHERE conrelid = %(t)s::regclass AND contype = 'c' "
            "AND NOT convalidated", {"t": legacy}).fetchall():
        op.execute(f"ALTER TABLE {legacy} VALIDATE CONSTRAINT {check}")  # a partition's checks are valid
    op.execute(f"CREATE TABLE {SCHEMA}.{TABLE}_default PARTITION OF {TABLE} DEFAULT")
    months_back = 0
    if _scalar(f"SELECT EXISTS (SELECT 1 FROM {legacy})"):
        # rows above the bound (episodes created after 0016 ran, in a later month) go to their months
        op.execute(f"INSERT INTO {SCHEMA}.{TABLE}_default SELECT * FROM {legacy} WHERE {KEY} >= '{bound}'")
        op.execute(f"DELETE FROM {legacy} WHERE {KEY} >= '{bound}'")
        months_back = int(str(_scalar(
            f"SELECT greatest(0, (extract(year FROM age(date_trunc('month', now()), '{bound}'::timestamptz)) * 12 "
            f"+ extract(month FROM age(date_trunc('month', now()), '{bound}'::timestamptz)))::int)")))
        op.execute(f"ALTER TABLE {legacy} SET SCHEMA {SCHEMA}")
        op.execute(f"ALTER TABLE {TABLE} ATTACH PARTITION {SCHEMA}.{legacy} FOR VALUES FROM (MINVALUE) TO ('{bound}')")
        legacy = ""
    for _, body in triggers:  # defined before the rename: they name the new parent
        op.execute(body)
    _grant(grants)
    op.execute(ENSURE.replace("__TABLES__", PARTITIONED))
    op.execute(f"SELECT rl_ensure_partitions({MONTHS_AHEAD}, {months_back})")
    _rebind(views)
    if legacy:  # a new database (or no trajectory yet): monthly partitions only
        op.execute(f"DROP TABLE {legacy}")


def downgrade() -> None:
    views = _dependent_views()
    grants = _grants()
    triggers = _triggers(TABLE)
    part = f"{TABLE}_part"
    op.execute(ENSURE.replace("__TABLES__", PARTITIONED_0016))
    op.execute(f"ALTER TABLE {TABLE} RENAME TO {part}")
    for name, _ in triggers:
        op.execute(f"DROP TRIGGER {name} ON {part}")
    op.execute(f"ALTER INDEX {TABLE}_pkey RENAME TO {part}_pkey")
    for name, _ in INDEXES:
        op.execute(f"ALTER INDEX {name} RENAME TO {name.replace(TABLE, part, 1)}")
    op.execute(f"CREATE TABLE {TABLE} (LIKE {part} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS "
               "INCLUDING STORAGE INCLUDING COMPRESSION)")
    op.execute(f"INSERT INTO {TABLE} SELECT * FROM {part}")
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_pkey PRIMARY KEY (episode_id)")
    op.execute(f"CREATE UNIQUE INDEX ux_trajectories_episode_key ON {TABLE} (episode_id, {KEY})")
    for name, columns in INDEXES:
        op.execute(f"CREATE INDEX {name} ON {TABLE} ({columns})")
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_episode_id_fkey FOREIGN KEY (episode_id) "
               "REFERENCES episodes (id) ON DELETE CASCADE")
    for _, body in triggers:  # defined before the rename: they name the new table
        op.execute(body)
    op.execute(FILL)
    op.execute(f"CREATE TRIGGER trajectories_key BEFORE INSERT ON {TABLE} FOR EACH ROW "
               "EXECUTE FUNCTION rl_trajectory_key()")
    _rebind(views)
    op.execute(f"DROP TABLE {part}")
    _grant(grants)
