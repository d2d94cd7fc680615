"""The independent conformance suite ``llm-comply`` (PyPI, its OpenAI Chat Completions category) against a live
session endpoint: a real env-worker process serving an agent episode, a real recorder, NATS and Postgres.

The episode's agent (``tests/integration/session_handoff.py``) hands its session URL and secret to this test and
holds the session open; the suite's requests are then turns of that episode, answered by the in-test policy
(``tools`` in the prompt: a hermes call of the first tool; otherwise a short sentence) and recorded token-exact.

Every check of the suite runs unchanged except those not run, each with its reason (``NOT_RUN``). Its
tool-calling check sends ``tool_choice: "required"``: the endpoint enforces it (the turn is requested with
``SamplingParams.tool_call``, which the policy, like the engines, obeys), asserted below. The same suite
against the real model through vLLM: tests/e2e/test_stop_strings_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import llm_comply
import pytest
from llm_comply import result as comply_result  # modules, not their Test* classes (pytest would collect those)
from llm_comply import runner as comply_runner
from llm_comply.config import ComplianceConfig
from llm_comply.http import make_request
from llm_comply.schema import SpecLoader
from llm_comply.tests.openai_chat import OPENAI_CHAT_TESTS

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.events import InferenceRequested
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.policy import Policy
from tests.integration.test_agents import REPO, check_segments

NOT_RUN: dict[str, str] = {
    "chat-image-input": "image input cannot apply: the policy is a text-only model, and the endpoint refuses image "
                        "content parts with a 400 naming the part (asserted below)",
    "chat-reasoning-summary": "cannot apply: the policy is not a reasoning model (no reasoning summary); the suite "
                              "itself skips it for any model outside o1/o3/o4/gpt-5/deepseek-r",
}
"""The suite's checks that are not run, with the reason."""

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:llm_comply.schema")  # its jsonschema resolver

RUN = [tc.id for tc in OPENAI_CHAT_TESTS if tc.id not in NOT_RUN]
MODEL = "SmolLM2-135M-Instruct"


class ComplyPolicy(Policy):
    """Calls the first tool the prompt offers (hermes ``<tool_call>``); otherwise says a short sentence. A turn
    constrained to a call (``sampling.tool_call``) is a call of the first allowed name, as an engine's would be."""

    def text_for(self, req: InferenceRequested) -> str:
        if req.sampling.tool_call is not None:
            return format_call(req.sampling.tool_call.names[0], {"location": "San Francisco"})
        context = self.tok.decode(req.prompt_token_ids)
        if "<tools>" in context and '"get_weather"' in context:
            return format_call("get_weather", {"location": "San Francisco"})
        return "Hello there, friend."


@pytest.fixture
async def policy(nc: bus.NATS, tok: ChatTokenizer) -> AsyncIterator[ComplyPolicy]:
    p = ComplyPolicy(nc, tok)
    await p.start()
    yield p
    await p.stop()


def comply_env(**extra: str) -> dict[str, str]:
    """Settings of an env worker running the hand-off agent as env ``comply``."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {"ROLLOUT_AGENTS": "comply=tests.integration.session_handoff:hold_session", "PYTHONPATH": path,
            "ROLLOUT_ENVS": "fixed-turns", "ROLLOUT_AGENT_TIMEOUT_S": "120", **extra}


def run_suite(session: dict[str, str], model: str) -> dict[str, Any]:
    """The suite's OpenAI Chat checks against ``session`` (``base_url``, ``api_key``): {check id: result}, with the
    refusal the skipped image check meets (its unchanged request) in the OpenAI error shape."""
    config = ComplianceConfig(base_url=session["base_url"], api_key=session["api_key"], model=model, timeout=120.0)
    spec = SpecLoader(str(Path(llm_comply.__file__).parent / "specs" / "openai_chat.json"))  # what the CLI loads
    cases = [tc for tc in OPENAI_CHAT_TESTS if tc.id not in NOT_RUN]
    results = {r.id: r for r in comply_runner.TestRunner(config, cases, spec).run_all().results}
    for tc in OPENAI_CHAT_TESTS:  # what the skipped image check's request gets: a clear 400
        if tc.id == "chat-image-input":
            status, body, _ = make_request(config, tc.endpoint, tc.build_request(config))
            results[f"{tc.id} (unchanged)"] = (status, body)
    return results


def check_results(results: dict[str, Any]) -> None:
    passed = comply_result.TestStatus.PASSED
    failed = {i: r.errors for i, r in results.items() if not isinstance(r, tuple) and r.status != passed}
    assert not failed, failed
    assert sorted(i for i in results if not isinstance(results[i], tuple)) == sorted(RUN)
    status, body = results["chat-image-input (unchanged)"]
    assert status == 400 and body["error"]["param"] == "messages[0].content[1]", body


async def handed_over(path: Path) -> dict[str, str]:
    """The session the hand-off agent wrote to ``path``."""
    await asyncio.to_thread(wait_for, path.exists, 60, "the agent to hand its session over")
    data: dict[str, str] = json.loads(await asyncio.to_thread(path.read_text))
    return data


async def test_llm_comply_openai_chat_passes_against_a_session(stack: Stack, policy: ComplyPolicy,
                                                               database_url: str, tmp_path: Path) -> None:
    await asyncio.to_thread(stack.start, "env-worker", "env-worker", **comply_env())
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    handoff, release = tmp_path / "session.json", tmp_path / "release"
    resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": "comply", "tasks": [{"handoff": str(handoff), "release": str(release)}], "max_turns": 16,
        "sampling": {"max_tokens": 32}})
    assert resp.status_code == 201, resp.text
    batch_id = resp.json()["batch_id"]
    session = await handed_over(handoff)
    assert "/sessions/" in session["base_url"] and session["base_url"].endswith("/v1")

    results = await asyncio.to_thread(run_suite, session, MODEL)
    release.touch()
    check_results(results)
    for rid in RUN:  # one line per check in the test's output (what the report lists)
        print(f"llm-comply {rid}: {results[rid].status.value} {results[rid].warnings or ''}")

    sql = Sql(database_url)
    try:
        def finished() -> bool:
            return bool(sql.scalar("select count(*) from episodes where batch_id = :b and status = 'completed'",
                                   b=batch_id) == 1)

        await asyncio.to_thread(wait_for, finished, 30, "the held episode recorded")
        episode_id = sql.scalar("select id from episodes where batch_id = :b", b=batch_id)
        tr = check_segments(sql, episode_id)  # every segment decode == render, each turn from its segment
        turns = [r.turn_index for r in policy.requests if r.episode_id == episode_id]
        # one turn per check that reached the policy (error handling and the refusals sampled nothing)
        sampled = len([i for i in RUN if i != "chat-error-handling"])
        assert turns == list(range(sampled)) and tr["num_turns"] == sampled
        # the tool-calling check's 'required' reached the policy as a constraint (and only that check forces one)
        forced = [r.sampling.tool_call for r in policy.requests if r.episode_id == episode_id and r.sampling.tool_call]
        assert [c.names for c in forced] == [["get_weather"]]
        assert tr["reward"] == 1.0
    finally:
        sql.close()
