"""The logprob audit: how far the logprobs a trainer computes (transformers, with the weights that sampled a
trajectory) are from the inference engine's logprobs stored with it, on its sampled tokens (the mismatch that
truncated importance sampling corrects for; trl#4772, verl#2953).

``rollout audit --batch B`` takes a seeded sample of the batch's trajectories, recomputes every sampled token's
logprob with transformers on the CPU in float32 (each segment as its own context, as it was sampled), and writes
one row per trajectory to ``logprob_audits``: mean / p99 / max |recomputed - stored| over its loss-mask-1 tokens,
with the engine and the weight versions that sampled it, and every recomputed logprob (``token_logprobs``, in the
order of the sampled tokens: the viewer colours each token by its gap). The trainer example writes rows the same way
(``source = 'trainer'``). Only trajectories whose tokens all come from one version are audited against one
checkpoint (``--version``): mixed ones are skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg

from rollout_ledger.client.audits import AuditRow, stats, write_rows
from rollout_ledger.client.source import libpq_url
from rollout_ledger.shared.errors import StoreError

DTYPE = "float32"
"""Both sides in float32: the e2e engine runs float32, and a bf16 recomputation differs by ~1e-2 on its own."""


@dataclass
class AuditResult:
    rows: list[AuditRow]
    skipped_mixed: int
    """Trajectories of the sample whose tokens came from more than one version (or another version)."""


def sampled_positions(loss_mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(loss_mask == 1)


def recompute(model: Any, token_ids: np.ndarray, segments: list[list[int]], positions: np.ndarray) -> np.ndarray:
    """log p(token_ids[t] | its segment up to t) for every t in ``positions`` (each segment its own context)."""
    import torch

    out = np.full(positions.shape[0], np.nan, dtype=np.float64)
    index = {int(t): i for i, t in enumerate(positions.tolist())}
    for start, end in segments:
        inside = [t for t in positions.tolist() if start < t < end]
        if not inside:
            continue
        ids = torch.tensor(token_ids[start:end].astype(np.int64))[None, :]
        with torch.no_grad():
            logits = model(ids).logits[0].to(torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)
        for t in inside:
            out[index[t]] = float(logprobs[t - start - 1, int(token_ids[t])])
    return out


def load_model(checkpoint: str) -> Any:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError("rollout audit needs torch and transformers: pip install 'rollout-ledger[model]'") from exc
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, DTYPE))
    model.eval()
    return model


_SAMPLE = """
SELECT t.episode_id, t.attempt, t.batch_id, t.token_ids, t.loss_mask, t.logprobs, t.segments, t.action_versions,
       coalesce((SELECT string_agg(DISTINCT u.engine, ',') FROM turns u
                 WHERE u.episode_id = t.episode_id AND u.attempt = t.attempt AND NOT u.superseded), '') AS engine
FROM trajectories t
WHERE t.batch_id = %(batch)s AND t.num_sampled_tokens > 0
ORDER BY md5(t.episode_id || %(seed)s)
LIMIT %(n)s
"""

def audit_batch(database_url: str, batch_id: str, checkpoint: str, *, sample: int = 16, seed: int = 0,
                version: int | None = None, source: str = "audit", model: Any = None) -> AuditResult:
    """Audit up to ``sample`` trajectories of ``batch_id`` against ``checkpoint`` (the weights of ``version``; None:
    whatever single version each trajectory has). Writes and returns the rows."""
    try:
        with psycopg.connect(libpq_url(database_url)) as conn:
            records = conn.execute(_SAMPLE, {"batch": batch_id, "seed": str(seed), "n": sample}).fetchall()
    except psycopg.Error as exc:
        raise StoreError(f"cannot read batch {batch_id} for the audit: {exc}") from exc
    model = model if model is not None else load_model(checkpoint)
    rows: list[AuditRow] = []
    skipped = 0
    for episode_id, attempt, batch, token_ids, loss_mask, logprobs, segments, action_versions, engine in records:
        versions = sorted({int(v) for v in action_versions if v is not None})
        if len(versions) > 1 or (version is not None and versions != [version]):
            skipped += 1
            continue
        ids = np.asarray(token_ids, dtype=np.int64)
        positions = sampled_positions(np.asarray(loss_mask))
        mine = recompute(model, ids, [list(s) for s in segments], positions)
        stored = np.asarray(logprobs, dtype=np.float32)[positions]
        keep = ~np.isnan(mine)
        if not keep.any():
            continue
        mean, p99, worst = stats(mine[keep], stored[keep])
        rows.append(AuditRow(episode_id, int(attempt), batch, source, checkpoint, engine or "",
                             versions[0] if versions else None, versions[-1] if versions else None,
                             int(keep.sum()), mean, p99, worst, mine.astype(np.float32).tolist()))
    write_rows(database_url, rows)
    return AuditResult(rows, skipped)
