"""trajectories.logprobs_le -> sampled_logprobs_le: the exporter's packed copy holds the sampled tokens' logprobs only

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 20:30:00

Why: ``logprobs`` is 0.0 on every token the policy did not sample (prompt, observations, tool output:
``recorder/assembly.py``), so half or more of the packed copy the exporter reads was zeros: bytes that Postgres
compressed on write and decompressed on every read (pglz), sent, and the driver decoded. The copy now holds the
logprobs of the tokens inside ``action_ranges``, in order (``sampled_logprobs_le``, 4 bytes a sampled token); the
exporter lays them back on the ranges with zeros elsewhere, as it rebuilds ``loss_mask`` and ``weight_versions``
(``rows.spread``). The SQL array ``logprobs`` keeps every position. A trajectory of 256 tokens, half sampled, sends
22% fewer bytes (docs/benchmarks.md).

The backfill rewrites every trajectory row once (its feed trigger off: the attempt does not change, so it would
add no entry, only materialise the table twice); ``VACUUM trajectories`` afterwards reclaims the old versions.
``rl_sampled_le(packed, ranges)`` cuts the ranges out of a packed array; ``rl_sampled_count(ranges)`` is what the
CHECK compares the length with. The pack trigger fills the copy when a writer leaves it out, and refreshes it when
an UPDATE changes ``logprobs`` or ``action_ranges`` and not the copy.
"""

from __future__ import annotations

from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

FUNCTIONS = """
CREATE FUNCTION rl_sampled_le(packed bytea, ranges int4[]) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    -- the 4-byte values of each [start, end) range of a packed array, in range order
    SELECT coalesce(string_agg(substr(packed, ranges[i][1] * 4 + 1, (ranges[i][2] - ranges[i][1]) * 4), ''::bytea
                               ORDER BY i), ''::bytea)
    FROM generate_subscripts(ranges, 1) AS i
$$;

CREATE FUNCTION rl_sampled_count(ranges int4[]) RETURNS int4
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT coalesce(sum(ranges[i][2] - ranges[i][1]), 0)::int4 FROM generate_subscripts(ranges, 1) AS i
$$;
"""

PACK = """
CREATE OR REPLACE FUNCTION rl_trajectories_pack() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.token_ids_le IS NULL OR (TG_OP = 'UPDATE' AND NEW.token_ids IS DISTINCT FROM OLD.token_ids
                                    AND NEW.token_ids_le IS NOT DISTINCT FROM OLD.token_ids_le) THEN
        NEW.token_ids_le := rl_pack_le(array_send(NEW.token_ids));
    END IF;
{logprobs}
    IF NEW.action_versions IS NULL OR (TG_OP = 'UPDATE'
            AND (NEW.action_ranges, NEW.weight_versions) IS DISTINCT FROM (OLD.action_ranges, OLD.weight_versions)
            AND NEW.action_versions IS NOT DISTINCT FROM OLD.action_versions) THEN
        NEW.action_versions := rl_action_versions(NEW.action_ranges, NEW.weight_versions);
    END IF;
    RETURN NEW;
END $$;
"""
"""The pack trigger's function (migration 0005's), with the branch that fills the logprobs copy put in."""

SAMPLED = """
    IF NEW.sampled_logprobs_le IS NULL OR (TG_OP = 'UPDATE'
            AND (NEW.logprobs, NEW.action_ranges) IS DISTINCT FROM (OLD.logprobs, OLD.action_ranges)
            AND NEW.sampled_logprobs_le IS NOT DISTINCT FROM OLD.sampled_logprobs_le) THEN
        NEW.sampled_logprobs_le := rl_sampled_le(rl_pack_le(array_send(NEW.logprobs)), NEW.action_ranges);
    END IF;"""

WHOLE = """
    IF NEW.logprobs_le IS NULL OR (TG_OP = 'UPDATE' AND NEW.logprobs IS DISTINCT FROM OLD.logprobs
                                   AND NEW.logprobs_le IS NOT DISTINCT FROM OLD.logprobs_le) THEN
        NEW.logprobs_le := rl_pack_le(array_send(NEW.logprobs));
    END IF;"""
"""Migration 0005's branch (the whole array packed), for the downgrade."""

COMMENT = ("logprobs of the sampled tokens (inside action_ranges, in order) packed as little-endian float32 "
           "(the exporter's copy; filled when not given)")


def upgrade() -> None:
    op.execute(FUNCTIONS)
    op.execute("ALTER TABLE trajectories ADD COLUMN sampled_logprobs_le bytea")
    op.execute("ALTER TABLE trajectories ALTER COLUMN sampled_logprobs_le SET STORAGE MAIN, "
               "DROP CONSTRAINT ck_trajectories_logprobs_le, ALTER COLUMN logprobs_le DROP NOT NULL")
    op.execute(PACK.replace("{logprobs}", SAMPLED))
    op.execute("ALTER TABLE trajectories DISABLE TRIGGER trajectories_feed_replaced")
    # the old copy is cleared in the same pass, so the rewritten rows do not carry it until the next rewrite
    op.execute("UPDATE trajectories SET sampled_logprobs_le = rl_sampled_le(logprobs_le, action_ranges), "
               "logprobs_le = NULL")
    op.execute("ALTER TABLE trajectories ENABLE TRIGGER trajectories_feed_replaced")
    op.execute("ALTER TABLE trajectories DROP COLUMN logprobs_le, ALTER COLUMN sampled_logprobs_le SET NOT NULL, "
               "ADD CONSTRAINT ck_trajectories_sampled_logprobs_le "
               "CHECK (octet_length(sampled_logprobs_le) = 4 * rl_sampled_count(action_ranges))")
    op.execute("COMMENT ON COLUMN trajectories.sampled_logprobs_le IS '" + COMMENT.replace("'", "''") + "'")


def downgrade() -> None:
    op.execute("ALTER TABLE trajectories ADD COLUMN logprobs_le bytea")
    op.execute("ALTER TABLE trajectories ALTER COLUMN logprobs_le SET STORAGE MAIN")
    op.execute(PACK.replace("{logprobs}", WHOLE))
    op.execute("ALTER TABLE trajectories DISABLE TRIGGER trajectories_feed_replaced")
    op.execute("UPDATE trajectories SET logprobs_le = rl_pack_le(array_send(logprobs))")
    op.execute("ALTER TABLE trajectories ENABLE TRIGGER trajectories_feed_replaced")
    op.execute("ALTER TABLE trajectories DROP COLUMN sampled_logprobs_le, ALTER COLUMN logprobs_le SET NOT NULL, "
               "ADD CONSTRAINT ck_trajectories_logprobs_le CHECK (octet_length(logprobs_le) = 4 * cardinality(logprobs))")
    op.execute("COMMENT ON COLUMN trajectories.logprobs_le IS "
               "'logprobs packed as little-endian float32 (the exporter''s copy; filled when not given)'")
    op.execute("DROP FUNCTION rl_sampled_count(int4[]); DROP FUNCTION rl_sampled_le(bytea, int4[])")
