"""The independent conformance suite ``llm-comply`` (PyPI), its three categories the session endpoint speaks (OpenAI
Chat Completions, ``--format open-responses``, ``--format anthropic``), each against a live session endpoint: a real
env-worker process serving an agent episode, a real recorder, NATS and Postgres.

The episode's agent (``tests/integration/session_handoff.py``) hands its session URL and secret to this test and
holds the session open; the suite's requests are then turns of that episode, answered by the in-test policy
(``tools`` in the prompt: a hermes call of the first tool; otherwise a short sentence) and recorded token-exact.

Every check of a category runs unchanged except those not run, each with its reason (``Category.not_run``). The
tool-calling checks send ``tool_choice: "required"`` (Anthropic's ``{"type": "any"}``): the endpoint enforces it (the
turn is requested with ``SamplingParams.tool_call``, which the policy, like the engines, obeys), asserted below. The
same suite against the real model through vLLM: tests/e2e/test_stop_strings_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from llm_comply.tests.anthropic import ANTHROPIC_TESTS
from llm_comply.tests.open_responses import OPEN_RESPONSES_TESTS
from llm_comply.tests.openai_chat import OPENAI_CHAT_TESTS

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.events import InferenceRequested
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.helpers import AUTH, Sql, wait_for
from tests.integration.policy import Policy
from tests.integration.test_agents import REPO, check_segments

TEXT_ONLY = "image input cannot apply: the policy is a text-only model, and the endpoint refuses image content " \
    "with a 400 naming the part (asserted below)"
NOT_REASONING = "cannot apply: the policy is not a reasoning model (no reasoning summary or thinking blocks); the " \
    "suite itself skips it for any model outside o1/o3/o4/gpt-5/deepseek-r"
NO_THINKING = "cannot apply: the policy is not a reasoning model, so no reply carries a thinking block (the endpoint " \
    "accepts the thinking config and invents none); the suite itself skips it for any model not named claude-*"


@dataclass(frozen=True)
class Category:
    """One of llm-comply's formats as this test runs it."""

    name: str
    """The CLI's ``--format``."""
    tests: list[Any]
    spec: str
    """The spec file the CLI loads for it."""
    not_run: dict[str, str]
    """Checks not run, each with why it cannot apply."""
    no_turn: tuple[str, ...]
    """Checks whose requests reach no policy (refused before sampling, or a route not served)."""
    image_check: str
    image_param: str
    """What the refused image check's 400 names."""
    forced: list[str]
    """The tool names the tool-calling check forces (``required`` / ``any``)."""
    auth_header: str = "Authorization"
    bearer: bool = True
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def run(self) -> list[str]:
        return [tc.id for tc in self.tests if tc.id not in self.not_run]

    def config(self, session: dict[str, str], model: str) -> ComplianceConfig:
        return ComplianceConfig(base_url=session["base_url"], api_key=session["api_key"], model=model, timeout=120.0,
                                auth_header=self.auth_header, use_bearer_prefix=self.bearer,
                                extra_headers=self.headers or None)


CHAT = Category("openai-chat", OPENAI_CHAT_TESTS, "openai_chat.json",
                {"chat-image-input": TEXT_ONLY, "chat-reasoning-summary": NOT_REASONING},
                no_turn=("chat-error-handling",), image_check="chat-image-input", image_param="messages[0].content[1]",
                forced=["get_weather"])
RESPONSES = Category("open-responses", OPEN_RESPONSES_TESTS, "openresponses.json",
                     {"image-input": TEXT_ONLY, "reasoning-summary": NOT_REASONING},
                     # compaction is a model call outside the episode's turns: a 404 saying so, which the advisory
                     # checks accept (they pass, with the suite's warnings)
                     no_turn=("error-handling", "compact-response", "compact-missing-model"),
                     image_check="image-input", image_param="input[0].content[1]", forced=["get_weather"])
ANTHROPIC = Category("anthropic", ANTHROPIC_TESTS, "anthropic.json",
                     {"anth-image-input": TEXT_ONLY, "anth-thinking-display": NO_THINKING},
                     no_turn=("anth-error-handling",), image_check="anth-image-input",
                     image_param="messages[0].content[1]", forced=["get_weather"],
                     auth_header="x-api-key", bearer=False, headers={"anthropic-version": "2023-06-01"})
CATEGORIES = {c.name: c for c in (CHAT, RESPONSES, ANTHROPIC)}

NOT_RUN, RUN = CHAT.not_run, CHAT.run
"""The chat category's (what the vLLM run of tests/e2e imports)."""

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:llm_comply.schema")  # its jsonschema resolver

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


def run_suite(session: dict[str, str], model: str, category: Category = CHAT) -> dict[str, Any]:
    """The category's checks against ``session`` (``base_url``, ``api_key``): {check id: result}, with the refusal
    the skipped image check meets (its unchanged request) in the API's error shape."""
    config = category.config(session, model)
    spec = SpecLoader(str(Path(llm_comply.__file__).parent / "specs" / category.spec))  # what the CLI loads
    cases = [tc for tc in category.tests if tc.id not in category.not_run]
    results = {r.id: r for r in comply_runner.TestRunner(config, cases, spec).run_all().results}
    for tc in category.tests:  # what the skipped image check's request gets: a clear 400
        if tc.id == category.image_check:
            status, body, _ = make_request(config, tc.endpoint, tc.build_request(config))
            results[f"{tc.id} (unchanged)"] = (status, body)
    return results


def check_results(results: dict[str, Any], category: Category = CHAT) -> None:
    passed = comply_result.TestStatus.PASSED
    failed = {i: r.errors for i, r in results.items() if not isinstance(r, tuple) and r.status != passed}
    assert not failed, failed
    assert sorted(i for i in results if not isinstance(results[i], tuple)) == sorted(category.run)
    status, body = results[f"{category.image_check} (unchanged)"]
    error = body["error"]
    assert status == 400 and category.image_param in (error.get("param") or error["message"]), body


async def handed_over(path: Path) -> dict[str, str]:
    """The session the hand-off agent wrote to ``path``."""
    await asyncio.to_thread(wait_for, path.exists, 60, "the agent to hand its session over")
    data: dict[str, str] = json.loads(await asyncio.to_thread(path.read_text))
    return data


@pytest.mark.parametrize("category", list(CATEGORIES.values()), ids=list(CATEGORIES))
async def test_llm_comply_passes_against_a_session(stack: Stack, policy: ComplyPolicy, database_url: str,
                                                   tmp_path: Path, category: Category) -> None:
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

    results = await asyncio.to_thread(run_suite, session, MODEL, category)
    release.touch()
    check_results(results, category)
    for rid in category.run:  # one line per check in the test's output (what the report lists)
        print(f"llm-comply {category.name} {rid}: {results[rid].status.value} {results[rid].warnings or ''}")
    for rid, reason in category.not_run.items():
        print(f"llm-comply {category.name} {rid}: not run ({reason})")

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
        sampled = len([i for i in category.run if i not in category.no_turn])
        assert turns == list(range(sampled)) and tr["num_turns"] == sampled
        # the tool-calling check's forced call reached the policy as a constraint (and only that check forces one)
        forced = [r.sampling.tool_call for r in policy.requests if r.episode_id == episode_id and r.sampling.tool_call]
        assert [c.names for c in forced] == [category.forced]
        assert tr["reward"] == 1.0
    finally:
        sql.close()
