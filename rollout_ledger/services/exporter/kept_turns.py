"""Reads the kept turns of exported trajectories: for each stored trajectory (an episode's attempt), the (step, turn)
records the recorder assembled it from (``recorder/assembly.py``), with their texts, in one query per chunk.

A trajectory of ``num_turns`` turns was assembled from the steps of its attempt with ``turn_index < num_turns``, each
paired with the turn try it names (``steps.turn_event_id``), exactly as ``RecorderStore.attempt_records`` reads them;
a resumed attempt has its own step rows for the turns it carried over (``steps.reused_from``). The trajectory row
holds the ids; these records add what it does not: the action and observation texts, the environment's step reward
and info, each turn's engine, finish reason and timing.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg

from rollout_ledger.client.rows import Chunk
from rollout_ledger.shared.errors import StoreError


@dataclass(frozen=True)
class KeptTurn:
    """One kept turn of a trajectory: its step (what the environment did with it) and the turn try it names (what the
    policy sampled). ``turn_event_id`` is None when that turn's row is missing (the mapping refuses the trajectory)."""

    turn_index: int
    step_event_id: str
    turn_event_id: str | None
    action: str
    """The sampled text handed to the environment (decoded, cut at a stop string: ``StepCompleted.action``)."""
    observation: str
    """Environment text appended after the turn ('' when the episode ends)."""
    observation_token_ids: np.ndarray
    """Ids the chat template added after the sampled ids (a ``new_segment`` step: the whole re-rendered context)."""
    reward: float
    """The environment's reward for this step."""
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    drift: str | None
    new_segment: bool
    reused_from: str | None
    token_ids: np.ndarray
    """The sampled ids, verbatim (``turns.token_ids``; empty when the turn's row is missing)."""
    logprobs: np.ndarray
    """The inference engine's logprob of each sampled id (float32, as stored)."""
    weight_version: int | None
    version_runs: list[list[int]] | None
    """``[[start, version], ...]`` when a weight swap in mode ``keep`` carried the turn across versions."""
    finish_reason: str | None
    prompt_len: int | None
    """Context length the engine generated this turn from."""
    cached_tokens: int | None
    engine: str | None
    produced_at: dt.datetime | None
    """When the inference worker produced the turn."""


_QUERY = (
    "SELECT s.episode_id, s.attempt, s.turn_index, s.event_id, t.event_id, s.action, s.observation, "
    "s.observation_token_ids, s.reward, s.terminated, s.truncated, s.info, s.drift, s.new_segment, s.reused_from, "
    "t.token_ids, t.logprobs, t.weight_version, t.version_runs, t.finish_reason, t.prompt_len, t.cached_tokens, "
    "t.engine, t.produced_at "
    "FROM unnest(%s::text[], %s::int4[], %s::int4[]) AS q(eid, att, n) "
    "JOIN steps s ON s.episode_id = q.eid AND s.attempt = q.att AND s.turn_index < q.n "
    "LEFT JOIN turns t ON t.event_id = s.turn_event_id AND t.episode_id = s.episode_id "
    "ORDER BY s.episode_id, s.attempt, s.turn_index")


def _ids(value: Any, dtype: type) -> np.ndarray:
    return np.asarray(value if value is not None else [], dtype)


def kept_turns(conn: psycopg.Connection[Any], chunk: Chunk) -> dict[tuple[str, int], list[KeptTurn]]:
    """The kept turns of every trajectory of ``chunk`` by (episode_id, attempt), in turn order (a trajectory whose
    steps are not stored is absent or short: the mapping says which turn is missing)."""
    if not len(chunk):
        return {}
    eids, attempts, turns = (chunk.values(name) for name in ("episode_id", "attempt", "num_turns"))
    try:
        with conn.cursor(binary=True) as cur:
            cur.execute(_QUERY, (list(eids), [int(a) for a in attempts], [int(n or 0) for n in turns]))
            rows = cur.fetchall()
    except psycopg.Error as exc:
        raise StoreError(f"reading the kept turns failed: {exc}") from exc
    out: dict[tuple[str, int], list[KeptTurn]] = defaultdict(list)
    for r in rows:
        out[(r[0], int(r[1]))].append(KeptTurn(
            turn_index=int(r[2]), step_event_id=r[3], turn_event_id=r[4], action=r[5], observation=r[6],
            observation_token_ids=_ids(r[7], np.int32), reward=float(r[8]), terminated=bool(r[9]),
            truncated=bool(r[10]), info=r[11] or {}, drift=r[12], new_segment=bool(r[13]), reused_from=r[14],
            token_ids=_ids(r[15], np.int32), logprobs=_ids(r[16], np.float32), weight_version=r[17],
            version_runs=r[18], finish_reason=r[19], prompt_len=r[20], cached_tokens=r[21], engine=r[22],
            produced_at=r[23]))
    return dict(out)
