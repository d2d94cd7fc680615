"""trajectories.token_ids_le / logprobs_le / action_versions: what the exporter reads, without per-element work

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 07:00:00

Why: Postgres serialises an ``int4[]`` / ``float4[]`` element by element (``array_send`` calls the element's send
function per value, 8 bytes on the wire each); reading the two arrays of 100,000 trajectories of 256 tokens cost
the server 2.8 s of CPU, more than writing the whole export to Parquet. A ``bytea`` of packed little-endian values
is sent as one memcpy and read client-side with ``numpy.frombuffer`` (no byte swap, no per-element work).

The ``int4[]`` / ``float4[]`` columns stay the SQL surface; the packed copies are written by the recorder (in the
same COPY row, from the same numpy arrays). ``action_versions`` is the weight version of each action range (NULL for
an empty range): the exporter rebuilds ``loss_mask`` and ``weight_versions`` from the ranges and these, instead of
reading (and de-TOASTing) the per-token ``weight_versions`` to pick one value per range. Any other writer may leave
the three out: a BEFORE trigger derives them when they are NULL, or when an UPDATE changes their source without
them. CHECK constraints keep the lengths in step. ``rl_pack_le(array_send(a))`` is the SQL packing (slow, ~150 us
per 256 elements: for backfills and other writers, not the hot path).
"""

from __future__ import annotations

from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

PACK = """
CREATE FUNCTION rl_pack_le(sent bytea) RETURNS bytea LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    -- array_send of a 1-d array of 4-byte elements: 20-byte header, then per element a 4-byte length and the
    -- big-endian value; the values are reversed byte by byte and concatenated (an empty array: 12 bytes -> '')
    SELECT coalesce(string_agg(substr(sent, p + 8, 1) || substr(sent, p + 7, 1) || substr(sent, p + 6, 1)
                               || substr(sent, p + 5, 1), ''::bytea ORDER BY p), ''::bytea)
    FROM generate_series(20, length(sent) - 8, 8) AS p
$$;

CREATE FUNCTION rl_action_versions(ranges int4[], versions int4[]) RETURNS int4[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    -- the weight version at each non-empty range's first token (NULL for an empty range)
    SELECT coalesce(array_agg(CASE WHEN ranges[i][2] > ranges[i][1] THEN versions[ranges[i][1] + 1] END ORDER BY i),
                    '{}'::int4[])
    FROM generate_subscripts(ranges, 1) AS i
$$;

CREATE FUNCTION rl_trajectories_pack() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.token_ids_le IS NULL OR (TG_OP = 'UPDATE' AND NEW.token_ids IS DISTINCT FROM OLD.token_ids
                                    AND NEW.token_ids_le IS NOT DISTINCT FROM OLD.token_ids_le) THEN
        NEW.token_ids_le := rl_pack_le(array_send(NEW.token_ids));
    END IF;
    IF NEW.logprobs_le IS NULL OR (TG_OP = 'UPDATE' AND NEW.logprobs IS DISTINCT FROM OLD.logprobs
                                   AND NEW.logprobs_le IS NOT DISTINCT FROM OLD.logprobs_le) THEN
        NEW.logprobs_le := rl_pack_le(array_send(NEW.logprobs));
    END IF;
    IF NEW.action_versions IS NULL OR (TG_OP = 'UPDATE'
            AND (NEW.action_ranges, NEW.weight_versions) IS DISTINCT FROM (OLD.action_ranges, OLD.weight_versions)
            AND NEW.action_versions IS NOT DISTINCT FROM OLD.action_versions) THEN
        NEW.action_versions := rl_action_versions(NEW.action_ranges, NEW.weight_versions);
    END IF;
    RETURN NEW;
END $$;
"""


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories ADD COLUMN token_ids_le bytea, ADD COLUMN logprobs_le bytea, "
               "ADD COLUMN action_versions int4[]")
    op.execute(PACK)
    op.execute("UPDATE trajectories SET token_ids_le = rl_pack_le(array_send(token_ids)), "
               "logprobs_le = rl_pack_le(array_send(logprobs)), "
               "action_versions = rl_action_versions(action_ranges, weight_versions)")
    op.execute("ALTER TABLE trajectories ALTER COLUMN token_ids_le SET NOT NULL, "
               "ALTER COLUMN logprobs_le SET NOT NULL, ALTER COLUMN action_versions SET NOT NULL, "
               "ADD CONSTRAINT ck_trajectories_action_versions "
               "CHECK (cardinality(action_versions) = coalesce(array_length(action_ranges, 1), 0)), "
               "ADD CONSTRAINT ck_trajectories_token_ids_le "
               "CHECK (octet_length(token_ids_le) = 4 * cardinality(token_ids)), "
               "ADD CONSTRAINT ck_trajectories_logprobs_le CHECK (octet_length(logprobs_le) = 4 * cardinality(logprobs))")
    op.execute("COMMENT ON COLUMN trajectories.token_ids_le IS "
               "'token_ids packed as little-endian int32 (the exporter''s copy; filled when not given)'")
    op.execute("COMMENT ON COLUMN trajectories.logprobs_le IS "
               "'logprobs packed as little-endian float32 (the exporter''s copy; filled when not given)'")
    op.execute("COMMENT ON COLUMN trajectories.action_versions IS "
               "'weight version of each action range (NULL for an empty range; filled when not given)'")
    op.execute("CREATE TRIGGER trajectories_pack BEFORE INSERT OR UPDATE ON trajectories "
               "FOR EACH ROW EXECUTE FUNCTION rl_trajectories_pack()")


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS trajectories_pack ON trajectories")
    op.execute("DROP FUNCTION IF EXISTS rl_trajectories_pack()")
    op.execute("ALTER TABLE trajectories DROP COLUMN IF EXISTS token_ids_le, DROP COLUMN IF EXISTS logprobs_le, "
               "DROP COLUMN IF EXISTS action_versions")
    op.execute("DROP FUNCTION IF EXISTS rl_action_versions(int4[], int4[])")
    op.execute("DROP FUNCTION IF EXISTS rl_pack_le(bytea)")
