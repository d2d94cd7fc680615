"""Stop strings through the session endpoint against the real model through vLLM (the session's one engine,
tests/e2e/conftest.py): the reply's content ends before the stop string, with nothing after it, while the ids vLLM
sampled (through the one completing the stop string, which may carry more text) are recorded verbatim.

The same rules on the fake engine: tests/unit/test_openai_semantics.py. The ``llm-comply`` checks of each category the
endpoint speaks (OpenAI Chat, Open Responses, Anthropic) also run here against a session served by vLLM (every check
that applies passes, forced tool calls included); tests/integration/test_llm_comply.py runs them against the in-test
policy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.shared.events import SamplingParams
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.e2e.conftest import E2E_MAX_MODEL_LEN, InProcessWorker
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.test_agents import check_segments
from tests.integration.test_llm_comply import CATEGORIES, MODEL, Category, comply_env, run_suite
from tests.unit.test_openai_semantics import EngineEpisode, open_in_process

pytestmark = pytest.mark.e2e

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


def mid_token_stop(tok: ChatTokenizer, ids: list[int]) -> tuple[str, str]:
    """A stop string that ends inside one of ``ids``' tokens (so that token carries text after it), and the text
    before it: the first two characters of the first token of 4+ characters whose start occurs nowhere earlier."""
    text = ""
    for piece in tok.stream_texts(ids):
        stop = piece[:2]
        if len(piece.strip()) >= 4 and stop not in text + piece[:1]:
            return stop, text
        text += piece
    raise AssertionError(f"no token of 4+ characters in {text!r}")


async def test_a_stop_string_inside_a_token_is_cut_and_the_ids_kept(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    served = open_in_process(EngineEpisode(tok, vllm_engine, sampling=GREEDY))
    client, ep = served.client, served.episode
    full = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.0, max_tokens=48)
    full_ids = (full.choices[0].model_extra or {})["token_ids"]
    stop, before = mid_token_stop(tok, full_ids)

    cut = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.0, max_tokens=48,
                                               stop=[stop])
    ids = (cut.choices[0].model_extra or {})["token_ids"]
    sampled = tok.decode(ids, skip_special_tokens=True)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == before, (stop, sampled)
    # vLLM stopped after the id completing the stop string, which holds more text: the ids are kept as sampled
    assert ids == full_ids[:len(ids)] and ids == ep.turns[1].token_ids.tolist()
    assert sampled.startswith(before + stop) and len(sampled) > len(before + stop), (stop, sampled)
    assert tok.eos_token_id not in ids

    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.0, max_tokens=48,
                                                  stop=[stop], stream=True)
    text, streamed_ids = "", cast(list[int], [])
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        streamed_ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    assert text == before and streamed_ids == ids
    await served.session.finish(1.0)
    await client.close()
    assert [s["action"] for s in ep.steps][1:] == [before, before]  # the recorded actions are the contents
    transcript = served.session.transcript
    assert transcript is not None and all(transcript.check_results())


@pytest.mark.parametrize("category", list(CATEGORIES.values()), ids=list(CATEGORIES))
def test_llm_comply_against_a_session_on_vllm(stack: Stack, database_url: str, tmp_path: Path,
                                              vllm_worker: InProcessWorker, category: Category) -> None:
    stack.start("env-worker", **comply_env(ROLLOUT_MAX_MODEL_LEN=str(E2E_MAX_MODEL_LEN)))
    stack.start("recorder")
    url = stack.start("scheduler").url
    handoff, release = tmp_path / "session.json", tmp_path / "release"
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "comply", "tasks": [{"handoff": str(handoff), "release": str(release)}], "max_turns": 16,
        "sampling": {"max_tokens": 256, "temperature": 0.0}})  # room for a whole answer: the checks want "completed"
    assert resp.status_code == 201, resp.text
    wait_for(handoff.exists, 120, "the agent to hand its session over")
    results = run_suite(json.loads(handoff.read_text()), MODEL, category)
    release.touch()
    for rid in category.run:
        r = results[rid]
        print(f"llm-comply {category.name} on vLLM {rid}: {r.status.value} {r.errors} {r.warnings}")
    for rid, reason in category.not_run.items():
        print(f"llm-comply {category.name} on vLLM {rid}: not run ({reason})")
    sql = Sql(database_url)
    try:
        batch_id = resp.json()["batch_id"]
        wait_for(lambda: sql.scalar("select count(*) from episodes where batch_id = :b and status = 'completed'",
                                    b=batch_id) == 1, 60, "the held episode recorded")
        check_segments(sql, sql.scalar("select id from episodes where batch_id = :b", b=batch_id))
    finally:
        sql.close()
    # every check run passes, tool calling too: its forced call is enforced by vLLM's grammar
    run = category.run
    assert all(results[rid].status.value == "passed" for rid in run), {rid: results[rid].errors for rid in run}
