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
    """Insert a batch with one group per entry of ``groups``; returns the episode ids per group."""
    out: list[list[str]] = []
    with psycopg.connect(libpq_url(database_url)) as conn, conn.cursor() as cur:
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
                    "attempt, reward, num_turns, weight_versions, prompt_text, started_at, finished_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now() - interval '2 seconds', "
                    "now())",
                    (eid, batch_id, gid, gi, ti, env, json.dumps({"seed": ti}), t.episode_status or t.status,
                     t.attempt, t.reward, a.num_turns, a.versions, f"prompt {ti}"))
                if not t.with_trajectory:
                    continue
                cur.execute(
                    "INSERT INTO trajectories (episode_id, batch_id, group_id, env, attempt, status, reward, "
                    "token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
                    "num_sampled_tokens, num_turns, segments, num_segments, created_at) VALUES (%s, %s, %s, %s, "
                    "%s, %s, %s, %s, %s::int2[], %s::float4[], %s, %s, %s, %s, %s, %s, %s, %s, "
                    "coalesce(%s::timestamptz, now()))",
                    (eid, batch_id, gid, env, t.attempt, t.status, t.reward, a.token_ids.tolist(),
                     a.loss_mask.tolist(), a.logprobs.tolist(), a.weight_versions.tolist(), a.action_ranges,
                     a.prompt_len, len(a.token_ids), int(a.loss_mask.sum()), a.num_turns, a.segments,
                     len(a.segments), created_at))
            out.append(ids)
    return out


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
