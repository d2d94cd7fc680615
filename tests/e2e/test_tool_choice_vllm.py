"""``tool_choice`` ``required`` and a named function through the session endpoint against the real model through vLLM
(the session's one engine, tests/e2e/conftest.py): the turn is sampled under the grammar of one hermes call whose
arguments follow the tool's parameter schema (``vllm_engine.tool_call_grammar``, vLLM's structured outputs), the
reply carries the parsed call, and the ids vLLM sampled are recorded verbatim, token-exact against the transcript.

The same rules on the fake engine: tests/unit/test_openai_semantics.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.services.inference_worker.fake_engine import tool_call_text
from rollout_ledger.shared.events import SamplingParams, ToolCallConstraint
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.unit.test_openai_semantics import EngineEpisode, open_in_process

pytestmark = pytest.mark.e2e

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Get current weather for a location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}},
                   "required": ["location"]}}}
TIME: Any = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


def test_the_grammar_admits_the_template_s_layout_and_the_tool_s_schema_only() -> None:
    from xgrammar import Grammar  # vLLM's structured-outputs backend, installed with it
    from xgrammar.testing import _is_grammar_accept_string

    from rollout_ledger.services.inference_worker.vllm_engine import tool_call_grammar

    constraint = ToolCallConstraint(names=["get_weather", "get_time"],
                                    parameters={"get_weather": WEATHER["function"]["parameters"]})
    grammar = Grammar.from_ebnf(tool_call_grammar(constraint))
    assert _is_grammar_accept_string(grammar, tool_call_text("get_time"))  # what the fake engine answers
    args = json.dumps({"days": [1, 2.5e1], "hot": None, "q": 'a"\\é'}, ensure_ascii=False)  # get_time: no schema
    for good in (f'<tool_call>\n{{"name": "get_time", "arguments": {args}}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'):
        assert _is_grammar_accept_string(grammar, good), good
    for bad in ('<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>',  # not an allowed name
                '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # a required argument missing
                '<tool_call>\n{"name": "get_time", "arguments": {"a":1}}\n</tool_call>',  # not json.dumps' layout
                'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'):  # text around the call
        assert not _is_grammar_accept_string(grammar, bad), bad


async def test_required_and_named_tool_choice_are_enforced_by_vllm(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    served = open_in_process(EngineEpisode(tok, vllm_engine, sampling=GREEDY))
    client, ep = served.client, served.episode
    tools = [WEATHER, TIME]
    forced = await client.chat.completions.create(model="policy", messages=QUESTION, tools=tools,
                                                  tool_choice="required", temperature=0.0, max_tokens=48)
    named = await client.chat.completions.create(model="policy", messages=QUESTION, tools=tools, temperature=0.0,
                                                 max_tokens=48,
                                                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    for resp, turn, names in ((forced, ep.turns[0], {"get_weather", "get_time"}), (named, ep.turns[1], {"get_time"})):
        choice = resp.choices[0]
        calls = choice.message.tool_calls
        ids = (choice.model_extra or {})["token_ids"]
        text = tok.decode(ids, skip_special_tokens=True)
        print(f"tool_choice on vLLM: {len(ids)} ids: {text!r}")
        assert choice.finish_reason == "tool_calls" and calls is not None and len(calls) == 1, text
        call = calls[0]
        assert call.type == "function" and call.function.name in names, text
        assert isinstance(json.loads(call.function.arguments), dict), text
        assert ids == turn.token_ids.tolist() and ids[-1] == tok.eos_token_id  # verbatim, ended by the grammar
        assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>"), text
    assert named.choices[0].message.tool_calls is not None
    # the agent sends the named call back with its result: the conversation extends, token-exact
    follow = [*QUESTION, named.choices[0].message,
              {"role": "tool", "tool_call_id": named.choices[0].message.tool_calls[0].id, "content": "10:00"}]
    await client.chat.completions.create(model="policy", messages=follow, tools=tools, temperature=0.0, max_tokens=8)
    await served.session.finish(1.0)
    await client.close()
    assert [s["drift"] for s in ep.steps] == ["history_rewrite", None, None]  # call 2 asked call 1's question again
    transcript = served.session.transcript
    assert transcript is not None and transcript.check_results() == [True, True]
