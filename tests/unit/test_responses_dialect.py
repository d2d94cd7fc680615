"""The OpenAI Responses API on the session endpoint (``sessions/dialects/responses.py``), driven by the real ``openai``
SDK and the OpenAI Agents SDK's default (Responses) model against the session app: every call one turn, token-exact
under the same segment rules as chat completions (``test_sessions.py``), with previous_response_id, function tools,
streaming events, usage and logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from rollout_ledger.services.env_worker.sessions.dialects import responses
from rollout_ledger.services.env_worker.sessions.turns import ApiError, AssistantTurn, TurnResult
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.unit import test_sessions as base
from tests.unit.test_sessions import CALL_TEXT, EOS, Live, Served, _check_contexts

served, live, tok = base.served, base.live, base.tok  # the session app, its scripted episode, the tokenizer

TOOL: Any = {"type": "function", "name": "add", "description": "Add two integers.",
             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            "required": ["a", "b"]}}


def _sampled(tok: ChatTokenizer, text: str) -> list[int]:
    return [*tok.encode(text).tolist(), tok.tokenizer.token_to_id(EOS)]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi"}, "model"),
    ({"model": "p", "input": [{"type": "message", "role": "user",
                               "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"model": "p", "input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"model": "p", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"model": "p", "input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"model": "p", "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"model": "p", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
     "text.format"),
    ({"model": "p", "input": "hi", "background": True}, "background"),
    ({"model": "p", "input": "hi", "temperature": 3}, "temperature"),
    ({"model": "p", "input": [{"type": "function_call_output", "output": "5"}]}, "input[0].call_id"),
])
def test_bad_requests_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        responses.parse(body, {})
    assert err.value.status == 400 and err.value.param is not None and err.value.param.startswith(param)
    assert responses.error_body(err.value)["error"]["param"] == err.value.param


def test_input_items_become_the_canonical_conversation() -> None:
    turn, _ = responses.parse({"model": "p", "instructions": "Add.", "tools": [TOOL], "input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2 + 3?"}]},
        {"type": "message", "role": "assistant", "phase": "commentary", "status": "completed",
         "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"}]}, {})
    assert turn.messages == [
        {"role": "system", "content": "Add."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
    assert turn.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert turn.parse_tools and turn.tool_call is None


def test_a_namespace_tools_functions_are_tools_and_their_calls_carry_it() -> None:
    """Codex sends its sub-agent tools grouped as ``{"type": "namespace", "name", "tools": [...]}``."""
    spawn = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
             "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}
    body = {"model": "p", "input": "go", "tools": [TOOL, {"type": "namespace", "name": "multi_agent_v1",
                                                          "description": "Sub-agents.", "tools": [spawn]}]}
    turn, call = responses.parse(body, {})
    assert [t["function"]["name"] for t in turn.tools or ()] == ["add", "spawn_agent"]
    assert call.namespaces == {"spawn_agent": "multi_agent_v1"}
    calls = [{"id": "call_abc", "type": "function", "function": {"name": "spawn_agent", "arguments": "{}"}},
             {"id": "call_def", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    result = TurnResult(turn=AssistantTurn(None, calls, "tool_calls"), stop_string=None, prompt_token_ids=[1],
                        token_ids=[2], logprobs=None, token_texts=[], event_id="e:a1:t0:r1", model="p", created=1)
    out = responses.response(result, call, {})
    assert [(o["name"], o.get("namespace")) for o in out["output"]] == [("spawn_agent", "multi_agent_v1"),
                                                                       ("add", None)]
    assert [t["type"] for t in out["tools"]] == ["function", "namespace"]  # echoed as sent
    for bad, param in (({"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]}, "tools[1].tools[0]"),
                       ({"type": "namespace", "name": "x", "tools": [TOOL]}, "tools[1].tools[0].name")):
        with pytest.raises(ApiError) as err:
            responses.parse({**body, "tools": [TOOL, bad]}, {})
        assert err.value.param == param


async def test_a_conversation_through_the_sdk_is_token_exact(served: Served, tok: ChatTokenizer) -> None:
    client, ep = served.client, served.episode
    r0 = await client.responses.create(model="policy", instructions="You add numbers.", input="Hi",
                                       include=["message.output_text.logprobs"], top_logprobs=1, temperature=0.5)
    assert r0.output_text == "Hello!" and r0.status == "completed"
    openai.types.responses.Response.model_validate(r0.to_dict())  # every field the SDK's type requires
    extra = r0.model_extra or {}
    assert extra["prompt_token_ids"] == ep.requests[0][0].tolist() and extra["token_ids"] == _sampled(tok, "Hello!")
    part = r0.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and [lp.logprob for lp in part.logprobs] == [-0.25] * len(extra["token_ids"])
    assert r0.usage is not None and r0.usage.output_tokens == len(extra["token_ids"])
    assert r0.usage.input_tokens == len(extra["prompt_token_ids"])
    assert ep.requests[0][1].temperature == 0.5 and ep.requests[0][1].logprobs == 1
    # chained by previous_response_id: the stored conversation + the new input, the tools added (a new segment)
    r1 = await client.responses.create(model="policy", instructions="You add numbers.", previous_response_id=r0.id,
                                       input="What is 2 + 3?", tools=[TOOL])
    assert ep.steps[0]["new_segment"] and ep.steps[0]["drift"] == "history_rewrite"
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3} and call.call_id.startswith("call_")
    # the whole history sent again (what Codex and stateless agents do): the tool result extends the segment
    history: list[Any] = [{"role": "user", "content": "Hi"}, *[o.model_dump() for o in r0.output],
                          {"role": "user", "content": "What is 2 + 3?"}, *[o.model_dump() for o in r1.output],
                          {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    r2 = await client.responses.create(model="policy", instructions="You add numbers.", input=history, tools=[TOOL],
                                       store=False)
    assert r2.output_text == "It is 5."
    assert ep.steps[1]["new_segment"] is False and ep.steps[1]["observation"] == [
        {"role": "tool", "content": "5", "tool_call_id": call.call_id}]
    ctx1, ctx2 = ep.requests[1][0].tolist(), ep.requests[2][0].tolist()
    assert ctx2 == ctx1 + _sampled(tok, CALL_TEXT) + ep.steps[1]["ids"]
    with pytest.raises(openai.NotFoundError):  # store=false: not kept
        await client.responses.retrieve(r2.id)
    assert (await client.responses.retrieve(r1.id)).id == r1.id
    await served.session.finish(1.0)
    assert served.session.transcript is not None and served.session.transcript.check_results() == [True, True]


async def test_a_stream_is_the_response_replayed_as_events(served: Served, tok: ChatTokenizer) -> None:
    client, ep = served.client, served.episode
    events = []
    async with client.responses.stream(model="policy", input="Hi", include=["message.output_text.logprobs"]) as s:
        async for event in s:
            events.append(event)
        final = await s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    ids = _sampled(tok, "Hello!")
    assert len(deltas) == len(ids) and "".join(d.delta for d in deltas) == "Hello!"  # one per sampled id
    assert [d.logprobs[0].logprob for d in deltas] == [-0.25] * len(ids)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Hello!" and (final.model_extra or {})["token_ids"] == ids
    assert final.usage is not None and final.usage.output_tokens == len(ids)
    # the next call streams a tool call: its arguments come as one delta and a done event
    async with client.responses.stream(model="policy", previous_response_id=final.id, input="2 + 3?",
                                       tools=[TOOL]) as s:
        events = [e async for e in s]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"a": 2, "b": 3}
    assert events[-1].type == "response.completed"
    assert len(ep.requests) == 2


def test_a_turn_cut_at_its_limit_is_incomplete() -> None:
    turn, call = responses.parse({"model": "p", "input": "Hi", "max_output_tokens": 2}, {})
    assert turn.max_tokens == 2
    result = TurnResult(turn=AssistantTurn("Hel", [], "length"), stop_string=None, prompt_token_ids=[1, 2],
                        token_ids=[7, 8], logprobs=None, token_texts=["He", "l"], event_id="e:a1:t0:r1", model="p",
                        created=1)
    memory: dict[str, Any] = {}
    body = responses.response(result, call, memory)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["output_tokens"] == 2
    events = [json.loads(e.decode().split("data: ", 1)[1]) for e in responses.stream(result, call, memory)]
    assert events[-1]["type"] == "response.incomplete" and [e["delta"] for e in events
                                                            if e["type"] == "response.output_text.delta"] == ["He", "l"]
    assert openai.types.responses.Response.model_validate(body).status == "incomplete"


async def test_tool_choice_is_enforced_by_the_engine(served: Served) -> None:
    await served.client.responses.create(model="policy", input="2 + 3?", tools=[TOOL],
                                         tool_choice={"type": "function", "name": "add"})
    constraint = served.episode.requests[0][1].tool_call
    assert constraint is not None and constraint.names == ["add"] and constraint.parameters["add"] == TOOL["parameters"]


async def test_errors_come_back_in_the_openai_shape(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.responses.create(model="policy", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert err.value.param == "tools[0]" and "web search" in err.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        await served.client.responses.create(model="policy", input="hi", previous_response_id="resp_nope")
    assert missing.value.code == "previous_response_not_found"
    assert served.episode.requests == []


async def test_the_agents_sdk_default_model_is_token_exact(live: Callable[[dict[str, list[str]]], Live],
                                                           tok: ChatTokenizer) -> None:
    from tests.agents import openai_agents_responses

    add_call = CALL_TEXT.replace('"add"', '"add_numbers"')
    served = live({"oa": [add_call, "The sum is 5."]})
    client = served.client("oa")
    out = await openai_agents_responses({"a": 2, "b": 3, "temperature": 0.5}, client)
    await client.close()
    assert out == {"reward": 1.0, "answer": "The sum is 5.",
                   "info": {"tool_calls": 1, "requests": 2, "model": "OpenAIResponsesModel"}}
    session, episode = served.sessions["oa"], served.episodes["oa"]
    await session.finish(1.0)
    assert session.transcript is not None
    _check_contexts(episode, session.transcript, tok)
    assert [(s["new_segment"], s["drift"]) for s in episode.steps[:-1]] == [(False, None)]  # one segment
    assert episode.steps[0]["observation"][0]["role"] == "tool" and episode.steps[0]["observation"][0]["content"] == "5"
    assert all(r[1].temperature == 0.5 and r[2] == 48 for r in episode.requests)
