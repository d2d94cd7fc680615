"""Which trajectories an export takes, as one server-side SQL query (no Python filtering of the whole store).

Row filters (batch, env, status, reward range, time range, weight-version window) apply first; the group filters
(complete groups only, drop groups whose rewards are all equal) and the group advantages are computed over the
rows that passed them, with one ``GROUP BY group_id`` over keys only; the token arrays are read for the rows
finally selected, in (group, episode) order, as packed little-endian bytes (``rows.py`` reads them).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_ledger.services.exporter.advantages import AdvantageSpec
from rollout_ledger.shared.lifecycle import TERMINAL


@dataclass(frozen=True)
class RewardChoice:
    """A re-score to use as the reward instead of the rollout's own (``rollout rescore`` wrote it)."""

    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> RewardChoice | None:
        """``name@version``; ``rollout`` (or empty) means the rollout's own reward."""
        if not text or text == "rollout":
            return None
        name, sep, version = text.partition("@")
        if not sep or not name or not version:
            raise ValueError(f"reward must be 'rollout' or NAME@VERSION, got {text!r}")
        return cls(name, version)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Selection:
    """What to export. Empty tuples and ``None`` mean "no filter"."""

    batch_ids: tuple[str, ...] = ()
    envs: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    """Trajectory statuses kept (completed, truncated, aborted, failed); empty keeps all."""
    reward_min: float | None = None
    reward_max: float | None = None
    since: dt.datetime | None = None
    """Trajectories recorded at or after this time."""
    until: dt.datetime | None = None
    """Trajectories recorded before this time."""
    version: int | None = None
    """The trainer's current weight version V (with ``max_staleness``)."""
    max_staleness: int | None = None
    """Keep trajectories whose every sampled token came from a version in [V - k, V]."""
    complete_groups: bool = False
    """Keep a group only when every episode of it is terminal and has a selected trajectory."""
    drop_uniform: bool = False
    """Drop groups whose selected rewards are all equal (no learning signal for group baselines)."""
    reward: RewardChoice | None = None
    advantage: AdvantageSpec = field(default_factory=AdvantageSpec)

    def __post_init__(self) -> None:
        if self.max_staleness is not None and (self.version is None or self.max_staleness < 0):
            raise ValueError("a staleness window needs --version V and --max-staleness k >= 0")
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward range is empty: {self.reward_min} > {self.reward_max}")
        if self.since and self.until and self.since >= self.until:
            raise ValueError("time range is empty: since >= until")

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward"] = str(self.reward) if self.reward else "rollout"
        out["advantage"] = self.advantage.describe()
        for key in ("since", "until"):
            if out[key] is not None:
                out[key] = out[key].isoformat()
        return out


@dataclass(frozen=True)
class Scope:
    """Restricts a query to what a cursor read announced (``cursor.py``)."""

    groups: Sequence[str]
    """Group statistics (and, without ``rows``, the output) cover these groups only."""
    rows: Sequence[tuple[str, int]] | None = None
    """When set, output only these (episode_id, attempt) trajectory versions."""


_TERMINAL_SQL = "{" + ",".join(sorted(str(s) for s in TERMINAL)) + "}"

KEY_COLUMNS = ("episode_id", "attempt", "reward", "advantage", "group_size")
"""What the selection query returns, in export order: the rows are read by ``rows_query`` chunk by chunk."""

ROW_SQL = {
    "episode_id": "t.episode_id", "batch_id": "t.batch_id", "group_id": "t.group_id", "group_index": "e.group_index",
    "env": "t.env", "attempt": "t.attempt", "status": "t.status", "failure_class": "t.failure_class",
    "rollout_reward": "t.reward", "token_ids": "t.token_ids_le", "logprobs": "t.logprobs_le",
    "range_versions": "t.action_versions",
    "action_ranges": "t.action_ranges", "segments": "t.segments", "num_segments": "t.num_segments",
    "token_check": "t.token_check", "drifts": "t.drifts", "prompt_len": "t.prompt_len", "num_tokens": "t.num_tokens",
    "num_sampled_tokens": "t.num_sampled_tokens", "num_turns": "t.num_turns", "created_at": "t.created_at",
    "task": "e.task", "prompt_text": "e.prompt_text",
}
"""Each field of a stored row and the SQL that reads it. ``token_ids`` and ``logprobs`` come as their packed
little-endian copies; ``loss_mask`` and ``weight_versions`` are not read: ``rows.rebuild_flat`` derives them
from ``action_ranges`` and each range's weight version (``range_versions``, stored as ``action_versions``)."""

ROW_COLUMNS = tuple(ROW_SQL)
ALWAYS_READ = ("episode_id", "attempt", "token_ids", "logprobs", "range_versions", "action_ranges", "segments",
               "num_tokens")
"""What every read takes, whatever the record shape (a ``Chunk`` needs them)."""


PACKED_FIELDS = ("token_ids", "logprobs")
"""Fields read as packed bytes: a chunk's values come concatenated, with each row's byte length."""
JSON_FIELDS = ("task", "drifts")
"""jsonb fields: a chunk's values come as one JSON array (``json_agg``: one text rendering per value, where an
``array_agg`` of jsonb costs the server a ``jsonb_send`` call and an array element per value, six times as much)."""
PAIR_FIELDS = ("action_ranges", "segments", "range_versions")
"""Small per-row int arrays: a chunk's values come as one comma-separated text (NULL as -1), with each row's
number of values."""


def rows_query(fields: Collection[str] | None = None) -> tuple[str, tuple[str, ...]]:
    """The query reading one chunk of selected episodes (``%(ids)s``, in export order) as ONE row: a column per
    field holding the chunk's values in the ids' order (``array_agg``; packed bytes concatenated, small int arrays
    as text, each with per-row lengths; jsonb as one JSON array), so the client turns a chunk into a few arrays
    instead of one Python object per field and row. Returns the query and the fields: ``fields`` (all when None)
    plus ``ALWAYS_READ``, each ``PACKED_FIELDS`` / ``PAIR_FIELDS`` entry taking two columns (values, per-row
    lengths).

    The rows reach the aggregates in the ids' order from a subquery sorted by the ids' position (``OFFSET 0``
    keeps it a subquery; Postgres sorts the 500 positions before the index lookups): one sort per chunk where an
    ``ORDER BY`` in each aggregate sorted every column on its own. A plain aggregate over a sorted subquery takes
    the rows in that order (the read runs without parallel workers, ``SERIAL_READ``); ``source.assemble`` checks
    the episode ids against the keys all the same.
    """
    wanted = set(ROW_COLUMNS if fields is None else fields) | set(ALWAYS_READ)
    unknown = wanted - set(ROW_SQL)
    if unknown:
        raise ValueError(f"unknown row fields: {', '.join(sorted(unknown))}")
    names = tuple(c for c in ROW_COLUMNS if c in wanted)
    cols = []
    for c in names:
        if c in PACKED_FIELDS:
            cols += [f"string_agg(s.{c}, ''::bytea)", f"array_agg(octet_length(s.{c}))"]
        elif c in PAIR_FIELDS:
            cols += [f"string_agg(nullif(array_to_string(s.{c}, ',', '-1'), ''), ',')",
                     f"array_agg(cardinality(s.{c}))"]
        elif c in JSON_FIELDS:
            cols.append(f"json_agg(s.{c})")
        else:
            cols.append(f"array_agg(s.{c})")
    episodes = any(ROW_SQL[c].startswith("e.") for c in names)
    return ("SELECT " + ", ".join(cols) + " FROM (SELECT " + ", ".join(f"{ROW_SQL[c]} AS {c}" for c in names)
            + " FROM unnest(%(ids)b::text[]) WITH ORDINALITY AS k(id, ord) JOIN trajectories t ON t.episode_id = k.id"
            + (" JOIN episodes e ON e.id = k.id" if episodes else "") + " ORDER BY k.ord OFFSET 0) s"), names


SERIAL_READ = "SET LOCAL max_parallel_workers_per_gather = 0"
"""Run on a connection before ``rows_query`` (in its transaction): no parallel plan may interleave the rows."""


def build_query(sel: Selection, scope: Scope | None = None) -> tuple[str, dict[str, Any]]:
    """The selection as SQL (psycopg ``%(name)s`` parameters) returning ``KEY_COLUMNS`` in (group, episode) order.

    Only keys are sorted; the wide rows are read afterwards by ``rows_query`` (sorting rows with their token
    arrays spilled to disk and cost more than the rest of the export).
    """
    params: dict[str, Any] = {"adv_epsilon": sel.advantage.epsilon}
    where: list[str] = []
    reward = "t.reward"
    reward_join = ""
    if sel.reward is not None:
        reward = "rs.score"
        reward_join = ("JOIN reward_scores rs ON rs.episode_id = t.episode_id AND rs.attempt = t.attempt "
                       "AND rs.reward_name = %(reward_name)s AND rs.reward_version = %(reward_version)s")
        params.update(reward_name=sel.reward.name, reward_version=sel.reward.version)
    if sel.batch_ids:
        where.append("t.batch_id = ANY(%(batch_ids)s)")
        params["batch_ids"] = list(sel.batch_ids)
    if sel.envs:
        where.append("t.env = ANY(%(envs)s)")
        params["envs"] = list(sel.envs)
    if sel.statuses:
        where.append("t.status = ANY(%(statuses)s)")
        params["statuses"] = list(sel.statuses)
    if sel.reward_min is not None:
        where.append(f"{reward} >= %(reward_min)s")
        params["reward_min"] = sel.reward_min
    if sel.reward_max is not None:
        where.append(f"{reward} <= %(reward_max)s")
        params["reward_max"] = sel.reward_max
    if sel.since is not None:
        where.append("t.created_at >= %(since)s")
        params["since"] = sel.since
    if sel.until is not None:
        where.append("t.created_at < %(until)s")
        params["until"] = sel.until
    if sel.version is not None:
        # episodes.weight_versions: the distinct versions of the kept turns (short); per-token ones as fallback.
        versions = "coalesce(e.weight_versions, t.weight_versions)"
        lo = sel.version - (sel.max_staleness if sel.max_staleness is not None else 0)
        where.append(f"(SELECT min(v) FROM unnest({versions}) v WHERE v >= 0) >= %(version_lo)s")
        where.append(f"(SELECT max(v) FROM unnest({versions}) v WHERE v >= 0) <= %(version_hi)s")
        params.update(version_lo=lo, version_hi=sel.version)
    if scope is not None:
        where.append("t.group_id = ANY(%(scope_groups)s)")
        params["scope_groups"] = list(scope.groups)
    final: list[str] = []
    if sel.complete_groups:
        final.append("g.members = (SELECT count(*) FROM episodes ge WHERE ge.group_id = s.group_id)")
        final.append("NOT EXISTS (SELECT 1 FROM episodes ge WHERE ge.group_id = s.group_id "
                     "AND NOT ge.status = ANY(%(terminal)s::text[]))")
        params["terminal"] = _TERMINAL_SQL
    if sel.drop_uniform:
        final.append("g.hi > g.lo")
    if scope is not None and scope.rows is not None:
        final.append("(s.episode_id, s.attempt) IN (SELECT * FROM unnest(%(scope_eids)s::text[], "
                     "%(scope_attempts)s::int4[]))")
        params["scope_eids"] = [r[0] for r in scope.rows]
        params["scope_attempts"] = [r[1] for r in scope.rows]
    advantage = sel.advantage.sql("s.reward", "g.mean", "g.std", "g.total", "g.n")
    query = (
        "WITH sel AS ("
        f" SELECT t.episode_id, t.group_id, t.attempt, ({reward})::float8 AS reward FROM trajectories t"
        f" JOIN episodes e ON e.id = t.episode_id {reward_join}"
        f" WHERE {' AND '.join(where) if where else 'TRUE'}"
        "), grp AS ("
        " SELECT group_id, count(*) AS members, count(reward) AS n, avg(reward) AS mean,"
        " stddev_samp(reward) AS std, sum(reward) AS total, min(reward) AS lo, max(reward) AS hi"
        " FROM sel GROUP BY group_id"
        ") "
        f"SELECT s.episode_id, s.attempt, s.reward, {advantage} AS advantage, g.members AS group_size "
        "FROM sel s JOIN grp g ON g.group_id = s.group_id "
        f"WHERE {' AND '.join(final) if final else 'TRUE'} "
        "ORDER BY s.group_id, s.episode_id"
    )
    return query, params
