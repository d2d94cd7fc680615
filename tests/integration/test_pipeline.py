"""The whole pipeline as real processes on real NATS + Postgres: REST submit -> token-exact trajectories in SQL.

The engine is the fake one (zero cost, real SmolLM2 token ids); the real engine has its own e2e suite.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.exporter.export import export_batch
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.helpers import AUTH, Sql, metric, wait_for


def start_all(stack: Stack, env_workers: int = 1, **env: str) -> str:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake", **env)
    for i in range(env_workers):
        stack.start("env-worker", name=f"env-worker-{i}", **env)
    stack.start("recorder", **env)
    return stack.start("scheduler", **env).url


def submit_and_wait(url: str, timeout_s: float = 60, **body: object) -> dict[str, object]:
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, json=body, timeout=30)
    assert resp.status_code == 201, resp.text
    batch_id = resp.json()["batch_id"]

    def done() -> dict[str, object] | None:
        info = httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()
        return info if info["done"] else None

    return wait_for(done, timeout_s, f"batch {batch_id} to finish")


def check_token_exact(sql: Sql, batch_id: str) -> int:
    """Every trajectory is prompt + kept sampled ids + observation ids; mask/logprobs exactly on sampled ids."""
    trajs = sql.rows("select t.*, e.prompt_token_ids, e.attempt as ep_attempt from trajectories t "
                     "join episodes e on e.id = t.episode_id where t.batch_id = :b", b=batch_id)
    for tr in trajs:
        ids = np.array(tr["token_ids"])
        mask = np.array(tr["loss_mask"])
        lps = np.array(tr["logprobs"], dtype=np.float32)
        assert len(ids) == len(mask) == len(lps) == len(tr["weight_versions"]) == tr["num_tokens"]
        assert tr["attempt"] == tr["ep_attempt"]
        assert list(ids[: tr["prompt_len"]]) == list(tr["prompt_token_ids"])
        kept = sql.rows(
            "select s.turn_index, t.token_ids, t.logprobs, t.weight_version, t.version_runs, "
            "s.observation_token_ids from steps s join turns t on t.event_id = s.turn_event_id "
            "where s.episode_id = :e and s.attempt = :a and not s.superseded order by s.turn_index",
            e=tr["episode_id"], a=tr["attempt"])
        assert len(kept) == tr["num_turns"]
        pos = tr["prompt_len"]
        ranges = iter(zip(tr["action_ranges"], tr["action_versions"], strict=True))
        wvs = np.array(tr["weight_versions"])
        for turn in kept:
            # one action range per run of one weight version (a turn a keep swap carried across versions has two)
            runs = turn["version_runs"] or ([[0, turn["weight_version"]]] if len(turn["token_ids"]) else [])
            start = end = pos
            for k, (run_start, version) in enumerate(runs):
                run_end = runs[k + 1][0] if k + 1 < len(runs) else len(turn["token_ids"])
                if run_end <= run_start:
                    continue
                (a, b), range_version = next(ranges)
                assert (a, b) == (pos + run_start, pos + run_end) and range_version == version
                assert (wvs[a:b] == version).all()
                end = b
            if len(turn["token_ids"]) == 0:
                continue_at = pos + len(turn["observation_token_ids"])
                assert not mask[pos:continue_at].any()
                pos = continue_at
                continue
            assert end - start == len(turn["token_ids"])
            assert list(ids[start:end]) == list(turn["token_ids"])  # the engine's ids, verbatim
            assert np.array_equal(lps[start:end], np.array(turn["logprobs"], dtype=np.float32))
            assert mask[start:end].all()
            assert np.all(lps[start:end] <= 0) and np.all(np.isfinite(lps[start:end]))
            obs = turn["observation_token_ids"]
            assert list(ids[end:end + len(obs)]) == list(obs)
            assert not mask[end:end + len(obs)].any()
            pos = end + len(obs)
        assert next(ranges, None) is None
        assert pos == len(ids)
        assert int(mask.sum()) == tr["num_sampled_tokens"]
    return len(trajs)


def test_rest_submit_to_token_exact_trajectories(stack: Stack, database_url: str, model_dir: str,
                                                  tmp_path: Path) -> None:
    url = start_all(stack)
    info = submit_and_wait(url, env="arithmetic", tasks=[{"seed": i} for i in range(6)], group_size=3,
                           max_turns=1, sampling={"temperature": 1.0, "max_tokens": 24})
    assert info["num_episodes"] == 18
    counts = info["counts"]
    assert isinstance(counts, dict) and counts["completed"] == 18
    batch_id = str(info["batch_id"])
    sql = Sql(database_url)
    try:
        assert sql.scalar("select count(*) from trajectories where batch_id = :b", b=batch_id) == 18
        assert check_token_exact(sql, batch_id) == 18
        groups = sql.rows("select group_id, count(*) n from trajectories where batch_id = :b group by 1", b=batch_id)
        assert sorted(g["n"] for g in groups) == [3] * 6
        # decode(ids) is the chat rendering: prompt + answer + end of turn
        tok = load_chat_tokenizer(model_dir)
        row = sql.rows("select t.token_ids, e.prompt_text from trajectories t join episodes e on e.id = t.episode_id "
                       "where t.batch_id = :b limit 1", b=batch_id)[0]
        assert tok.decode(row["token_ids"]).startswith(row["prompt_text"])
        # the REST trajectory view agrees with SQL
        ep = sql.scalar("select episode_id from trajectories where batch_id = :b limit 1", b=batch_id)
        view = httpx.get(f"{url}/v1/episodes/{ep}/trajectory", headers=AUTH, timeout=10).json()
        assert view["token_ids"] == list(sql.scalar("select token_ids from trajectories where episode_id = :e",
                                                     e=ep))
        # export: OpenRLHF shape, JSONL and Parquet
        for fmt in ("jsonl", "parquet"):
            result = export_batch(database_url, batch_id, tmp_path, fmt)
            assert result.records == 18
        records = [json.loads(line) for line in (tmp_path / f"{batch_id}.jsonl").read_text().splitlines()]
        table = pq.read_table(tmp_path / f"{batch_id}.parquet").to_pylist()
        by_id = {r["episode_id"]: r for r in table}
        for rec in records:
            stored = sql.rows("select token_ids, logprobs, action_ranges, reward from trajectories "
                              "where episode_id = :e", e=rec["episode_id"])[0]
            assert rec["observation_tokens"] == list(stored["token_ids"])
            assert rec["action_ranges"] == [list(r) for r in stored["action_ranges"]]
            assert np.array_equal(np.array(rec["rollout_log_probs"], dtype=np.float32),
                                  np.array(stored["logprobs"], dtype=np.float32))
            assert rec["reward"] == stored["reward"]
            assert by_id[rec["episode_id"]]["observation_tokens"] == rec["observation_tokens"]
    finally:
        sql.close()
    assert metric(stack.procs[2].url, "rollout_events_processed_total") > 0


def test_multi_turn_spans_alternate(stack: Stack, database_url: str) -> None:
    url = start_all(stack)
    info = submit_and_wait(url, env="fixed-turns", tasks=[{"turns": 5}, {"turns": 3}], group_size=2, max_turns=8,
                           sampling={"max_tokens": 12})
    batch_id = str(info["batch_id"])
    sql = Sql(database_url)
    try:
        assert check_token_exact(sql, batch_id) == 4
        turns = sorted(r["num_turns"] for r in sql.rows("select num_turns from trajectories where batch_id = :b",
                                                       b=batch_id))
        assert turns == [3, 3, 5, 5]
        for tr in sql.rows("select token_ids, loss_mask, action_ranges, prompt_len from trajectories "
                           "where batch_id = :b", b=batch_id):
            mask = tr["loss_mask"]
            # sampled span, then observation span (mask 0), alternating; the last turn has no observation
            ranges = tr["action_ranges"]
            for (_s1, e1), (s2, _) in itertools.pairwise(ranges):
                assert e1 < s2 and not any(mask[e1:s2])
            assert ranges[-1][1] == len(tr["token_ids"])
    finally:
        sql.close()


def test_max_turns_truncates(stack: Stack, database_url: str) -> None:
    url = start_all(stack)
    info = submit_and_wait(url, env="fixed-turns", tasks=[{"turns": 10}], group_size=1, max_turns=3,
                           sampling={"max_tokens": 8})
    counts = info["counts"]
    assert isinstance(counts, dict) and counts["truncated"] == 1
    sql = Sql(database_url)
    try:
        row = sql.rows("select status, num_turns from trajectories where batch_id = :b", b=info["batch_id"])[0]
        assert row == {"status": "truncated", "num_turns": 3}
    finally:
        sql.close()


REWRITING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = '[earlier] ' + content %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A chat template that rewrites history (earlier assistant turns render differently once answered), as the
templates of reasoning models do with earlier thinking."""


def test_history_rewriting_template_yields_segments(stack: Stack, database_url: str, model_dir: str,
                                                    tmp_path: Path) -> None:
    """Every turn after a rewritten one starts a new segment: recorded with its drift class, each segment decodes
    to the template's rendering, the engine saw exactly each segment as its context, and nothing fails."""
    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING_TEMPLATE)
    url = start_all(stack, ROLLOUT_CHAT_TEMPLATE=str(template))
    info = submit_and_wait(url, env="fixed-turns", tasks=[{"turns": 4}, {"turns": 2}], group_size=2, max_turns=8,
                           sampling={"max_tokens": 12})
    counts = info["counts"]
    assert isinstance(counts, dict) and counts["completed"] == 4
    batch_id = str(info["batch_id"])
    sql = Sql(database_url)
    tok = ChatTokenizer(model_dir, chat_template=REWRITING_TEMPLATE)
    try:
        assert check_token_exact(sql, batch_id) == 4
        rows = sql.rows("select episode_id, token_ids, segments, num_segments, num_turns, token_check, drifts, "
                        "action_ranges from trajectories where batch_id = :b", b=batch_id)
        for tr in rows:
            n = tr["num_turns"]
            assert tr["num_segments"] == n and len(tr["segments"]) == n
            assert tr["token_check"] == "ok"
            assert tr["drifts"] == [{"turn": t, "class": "assistant_render"} for t in range(n - 1)]
            assert tr["segments"][0][0] == 0 and tr["segments"][-1][1] == len(tr["token_ids"])
            for (_, end), (start, _) in itertools.pairwise(tr["segments"]):
                assert end == start
            # each segment ends with its turn's sampled ids, and the engine generated that turn from the segment
            turns = sql.rows("select t.prompt_len, t.token_ids from steps s join turns t on t.event_id = "
                             "s.turn_event_id where s.episode_id = :e and not s.superseded order by s.turn_index",
                             e=tr["episode_id"])
            for (start, end), (a_start, a_end), turn in zip(tr["segments"], tr["action_ranges"], turns, strict=True):
                assert a_end == end and turn["prompt_len"] == a_start - start
            # later segments hold the rewritten history, as the template renders it
            if n > 1:
                last = tr["segments"][-1]
                assert "[earlier] " in tok.decode(tr["token_ids"][last[0]:last[1]])
        steps = sql.rows("select drift, new_segment from steps where episode_id = :e order by turn_index",
                         e=rows[0]["episode_id"])
        assert [s["new_segment"] for s in steps] == [True] * (len(steps) - 1) + [False]
        view = httpx.get(f"{url}/v1/episodes/{rows[0]['episode_id']}/trajectory", headers=AUTH, timeout=10).json()
        assert view["num_segments"] == rows[0]["num_segments"] and view["token_check"] == "ok"
        assert [s["kind"] for s in view["spans"]].count("context") == rows[0]["num_segments"] - 1
    finally:
        sql.close()
