"""Versioned reward functions and re-scoring of stored trajectories (no rollout runs again).

A reward function takes a ``RewardInput`` (the stored trajectory, its task and the text of its kept actions and
observations) and returns a score (float or None), or ``(score, info)``. It is named and versioned: the scores of
``(name, version)`` are kept per episode in ``reward_scores`` (with the trajectory attempt scored), and the
exporter uses them with ``--reward NAME@VERSION``. Register one by ``module:function``, or use a built-in.
Re-running the same (name, version) scores only trajectories it has not scored yet (or whose attempt changed):
a version is immutable; change the function, bump the version.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from psycopg.types.json import Jsonb

from rollout_ledger.client.selection import Selection
from rollout_ledger.client.source import connect, stream
from rollout_ledger.shared.errors import RolloutError


class RewardError(RolloutError):
    """A reward function could not be loaded, or raised / returned something that is not a score."""


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one stored trajectory."""

    episode_id: str
    group_id: str
    env: str
    task: Any
    status: str
    rollout_reward: float | None
    actions: list[str]
    """The kept turns' decoded actions, in turn order."""
    observations: list[str]
    """The environment's answer to each kept turn."""
    token_ids: np.ndarray
    loss_mask: np.ndarray
    num_turns: int
    num_sampled_tokens: int


RewardFn = Callable[[RewardInput], "float | tuple[float | None, Mapping[str, Any]] | None"]


def length_penalty(x: RewardInput) -> float | None:
    """The rollout's reward minus 0.001 per sampled token (None stays None)."""
    return None if x.rollout_reward is None else x.rollout_reward - 0.001 * x.num_sampled_tokens


def success(x: RewardInput) -> float:
    """1.0 when the episode completed with a positive reward, else 0.0."""
    return 1.0 if x.status == "completed" and (x.rollout_reward or 0.0) > 0 else 0.0


BUILTINS: dict[str, tuple[str, RewardFn]] = {
    "length_penalty": ("1", length_penalty),
    "success": ("1", success),
}
"""Built-in reward functions: name -> (version, function)."""


@dataclass(frozen=True)
class RewardFunction:
    name: str
    version: str
    fn: RewardFn


def resolve(name: str, version: str | None = None, ref: str | None = None) -> RewardFunction:
    """A built-in by name, or ``module:function`` (which then needs an explicit version)."""
    if ref:
        if not version:
            raise RewardError(f"--version is required with --fn {ref} (scores are kept per name and version)")
        module, sep, attr = ref.partition(":")
        if not sep:
            raise RewardError(f"reward function must be module:function, got {ref!r}")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise RewardError(f"cannot load reward function {ref}: {exc}") from exc
        if not callable(fn):
            raise RewardError(f"{ref} is not callable")
        return RewardFunction(name, version, fn)
    if name not in BUILTINS:
        raise RewardError(f"unknown built-in reward {name!r} (known: {', '.join(BUILTINS)}); or pass --fn module:fn")
    builtin_version, fn = BUILTINS[name]
    if version and version != builtin_version:
        raise RewardError(f"built-in {name} is at version {builtin_version}, not {version}")
    return RewardFunction(name, builtin_version, fn)


def _score(rf: RewardFunction, x: RewardInput) -> tuple[float | None, dict[str, Any]]:
    try:
        out = rf.fn(x)
    except Exception as exc:
        raise RewardError(f"reward {rf.name}@{rf.version} raised on {x.episode_id}: {exc!r}") from exc
    info: dict[str, Any] = {}
    if isinstance(out, tuple):
        out, extra = out
        info = json.loads(json.dumps(dict(extra), default=str))
    if out is not None and not isinstance(out, int | float):
        raise RewardError(f"reward {rf.name}@{rf.version} returned {type(out).__name__} for {x.episode_id}")
    return (None if out is None else float(out)), info


@dataclass
class RescoreResult:
    scored: int
    skipped: int


def rescore(database_url: str, rf: RewardFunction, sel: Selection, chunk: int = 500) -> RescoreResult:
    """Score every selected trajectory not yet scored by ``rf`` (at its current attempt); one commit per chunk."""
    sel = replace(sel, reward=None)
    result = RescoreResult(0, 0)
    with connect(database_url) as conn:
        for rows in stream(database_url, sel, chunk):
            ids = [r["episode_id"] for r in rows]
            done = {(e, a) for e, a in conn.execute(
                "SELECT episode_id, attempt FROM reward_scores WHERE episode_id = ANY(%s) AND reward_name = %s "
                "AND reward_version = %s", (ids, rf.name, rf.version)).fetchall()}
            todo = [r for r in rows if (r["episode_id"], r["attempt"]) not in done]
            result.skipped += len(rows) - len(todo)
            if not todo:
                continue
            texts: dict[str, tuple[list[str], list[str]]] = {
                e: (list(a), list(o)) for e, a, o in conn.execute(
                    "SELECT s.episode_id, array_agg(s.action ORDER BY s.turn_index), "
                    "array_agg(s.observation ORDER BY s.turn_index) FROM steps s "
                    "JOIN unnest(%s::text[], %s::int4[]) AS q(eid, att) ON s.episode_id = q.eid AND s.attempt = q.att "
                    "WHERE NOT s.superseded GROUP BY s.episode_id",
                    ([r["episode_id"] for r in todo], [r["attempt"] for r in todo])).fetchall()}
            params = []
            for r in todo:
                actions, observations = texts.get(r["episode_id"], ([], []))
                score, info = _score(rf, RewardInput(
                    r["episode_id"], r["group_id"], r["env"], r["task"], r["status"], r["rollout_reward"], actions,
                    observations, r["token_ids"], r["loss_mask"], r["num_turns"], r["num_sampled_tokens"]))
                params.append((r["episode_id"], rf.name, rf.version, r["attempt"], score, Jsonb(info)))
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO reward_scores (episode_id, reward_name, reward_version, attempt, score, info) "
                    "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (episode_id, reward_name, reward_version) DO UPDATE "
                    "SET attempt = excluded.attempt, score = excluded.score, info = excluded.info, scored_at = now() "
                    "WHERE reward_scores.attempt <> excluded.attempt", params)
            result.scored += len(todo)
    return result
