"""The logprob audit (issue 15, part 5) on a real store with the real model's weights: sampled positions per
segment, stats per trajectory, mixed-version trajectories skipped, rows idempotent. The engine's logprobs against
transformers on the same weights are checked in tests/e2e/test_pipeline_vllm.py."""

from __future__ import annotations

import numpy as np
import psycopg

from rollout_ledger.client.source import libpq_url
from rollout_ledger.services.exporter.audit import audit_batch, load_model
from tests.integration.export_data import Traj, arrays, seed_batch


def transformers_logprobs(model_dir: str, traj: Traj, seed: int) -> np.ndarray:
    """An independent reference: each segment's forward pass, the sampled tokens' logprobs (0 elsewhere), in
    float32 (the audit takes log-softmax in float64: the two agree to ~1e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    a = arrays(traj, seed=seed)
    out = np.zeros(len(a.token_ids), dtype=np.float32)
    for start, end in a.segments:
        ids = torch.tensor(a.token_ids[start:end].astype(np.int64))[None, :]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        for t in range(start + 1, end):
            if a.loss_mask[t]:
                out[t] = float(lp[t - start - 1, int(a.token_ids[t])])
    return out


def test_audit_measures_the_gap_on_sampled_tokens_per_segment(database_url: str, model_dir: str) -> None:
    segmented = Traj(segments=((4, ((3, 2),)), (6, ((2, 0),))))
    mixed = Traj(segments=((4, ((3, 2), (2, 0))),), versions=(1, 2))
    (eids,) = seed_batch(database_url, "au", [[segmented, segmented, mixed]])
    exact = transformers_logprobs(model_dir, segmented, seed=0)
    true_off = transformers_logprobs(model_dir, segmented, seed=1)
    mask = arrays(segmented, seed=1).loss_mask
    off = np.where(mask == 1, true_off + 0.25, 0.0).astype(np.float32)
    with psycopg.connect(libpq_url(database_url)) as conn:
        for eid, lps in ((eids[0], exact), (eids[1], off)):
            conn.execute("UPDATE trajectories SET logprobs = %s WHERE episode_id = %s", (lps.tolist(), eid))
    model = load_model(model_dir)
    result = audit_batch(database_url, "au", model_dir, sample=10, model=model)
    assert result.skipped_mixed == 1
    by_episode = {r.episode_id: r for r in result.rows}
    assert set(by_episode) == {eids[0], eids[1]}
    exact_row, off_row = by_episode[eids[0]], by_episode[eids[1]]
    assert exact_row.num_tokens == off_row.num_tokens == 3 + 2, "every sampled token of both segments"
    assert exact_row.max_abs_delta < 1e-4 and (exact_row.min_version, exact_row.max_version) == (1, 1)
    assert abs(off_row.mean_abs_delta - 0.25) < 1e-4 and abs(off_row.max_abs_delta - 0.25) < 1e-4
    again = audit_batch(database_url, "au", model_dir, sample=10, model=model)
    assert len(again.rows) == 2
    with psycopg.connect(libpq_url(database_url)) as conn:
        stored = conn.execute("SELECT episode_id, source, num_tokens FROM logprob_audits ORDER BY 1").fetchall()
    assert stored == [(eids[0], "audit", 5), (eids[1], "audit", 5)], "one row per trajectory, source and checkpoint"
    # every recomputed logprob is kept, in the order of the sampled tokens, and the aggregates are made of them
    with psycopg.connect(libpq_url(database_url)) as conn:
        kept = dict(conn.execute("SELECT episode_id, token_logprobs FROM logprob_audits").fetchall())
    for eid, seed, reference, stored_lps, row in ((eids[0], 0, exact, exact, exact_row),
                                                  (eids[1], 1, true_off, off, off_row)):
        positions = np.flatnonzero(arrays(segmented, seed=seed).loss_mask == 1)
        tokens = np.asarray(kept[eid], dtype=np.float64)
        assert tokens.shape == (5,) and np.allclose(tokens, reference[positions], atol=1e-4), eid
        assert row.token_logprobs is not None and np.allclose(row.token_logprobs, tokens)
        gaps = np.abs(tokens - stored_lps[positions])
        assert abs(gaps.mean() - row.mean_abs_delta) < 1e-5 and abs(gaps.max() - row.max_abs_delta) < 1e-5
    only_v2 = audit_batch(database_url, "au", model_dir, sample=10, version=2, model=model)
    assert only_v2.rows == [] and only_v2.skipped_mixed == 3
