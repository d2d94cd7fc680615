"""A trainer's logprob audit rows (``logprob_audits``): how far the logprobs it recomputes are from the engine's
stored with a trajectory, on its sampled tokens. The trainer writes them (``source = 'trainer'``); ``rollout audit``
(services/exporter/audit.py) writes the same rows from its own recomputation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import psycopg

from rollout_ledger.client.source import libpq_url
from rollout_ledger.shared.errors import StoreError


@dataclass(frozen=True)
class AuditRow:
    """One audited trajectory."""

    episode_id: str
    attempt: int
    batch_id: str
    source: str
    checkpoint: str
    engine: str
    min_version: int | None
    max_version: int | None
    num_tokens: int
    mean_abs_delta: float
    p99_abs_delta: float
    max_abs_delta: float
    token_logprobs: list[float] | None = None
    """The recomputed logprob of each sampled (loss-mask 1) token, in order (NaN: not recomputed); None: the
    aggregates only."""


def stats(recomputed: np.ndarray, stored: np.ndarray) -> tuple[float, float, float]:
    delta = np.abs(recomputed - stored.astype(np.float64))
    return float(delta.mean()), float(np.percentile(delta, 99)), float(delta.max())



_WRITE = """
INSERT INTO logprob_audits (episode_id, attempt, batch_id, source, checkpoint, engine, min_version, max_version,
                            num_tokens, mean_abs_delta, p99_abs_delta, max_abs_delta, token_logprobs)
VALUES (%(episode_id)s, %(attempt)s, %(batch_id)s, %(source)s, %(checkpoint)s, %(engine)s, %(min_version)s,
        %(max_version)s, %(num_tokens)s, %(mean_abs_delta)s, %(p99_abs_delta)s, %(max_abs_delta)s,
        %(token_logprobs)s::real[])
ON CONFLICT (episode_id, attempt, source, checkpoint) DO UPDATE SET
    engine = excluded.engine, min_version = excluded.min_version, max_version = excluded.max_version,
    num_tokens = excluded.num_tokens, mean_abs_delta = excluded.mean_abs_delta,
    p99_abs_delta = excluded.p99_abs_delta, max_abs_delta = excluded.max_abs_delta,
    token_logprobs = excluded.token_logprobs, created_at = now()
"""


def write_rows(database_url: str, rows: list[AuditRow]) -> None:
    try:
        with psycopg.connect(libpq_url(database_url)) as conn, conn.cursor() as cur:
            cur.executemany(_WRITE, [r.__dict__ for r in rows])
    except psycopg.Error as exc:
        raise StoreError(f"cannot write logprob audits: {exc}") from exc
