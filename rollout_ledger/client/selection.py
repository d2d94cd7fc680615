"""Which trajectories an export takes, as one server-side SQL query (no Python filtering of the whole store).

Row filters (batch, env, status, reward range, time range, weight-version window, single segment) apply first;
the group filters (complete groups only, drop groups whose rewards are all equal) and the group advantages are
computed over the rows that passed them, over narrow keys only; the wide fields are fetched for the rows finally
selected, in (group, episode) order, the token arrays as packed little-endian bytes (``stream_query``;
``source.py`` reads it).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_ledger.client.advantages import AdvantageSpec
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


class BeyondStaleness(enum.StrEnum):
    """What an export does with trajectories whose tokens span more versions than their batch's ``max_staleness``
    (``v_trajectory_versions.beyond_staleness``; a batch without a bound has none)."""

    INCLUDE = "include"
    """Keep them with the others (the default)."""
    EXCLUDE = "exclude"
    """Leave them out."""
    ONLY = "only"
    """Take only them."""


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
    """Keep a group only when every episode of it is terminal and every trajectory of it is selected (an episode
    that ended without a trajectory does not hold its group back)."""
    drop_uniform: bool = False
    """Drop groups whose selected rewards are all equal (no learning signal for group baselines)."""
    beyond_staleness: BeyondStaleness = BeyondStaleness.INCLUDE
    """Trajectories spanning more versions than their batch's ``max_staleness``: include, exclude or only them."""
    reward: RewardChoice | None = None
    advantage: AdvantageSpec = field(default_factory=AdvantageSpec)
    single_segment: bool = False
    """Keep only trajectories stored as one segment (``num_segments`` <= 1), for trainers that take one sequence
    per sample: every context the policy saw extended the one before. A row filter: with ``complete_groups``, a
    group with a multi-segment member is left out whole."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "beyond_staleness", BeyondStaleness(self.beyond_staleness))  # ValueError: unknown
        if self.max_staleness is not None and (self.version is None or self.max_staleness < 0):
            raise ValueError("a staleness window needs --version V and --max-staleness k >= 0")
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward range is empty: {self.reward_min} > {self.reward_max}")
        if self.since and self.until and self.since >= self.until:
            raise ValueError("time range is empty: since >= until")

    def as_json(self) -> dict[str, Any]:
        """Every field as JSON (stored with a consumer's cursor; ``retention.stored_selection`` reads it back)."""
        out = asdict(self)
        out["reward"] = str(self.reward) if self.reward else "rollout"
        out["advantage"] = self.advantage.describe()
        out["beyond_staleness"] = str(self.beyond_staleness)
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
"""What ``stream_query`` returns first for each selected trajectory, before its row fields."""

ROW_SQL = {
    "episode_id": "t.episode_id", "batch_id": "t.batch_id", "group_id": "t.group_id", "group_index": "e.group_index",
    "env": "t.env", "attempt": "t.attempt", "status": "t.status", "failure_class": "t.failure_class",
    "rollout_reward": "t.reward", "token_ids": "t.token_ids_le", "logprobs": "t.sampled_logprobs_le",
    "range_versions": "t.action_versions",
    "action_ranges": "t.action_ranges", "segments": "t.segments", "num_segments": "t.num_segments",
    "token_check": "t.token_check", "drifts": "t.drifts", "prompt_len": "t.prompt_len", "num_tokens": "t.num_tokens",
    "num_sampled_tokens": "t.num_sampled_tokens", "num_turns": "t.num_turns", "created_at": "t.created_at",
    "task": "e.task", "task_index": "e.task_index", "prompt_text": "e.prompt_text",
}
"""Each field of a stored row and the SQL that reads it. ``token_ids`` comes as its packed little-endian copy,
``logprobs`` as the packed logprobs of the sampled tokens only (``sampled_logprobs_le``); ``loss_mask`` and
``weight_versions`` are not read: ``rows`` derives them (and lays the logprobs back, 0.0 elsewhere) from
``action_ranges`` and each range's weight version (``range_versions``, stored as ``action_versions``)."""

ROW_COLUMNS = tuple(ROW_SQL)
ALWAYS_READ = ("episode_id", "attempt", "token_ids", "logprobs", "range_versions", "action_ranges", "segments",
               "num_tokens")
"""What every read takes, whatever the record shape (a ``Chunk`` needs them)."""


PACKED_FIELDS = ("token_ids", "logprobs")
"""Fields read as packed little-endian bytes (``bytea``)."""
PAIR_FIELDS = ("action_ranges", "segments", "range_versions")
"""Small per-row ``int4[]`` arrays (2-D ones arrive flattened: ``[start, end)`` pairs)."""


@dataclass(frozen=True)
class _Filters:
    """A selection as SQL pieces over ``trajectories t JOIN episodes e``: the reward expression (and its join),
    the row filters, the group filters over a group's statistics (placeholders ``{members}``, ``{hi}``, ``{lo}``
    for them, ``{group}`` for the group), and a scope's trajectory versions (``rows``: applied after the group
    statistics, which cover every stored member)."""

    reward: str
    reward_join: str
    where: list[str]
    final: list[str]
    params: dict[str, Any]
    rows: str | None = None

    def final_sql(self, **names: str) -> str:
        return " AND ".join(f.format(**names) for f in self.final) if self.final else "TRUE"


def _filters(sel: Selection, scope: Scope | None = None) -> _Filters:
    params: dict[str, Any] = {"adv_epsilon": sel.advantage.epsilon}
    where: list[str] = []
    reward = "t.reward"
    reward_join = ""
    if sel.reward is not None:
        reward = "rs.score"
        reward_join = ("JOIN reward_scores rs ON rs.episode_id = t.episode_id AND rs.attempt = t.attempt "
                       "AND rs.reward_name = %(reward_name)s AND rs.reward_version = %(reward_version)s")
        params.update(reward_name=sel.reward.name, reward_version=sel.reward.version)
    # batch and group filters name both tables (an episode and its trajectory share them): Postgres then reads
    # only those episodes by index, where a join condition alone made it hash every episode of the store
    if sel.batch_ids:
        where.append("t.batch_id = ANY(%(batch_ids)s) AND e.batch_id = ANY(%(batch_ids)s)")
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
    if sel.single_segment:  # a trajectory without recorded segments is read as one (``Chunk.build``)
        where.append("t.num_segments <= 1")
    if sel.since is not None:
        where.append("t.created_at >= %(since)s")
        params["since"] = sel.since
    if sel.until is not None:
        where.append("t.created_at < %(until)s")
        params["until"] = sel.until
    # episodes.weight_versions: the distinct versions of the kept turns (short); per-token ones as fallback.
    versions = "coalesce(e.weight_versions, t.weight_versions)"
    if sel.beyond_staleness is not BeyondStaleness.INCLUDE:
        beyond = (f"coalesce((SELECT max(v) - min(v) FROM unnest({versions}) v WHERE v >= 0) > "
                  "(SELECT b.max_staleness FROM batches b WHERE b.id = t.batch_id), false)")
        where.append(beyond if sel.beyond_staleness is BeyondStaleness.ONLY else f"NOT {beyond}")
    if sel.version is not None:
        lo = sel.version - (sel.max_staleness if sel.max_staleness is not None else 0)
        where.append(f"(SELECT min(v) FROM unnest({versions}) v WHERE v >= 0) >= %(version_lo)s")
        where.append(f"(SELECT max(v) FROM unnest({versions}) v WHERE v >= 0) <= %(version_hi)s")
        params.update(version_lo=lo, version_hi=sel.version)
    if scope is not None:
        where.append("t.group_id = ANY(%(scope_groups)s) AND e.group_id = ANY(%(scope_groups)s)")
        params["scope_groups"] = list(scope.groups)
    final: list[str] = []
    if sel.complete_groups:
        # every stored trajectory of the group selected, and every episode ended: an episode that ended without a
        # trajectory (failed before its first turn, cancelled) has nothing to train on and does not hold it back
        final.append("{members} = (SELECT count(*) FROM trajectories gt WHERE gt.group_id = {group})")
        final.append("NOT EXISTS (SELECT 1 FROM episodes ge WHERE ge.group_id = {group} "
                     "AND NOT ge.status = ANY(%(terminal)s::text[]))")
        params["terminal"] = _TERMINAL_SQL
    if sel.drop_uniform:
        final.append("{hi} > {lo}")
    rows = None
    if scope is not None and scope.rows is not None:
        rows = "(episode_id, attempt) IN (SELECT * FROM unnest(%(scope_eids)s::text[], %(scope_attempts)s::int4[]))"
        params["scope_eids"] = [r[0] for r in scope.rows]
        params["scope_attempts"] = [r[1] for r in scope.rows]
    return _Filters(reward, reward_join, where, final, params, rows)


def stream_query(sel: Selection, fields: Collection[str] | None = None, scope: Scope | None = None,
                 partition: tuple[dt.datetime | None, dt.datetime] | None = None,
                 ) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    """The selection as ONE query returning ``KEY_COLUMNS`` and then the row fields of every selected trajectory,
    in (group, episode) order: what a one-shot export streams (``source.stream``) and a consumer read takes within
    its ``scope`` (``source.fetch``).

    Late materialisation: an inner query selects and orders KEYS only (the row filters, the group statistics as
    window functions over each group (summed in episode order, so an advantage does not change with the plan
    down to the last bit), the group filters as a semi-join on the groups that pass
    them), carrying each row's physical address (``ctid``, and its episode's); the outer query fetches the wide
    fields of each key by that address (a TID scan: no index lookup) in a ``LATERAL`` subquery that ``OFFSET 0``
    keeps parameterised, so it runs as a nested loop that keeps the keys' order. Postgres sorts a few narrow
    columns (never the token arrays, whatever plan it picks for the filters: an index for a selective batch, a
    sequential scan for the whole store), and the result streams under ``COPY`` as under a cursor. Both parts
    run in one statement, so one snapshot: a key's tuple is visible at its address for the whole read.

    ``trajectories`` is partitioned by month of ``episode_created_at`` (migration 0018): an address is one within
    a partition, so the keys carry the partition key too, and the fetch names it beside the address (Postgres
    prunes the fetch to that key's partition at run time). ``partition`` ``(lo, hi)`` keeps the trajectories whose
    key is in ``[lo, hi)`` (``lo`` None: unbounded; what `rollout archive` writes of a period).

    Returns the query, its parameters and the row fields in the order they follow the keys (``episode_id`` and
    ``attempt`` are keys, not repeated). Fields come as stored: packed bytes for ``PACKED_FIELDS``, ``int4[]``
    for ``PAIR_FIELDS``, jsonb for ``JSON_FIELDS``.
    """
    wanted = set(ROW_COLUMNS if fields is None else fields) | set(ALWAYS_READ)
    unknown = wanted - set(ROW_SQL)
    if unknown:
        raise ValueError(f"unknown row fields: {', '.join(sorted(unknown))}")
    names = tuple(c for c in ROW_COLUMNS if c in wanted and c not in ("episode_id", "attempt"))
    f = _filters(sel, scope)
    r = f"({f.reward})::float8"
    advantage = sel.advantage.sql(r, f"avg({r}) OVER g", f"stddev_samp({r}) OVER g", f"sum({r}) OVER g",
                                  f"count({r}) OVER g")
    source = f"FROM trajectories t JOIN episodes e ON e.id = t.episode_id {f.reward_join}"
    if partition is not None:
        lo, hi = partition
        if lo is not None:
            f.where.append("t.episode_created_at >= %(partition_lo)s")
            f.params["partition_lo"] = lo
        f.where.append("t.episode_created_at < %(partition_hi)s")
        f.params["partition_hi"] = hi
    where = list(f.where)
    if f.final:
        where.append(f"t.group_id IN (SELECT t.group_id {source} WHERE {' AND '.join(f.where) or 'TRUE'} "
                     f"GROUP BY t.group_id HAVING "
                     f"{f.final_sql(members='count(*)', hi=f'max({r})', lo=f'min({r})', group='t.group_id')})")
    keys = (f"SELECT t.ctid AS tid, t.episode_created_at AS tkey, e.ctid AS eid, t.group_id AS gid, t.episode_id, "
            f"t.attempt, {r} AS reward, "
            f"{advantage} AS advantage, count(*) OVER g AS group_size {source} "
            f"WHERE {' AND '.join(where) or 'TRUE'} WINDOW g AS (PARTITION BY t.group_id ORDER BY t.episode_id "
            "ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) ORDER BY t.group_id, t.episode_id")
    if f.rows:  # the scope's versions, after the group statistics; sorted again while the keys are narrow
        keys = f"SELECT * FROM ({keys}) s WHERE {f.rows} ORDER BY gid, episode_id"
    episodes = any(ROW_SQL[c].startswith("e.") for c in names)
    fetch = ("SELECT " + ", ".join(f"{ROW_SQL[c]} AS {c}" for c in names) + " FROM trajectories t"
             + (", episodes e WHERE e.ctid = k.eid AND" if episodes else " WHERE")
             + " t.episode_created_at = k.tkey AND t.ctid = k.tid OFFSET 0")
    query = (f"SELECT k.episode_id, k.attempt, k.reward, k.advantage, k.group_size, w.* FROM ({keys}) k "
             f"CROSS JOIN LATERAL ({fetch}) w ORDER BY k.gid, k.episode_id")
    return query, f.params, names
