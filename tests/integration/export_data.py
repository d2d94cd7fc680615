"""Synthetic batches, episodes and trajectories written with SQL, for the exporter's tests and benchmark."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from rollout_ledger.client.source import libpq_url
from rollout_ledger.shared.ids import step_id, turn_request_id


@dataclass
class Traj:
    """One episode and its trajectory: segments of (context length, [(sampled, observation) per turn])."""

    reward: float | None = 1.0
    status: str = "completed"
    segments: Sequence[tuple[int, Sequence[tuple[int, int]]]] = ((4, ((3, 2),)),)
    versions: Sequence[int] | None = None
    """Weight version of each turn (all turns, in order); default 1."""
    episode_status: str | None = None
    """Episode status when it differs from the trajectory's (None: the same)."""
    with_trajectory: bool = True
    attempt: int = 1
    actions: Sequence[str] | None = None
    """Action text of each turn for ``seed_turns`` (default ``action {k}``)."""


@dataclass
class Arrays:
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    weight_versions: np.ndarray
    action_ranges: list[list[int]]
    segments: list[list[int]]
    prompt_len: int
    num_turns: int
    versions: list[int] = field(default_factory=list)


def arrays(t: Traj, seed: int = 0) -> Arrays:
    """Aligned arrays of ``t`` (token ids count up from ``seed * 1000``; logprobs are -(position+1)/100)."""
    ids: list[int] = []
    mask: list[int] = []
    versions: list[int] = []
    ranges: list[list[int]] = []
    segments: list[list[int]] = []
    turn_versions = list(t.versions) if t.versions is not None else [1] * sum(len(s[1]) for s in t.segments)
    k = 0
    for ctx, turns in t.segments:
        start = len(ids)
        ids += [seed * 1000 + len(ids) + i for i in range(ctx)]
        mask += [0] * ctx
        versions += [-1] * ctx
        for sampled, obs in turns:
            a = len(ids)
            ids += [seed * 1000 + a + i for i in range(sampled)]
            mask += [1] * sampled
            versions += [turn_versions[k]] * sampled
            ranges.append([a, a + sampled])
            k += 1
            ids += [seed * 1000 + len(ids) + i for i in range(obs)]
            mask += [0] * obs
            versions += [-1] * obs
        segments.append([start, len(ids)])
    tok = np.array(ids, np.int32)
    m = np.array(mask, np.int32)
    lp = np.where(m == 1, -(np.arange(len(ids)) + 1) / 100.0, 0.0).astype(np.float32)
    return Arrays(tok, m, lp, np.array(versions, np.int32), ranges, segments, t.segments[0][0], k,
                  sorted(set(turn_versions)))


def seed_batch(database_url: str, batch_id: str, groups: Sequence[Sequence[Traj]], env: str = "arithmetic",
               created_at: str | None = None) -> list[list[str]]:
    """Insert a batch with one group per entry of ``groups``; returns the episode ids per group. ``created_at``:
    when its episodes were created and its trajectories written (now by default)."""
    out: list[list[str]] = []
    with psycopg.connect(libpq_url(database_url)) as conn, conn.cursor() as cur:
        cur.execute("SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'trajectories' "
                    "AND column_name = 'episode_created_at')")  # migration 0017 (a test may run before it)
        row = cur.fetchone()
        keyed = bool(row and row[0])
        size = max(len(g) for g in groups)
        cur.execute(
            "INSERT INTO batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, request_hash) "
            "VALUES (%s, %s, %s, 4, '{}', %s, %s, 'x')",
            (batch_id, env, size, len(groups), sum(len(g) for g in groups)))
        for ti, group in enumerate(groups):
            gid = f"{batch_id}.{ti}"
            ids = []
            for gi, t in enumerate(group):
                eid = f"{gid}.{gi}"
                ids.append(eid)
                a = arrays(t, seed=ti * 10 + gi)
                cur.execute(
                    "INSERT INTO episodes (id, batch_id, group_id, group_index, task_index, env, task, status, "
                    "attempt, reward, num_turns, weight_versions, prompt_text, started_at, finished_at, created_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now() - interval '2 seconds', "
                    "now(), coalesce(%s::timestamptz, now()))",
                    (eid, batch_id, gid, gi, ti, env, json.dumps({"seed": ti}), t.episode_status or t.status,
                     t.attempt, t.reward, a.num_turns, a.versions, f"prompt {ti}", created_at))
                if not t.with_trajectory:
                    continue
                key = ("episode_created_at, ", "(SELECT created_at FROM episodes WHERE id = %s), ") if keyed \
                    else ("", "")
                cur.execute(
                    f"INSERT INTO trajectories (episode_id, {key[0]}batch_id, group_id, env, attempt, status, reward, "
                    "token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
                    f"num_sampled_tokens, num_turns, segments, num_segments, created_at) VALUES (%s, {key[1]}%s, %s, "
                    "%s, %s, %s, %s, %s, %s::int2[], %s::float4[], %s, %s, %s, %s, %s, %s, %s, %s, "
                    "coalesce(%s::timestamptz, now()))",
                    (eid, *((eid,) if keyed else ()), batch_id, gid, env, t.attempt, t.status, t.reward,
                     a.token_ids.tolist(), a.loss_mask.tolist(), a.logprobs.tolist(), a.weight_versions.tolist(),
                     a.action_ranges, a.prompt_len, len(a.token_ids), int(a.loss_mask.sum()), a.num_turns,
                     a.segments, len(a.segments), created_at))
            out.append(ids)
    return out


@dataclass
class TurnRows:
    """What ``seed_turns`` stores for one turn of ``arrays(t, seed)``: the sampled ids and their logprobs, the ids
    after them up to the next turn (or the end: the step's observation ids), and the turn's context length."""

    turn_index: int
    token_ids: list[int]
    logprobs: list[float]
    observation_token_ids: list[int]
    prompt_len: int
    new_segment: bool
    weight_version: int
    action: str
    observation: str


def turn_rows(t: Traj, seed: int = 0) -> list[TurnRows]:
    """The turns ``arrays(t, seed)`` was laid out from, as the recorder's assembly would have joined them: turn k's
    observation ids run from its sampled ids to turn k + 1's (a segment starting among them: ``new_segment``)."""
    a = arrays(t, seed)
    out = []
    for k, (lo, hi) in enumerate(a.action_ranges):
        nxt = a.action_ranges[k + 1][0] if k + 1 < len(a.action_ranges) else len(a.token_ids)
        seg_start = max(s for s, _ in a.segments if s <= lo)
        out.append(TurnRows(
            k, a.token_ids[lo:hi].tolist(), a.logprobs[lo:hi].tolist(), a.token_ids[hi:nxt].tolist(), lo - seg_start,
            any(hi < s <= nxt for s, _ in a.segments), int(a.weight_versions[lo]),
            t.actions[k] if t.actions is not None else f"action {k}",
            f"observation {k}" if nxt > hi else ""))
    return out


def seed_turns(database_url: str, batch_id: str, groups: Sequence[Sequence[Traj]]) -> None:
    """The kept turns and steps (``turns``, ``steps`` rows) of the trajectories ``seed_batch`` stored for ``groups``
    (event ids as ``rollout_ledger/shared/ids.py`` spells them)."""
    with psycopg.connect(libpq_url(database_url)) as conn, conn.cursor() as cur:
        for ti, group in enumerate(groups):
            for gi, t in enumerate(group):
                if not t.with_trajectory:
                    continue
                eid = f"{batch_id}.{ti}.{gi}"
                for r in turn_rows(t, seed=ti * 10 + gi):
                    turn_id = turn_request_id(eid, t.attempt, r.turn_index, 0)
                    cur.execute(
                        "INSERT INTO turns (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, "
                        "logprobs, finish_reason, weight_version, engine, worker_id, queue_ms, generate_ms, "
                        "cached_tokens, produced_at) VALUES (%s, %s, %s, %s, %s, %s, %s::float4[], 'stop', %s, "
                        "'fake', 'w0', 0.5, 2.0, 0, now())",
                        (turn_id, eid, t.attempt, r.turn_index, r.prompt_len, r.token_ids, r.logprobs,
                         r.weight_version))
                    cur.execute(
                        "INSERT INTO steps (event_id, episode_id, attempt, turn_index, turn_event_id, action, "
                        "observation, observation_token_ids, reward, terminated, truncated, info, step_ms, "
                        "new_segment, produced_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, false, %s, 1.0, "
                        "%s, now())",
                        (step_id(eid, t.attempt, r.turn_index), eid, t.attempt, r.turn_index, turn_id, r.action,
                         r.observation, r.observation_token_ids, 0.0, r.observation == "",
                         json.dumps({"turn": r.turn_index}), r.new_segment))


def run(database_url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


def delivered(out: Path) -> list[tuple[str, int]]:
    """(episode_id, attempt) of every record in a consumer's JSONL files, in file order."""
    got = []
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            got.append((rec["episode_id"], rec["attempt"]))
    return got


def consumer_claimed(database_url: str, consumer: str) -> bool:
    """Whether some session holds the consumer's advisory lock (a live `rollout export --consumer` reader)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
            "(classid::bigint << 32 | objid::bigint) = hashtextextended(%s, 0) AND objsubid = 1",
            (f"rollout-export:{consumer}",)).fetchone()
    return bool(row and row[0])
