"""The session endpoint's Anthropic Messages dialect through the official ``anthropic`` SDK, in process (ASGI
transport), on a scripted episode: request validation (a 400 naming the field, in Anthropic's error shape),
content blocks into canonical messages, tool use round trips extending one segment, stop sequences, ``max_tokens``,
``tool_choice`` enforced by the engine, the stream rebuilt by the SDK into the non-stream message, ``count_tokens``,
and the session's key.

The episode is the fake ``EpisodeSink`` of tests/unit/test_sessions.py (scripted turns of real SmolLM2 ids); the
app, the session's token-exact rules and the dialect are the real ones. The same dialect on a live stack:
tests/integration/test_llm_comply.py (the ``llm-comply`` Anthropic checks) and tests/integration/test_agents.py
(an ``anthropic`` SDK agent).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import numpy as np
import pytest

from rollout_ledger.services.env_worker.sessions.app import SessionRegistry, session_app
from rollout_ledger.services.env_worker.sessions.dialects.messages import (
    canonical_id,
    error_body,
    parse,
    wire_id,
)
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.sessions.turns import ApiError, call_id
from rollout_ledger.services.env_worker.tokenization import Transcript, TurnTemplate
from rollout_ledger.shared.events import FinishReason, SamplingParams, TurnGenerated
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.unit.test_sessions import CALL_TEXT, ScriptedEpisode

ADD: Any = {"name": "add", "description": "Add two integers.",
            "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a", "b"]}}
MUL: Any = {"name": "mul", "description": "Multiply two integers.",
            "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
HI: Any = [{"role": "user", "content": "Hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 32, "messages": HI, **fields}


# --- protocol ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": ""}, "model"),
    ({"messages": []}, "messages"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe it."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                          {"type": "text", "text": "Hello"}]},
                   {"role": "user", "content": "Again"}]}, "messages[1].content[0]"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                   {"role": "user", "content": "Again"}]}, "messages[1].content[0]"),
    ({"messages": [*HI, {"role": "assistant", "content": "The answer is"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "first"},
                                                {"type": "tool_result", "tool_use_id": "t1", "content": "5"}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}]},
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "5"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add",
                                                          "input": "[1, 2]"}]}, {"role": "user", "content": "x"}]},
     "messages[1].content[0].input"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"system": [{"type": "image", "source": {}}]}, "system[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "tools[0]"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
    ({"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]}, "tools[0]"),
    ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [ADD, ADD]}, "tools[1].name"),
    ({"tools": [{"name": "add"}]}, "tools[0].input_schema"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "required"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "deep"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]}, "mcp_servers"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0]"),
])
def test_bad_requests_are_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    req = {k: v for k, v in body(**fields).items() if v is not None}
    with pytest.raises(ApiError) as err:
        parse(req, {})
    assert err.value.status == 400
    assert err.value.param == param and err.value.message.startswith(f"{param}: "), err.value.message
    shape = error_body(err.value)
    assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error"
    assert shape["error"]["message"] == err.value.message


def test_error_types_follow_the_status() -> None:
    kinds = {s: error_body(ApiError(s, "x"))["error"]["type"] for s in (400, 401, 403, 404, 409, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 409: "invalid_request_error", 429: "rate_limit_error",
                     500: "api_error", 503: "api_error"}
    coded = error_body(ApiError(400, "messages: too long", param="messages", code="context_length_exceeded"))
    assert coded["error"]["details"] == {"error_code": "context_length_exceeded"}


CLAUDE_CODE_READ: Any = {
    "name": "Read", "description": "Reads a file from the local filesystem.",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                      "limit": {"type": "number"}},
                     "required": ["file_path"], "additionalProperties": False,
                     "$schema": "http://json-schema.org/draft-07/schema#"}}


def claude_code_body(cache_on_last: bool) -> dict[str, Any]:
    """A request as Claude Code 2.1 sends it (``claude -p``, its shape abridged): system blocks and tools with
    cache_control, a system reminder block, a system message in ``messages``, a deferred tool, adaptive thinking,
    effort, metadata, a context-management edit clearing thinking, stream."""
    cache = {"type": "ephemeral"}
    read = {**CLAUDE_CODE_READ, **({"cache_control": cache} if cache_on_last else {})}
    last_text: dict[str, Any] = {"type": "text", "text": "Read README.md"}
    if cache_on_last:
        last_text["cache_control"] = cache
    return {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": cache},
                   {"type": "text", "text": "You are an interactive CLI tool.", "cache_control": cache}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer, use the context.\n</system-reminder>"},
            last_text]},
            {"role": "system", "content": "# Environment\n - Platform: linux"}],
        "tools": [read, {"name": "DeferredToolPlaceholder", "description": "x", "defer_loading": True,
                         "input_schema": {"type": "object", "properties": {}}}],
        "metadata": {"user_id": '{"device_id":"07ac","account_uuid":"","session_id":"15a8"}'},
        "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }


def test_what_claude_code_sends_is_accepted() -> None:
    turn, _ = parse(claude_code_body(cache_on_last=True), {})
    assert turn.messages == [
        {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
                                      "You are an interactive CLI tool."},
        {"role": "user", "content": "<system-reminder>\nAs you answer, use the context.\n</system-reminder>\n"
                                    "Read README.md"},
        {"role": "system", "content": "# Environment\n - Platform: linux"}]
    assert turn.tools is not None and turn.tools[0] == {"type": "function", "function": {
        "name": "Read", "description": CLAUDE_CODE_READ["description"], "parameters": CLAUDE_CODE_READ["input_schema"]}}
    assert [t["function"]["name"] for t in turn.tools] == ["Read", "DeferredToolPlaceholder"]
    assert turn.parse_tools and turn.tool_call is None and turn.stream and turn.max_tokens == 32000
    # cache_control moves between calls: it changes neither the conversation nor the tools (no new segment)
    moved, _ = parse(claude_code_body(cache_on_last=False), {})
    assert moved.messages == turn.messages and moved.tools == turn.tools
    counted, _ = parse({k: v for k, v in claude_code_body(True).items() if k != "max_tokens"}, {}, counting=True)
    assert counted.messages == turn.messages


def test_blocks_become_canonical_messages() -> None:
    ours = call_id("e:a1:t0:r1", 0)
    turn, _ = parse(body(system="Add numbers.", tools=[ADD], messages=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me add.", "citations": None},
            {"type": "tool_use", "id": wire_id(ours), "name": "add", "input": {"a": 2, "b": 3},
             "caller": {"type": "direct"}},
            {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "add", "input": {"a": 1, "b": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": wire_id(ours), "content": "5"},
            {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", "is_error": True,
             "content": [{"type": "text", "text": "Error:"}, {"type": "text", "text": "overflow"}]},
            {"type": "text", "text": "Go on."}]},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
    ], top_k=0, stop_sequences=["", "END"], tool_choice={"type": "auto", "disable_parallel_tool_use": True}), {})
    assert turn.messages == [
        {"role": "system", "content": "Add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": ours, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": ours},
        {"role": "tool", "content": "Error:\noverflow", "tool_call_id": "toolu_01A09q90qw90lq917835lq9"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "OK."},
        {"role": "tool", "content": "", "tool_call_id": "x"},
    ]
    assert turn.top_k == -1 and turn.stop == ["END"] and turn.parse_tools and turn.tool_call is None
    none, _ = parse(body(tools=[ADD], tool_choice={"type": "none"}), {})
    assert not none.parse_tools and none.tools is not None
    forced, _ = parse(body(tools=[ADD, MUL], tool_choice={"type": "any", "disable_parallel_tool_use": True}), {})
    assert forced.tool_call == {"names": ["add", "mul"], "parameters": {"add": ADD["input_schema"],
                                                                       "mul": MUL["input_schema"]}}
    named, _ = parse(body(tools=[ADD, MUL], tool_choice={"type": "tool", "name": "mul"}), {})
    assert named.tool_call == {"names": ["mul"], "parameters": {"mul": MUL["input_schema"]}}


def test_tool_use_ids_round_trip() -> None:
    ours = call_id("seed", 3)
    assert wire_id(ours).startswith("toolu_") and canonical_id(wire_id(ours)) == ours
    for foreign in ("toolu_01A09q90qw90lq917835lq9", "call_abc", "t1", ""):
        assert wire_id(foreign) == foreign and canonical_id(foreign) == foreign


# --- the endpoint on a scripted episode, through the SDK ---------------------------------------------------------
@dataclass
class CutEpisode(ScriptedEpisode):
    """A ``ScriptedEpisode`` whose turn is cut at the call's ``max_tokens`` (finish ``length``), as an engine's is."""

    cut: list[bool] = field(default_factory=list)

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        turn = await super().generate_turn(t, context, sampling, max_tokens)
        if len(turn.token_ids) <= max_tokens:
            return turn
        self.cut.append(True)
        ids = turn.token_ids[:max_tokens]
        return turn.model_copy(update={"token_ids": ids, "logprobs": turn.logprobs[:max_tokens],
                                       "top_logprobs": None, "finish_reason": FinishReason.LENGTH})


@dataclass
class Served:
    episode: CutEpisode
    session: AgentSession
    client: anthropic.AsyncAnthropic
    registry: SessionRegistry
    secret: str

    def other(self, episode_id: str = "e", **key: Any) -> anthropic.AsyncAnthropic:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=session_app(self.registry)))
        return anthropic.AsyncAnthropic(base_url=self.registry.url(episode_id).removesuffix("/v1"),
                                        http_client=http, max_retries=0, **key)


@pytest.fixture
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


@pytest.fixture
async def serve(tok: ChatTokenizer) -> AsyncIterator[Callable[[list[str]], Served]]:
    clients: list[anthropic.AsyncAnthropic] = []

    def open_session(script: list[str]) -> Served:
        episode = CutEpisode(tok, script)
        registry = SessionRegistry("SmolLM2-135M-Instruct")
        registry.base_url = "http://sessions"
        session = AgentSession(episode, TurnTemplate(tok), registry.model_name)
        secret = registry.open("e", session)
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=session_app(registry)))
        # Anthropic's base_url is the session's OpenAI base_url without /v1; the secret goes as x-api-key
        client = anthropic.AsyncAnthropic(base_url=registry.url("e").removesuffix("/v1"), api_key=secret,
                                          http_client=http, max_retries=0)
        clients.append(client)
        return Served(episode, session, client, registry, secret)

    yield open_session
    for client in clients:
        await client.close()


def sampled(tok: ChatTokenizer, text: str) -> list[int]:
    return [*tok.encode(text).tolist(), tok.tokenizer.token_to_id("<|im_end|>")]


def check_contexts(served: Served, tok: ChatTokenizer) -> Transcript:
    """Every request after the first was the previous one + its sampled ids + the step's delta (one segment), and
    decode == render held."""
    ep = served.episode
    for t in range(1, len(ep.requests)):
        prev, ctx = ep.requests[t - 1][0].tolist(), ep.requests[t][0].tolist()
        step = ep.steps[t - 1]
        assert not step["new_segment"] and step["drift"] is None, step
        assert ctx == prev + sampled(tok, ep.script[t - 1]) + step["ids"]
    transcript = served.session.transcript
    assert transcript is not None and transcript.check_results() == [True] * len(transcript.segments)
    return transcript


async def test_a_tool_loop_through_the_sdk_is_one_segment_token_exact(
        serve: Callable[[list[str]], Served], tok: ChatTokenizer) -> None:
    served = serve(["Hello!", f"Let me add. {CALL_TEXT}", "It is 5.", "Bye."])
    client, ep = served.client, served.episode
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    r0 = await client.messages.create(model="policy", max_tokens=32, system="You add numbers.", tools=[ADD],
                                      messages=messages, metadata={"user_id": "u"},
                                      extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})  # deprecated
    assert r0.content[0].type == "text" and r0.content[0].text == "Hello!" and len(r0.content) == 1
    assert r0.stop_reason == "end_turn" and r0.stop_sequence is None and r0.id.startswith("msg_")
    extra = r0.model_extra or {}
    assert extra["prompt_token_ids"] == ep.requests[0][0].tolist() and extra["token_ids"] == sampled(tok, "Hello!")
    assert (extra["episode_id"], extra["turn_index"], extra["segment"]) == ("e", 0, 0)
    assert r0.usage.input_tokens == len(extra["prompt_token_ids"]) and r0.usage.output_tokens == len(
        extra["token_ids"])
    first = ep.requests[0][1]
    assert (first.temperature, first.top_p, first.top_k, first.tool_call) == (0.5, 0.9, 40, None)
    assert ep.started[0][0] == {"role": "system", "content": "You add numbers."}

    messages += [r0.to_param(), {"role": "user", "content": "What is 2 + 3?"}]
    r1 = await client.messages.create(model="policy", max_tokens=48, system="You add numbers.", tools=[ADD],
                                      messages=messages)
    assert r1.stop_reason == "tool_use" and [b.type for b in r1.content] == ["text", "tool_use"]
    use = r1.content[1]
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
    assert use.id.startswith("toolu_") and r1.content[0].type == "text" and r1.content[0].text == "Let me add."

    # the SDK's own round trip: the message as a param, then the tool result and a text block after it
    messages += [r1.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "5"}, {"type": "text", "text": "Thanks."}]}]
    r2 = await client.messages.create(model="policy", max_tokens=48, system="You add numbers.", tools=[ADD],
                                      messages=messages)
    assert r2.content[0].type == "text" and r2.content[0].text == "It is 5."
    assert ep.steps[1]["observation"] == [{"role": "tool", "content": "5", "tool_call_id": use.id.replace(
        "toolu_", "call_")}, {"role": "user", "content": "Thanks."}]
    await served.session.finish(1.0)
    transcript = check_contexts(served, tok)
    assert len(transcript.segments) == 1 and ep.steps[-1]["final"]


async def test_stop_sequences_and_max_tokens(serve: Callable[[list[str]], Served], tok: ChatTokenizer) -> None:
    served = serve(["The answer is 4. Done.", "One two three four five six seven eight.", "ok"])
    client, ep = served.client, served.episode
    r0 = await client.messages.create(model="policy", max_tokens=32, messages=HI, stop_sequences=["zzz", " is"])
    assert r0.stop_reason == "stop_sequence" and r0.stop_sequence == " is"
    assert r0.content[0].type == "text" and r0.content[0].text == "The answer"
    assert ep.requests[0][1].stop == ["zzz", " is"]
    assert (r0.model_extra or {})["token_ids"] == sampled(tok, "The answer is 4. Done.")  # the ids as sampled

    msgs: list[Any] = [*HI, r0.to_param(), {"role": "user", "content": "Count."}]
    r1 = await client.messages.create(model="policy", max_tokens=3, messages=msgs)
    assert r1.stop_reason == "max_tokens" and r1.usage.output_tokens == 3 and ep.cut == [True]
    ids = (r1.model_extra or {})["token_ids"]
    assert len(ids) == 3 and r1.content[0].type == "text" and r1.content[0].text == tok.decode(ids)
    assert ep.requests[1][2] == 3  # the call's max_tokens reached the engine
    msgs += [r1.to_param(), {"role": "user", "content": "Thanks."}]
    await client.messages.create(model="policy", max_tokens=8, messages=msgs)
    assert [s["new_segment"] for s in ep.steps] == [False, False]  # the cut texts came back: one segment


async def test_tool_choice_any_and_tool_are_enforced(serve: Callable[[list[str]], Served]) -> None:
    served = serve([CALL_TEXT, CALL_TEXT.replace('"add"', '"mul"').replace('"a": 2, "b": 3', '"x": 7'), "Done."])
    client, ep = served.client, served.episode
    r0 = await client.messages.create(model="policy", max_tokens=48, messages=HI, tools=[ADD, MUL],
                                      tool_choice={"type": "any"})
    assert r0.stop_reason == "tool_use" and [b.type for b in r0.content] == ["tool_use"]
    constraint = ep.requests[0][1].tool_call
    assert constraint is not None and constraint.names == ["add", "mul"]
    assert constraint.parameters["add"] == ADD["input_schema"]
    use = r0.content[0]
    assert use.type == "tool_use"
    msgs: list[Any] = [*HI, r0.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    r1 = await client.messages.create(model="policy", max_tokens=48, messages=msgs, tools=[ADD, MUL],
                                      tool_choice={"type": "tool", "name": "mul", "disable_parallel_tool_use": True})
    named = ep.requests[1][1].tool_call
    assert named is not None and named.names == ["mul"] and r1.content[0].type == "tool_use"
    assert r1.content[0].input == {"x": 7}
    msgs += [r1.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": r1.content[0].id, "content": "7"}]}]
    await client.messages.create(model="policy", max_tokens=48, messages=msgs, tools=[ADD, MUL])
    assert ep.requests[2][1].tool_call is None  # auto: nothing forced
    assert [s["new_segment"] for s in ep.steps] == [False, False]  # tool_choice is not part of the prompt


async def _stream(client: anthropic.AsyncAnthropic, **kw: Any) -> tuple[anthropic.types.Message, str, list[int]]:
    text, ids = "", []
    async with client.messages.stream(**kw) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
                ids += (event.model_extra or {}).get("token_ids", [])
        final = await stream.get_final_message()
    return final, text, ids


@pytest.mark.parametrize(("script", "tools"), [
    (["Héllo wörld 🎲, twelve!"], False),
    ([f"Let me add. {CALL_TEXT}"], True),
    ([CALL_TEXT + CALL_TEXT.replace("2", "7")], True),
])
async def test_the_stream_rebuilds_the_non_stream_message(serve: Callable[[list[str]], Served], tok: ChatTokenizer,
                                                          script: list[str], tools: bool) -> None:
    kw: dict[str, Any] = {"model": "policy", "max_tokens": 128, "messages": HI, "system": "Be brief."}
    if tools:
        kw["tools"] = [ADD]
    plain = await serve(script).client.messages.create(**kw)  # the same scripted turn, in two sessions
    final, text, ids = await _stream(serve(script).client, **kw)
    want = plain.model_dump()
    got = final.model_dump()
    for block in got["content"]:  # ParsedTextBlock adds parsed_output (None without an output format)
        block.pop("parsed_output", None)
    assert got == want
    assert (final.model_extra or {})["token_ids"] == sampled(tok, script[0])
    if not tools:
        assert text == script[0] and ids == sampled(tok, script[0])  # one text delta per sampled id
    else:
        assert plain.stop_reason == "tool_use" and any(b.type == "tool_use" for b in final.content)


async def test_the_raw_stream_is_anthropics_event_sequence(serve: Callable[[list[str]], Served]) -> None:
    served = serve([f"Let me add. {CALL_TEXT}"])
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=session_app(served.registry)))
    async with http:
        resp = await http.post(served.registry.url("e") + "/messages", headers={"x-api-key": served.secret},
                               json=body(tools=[ADD], stream=True))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in resp.text.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["stop_reason"] is None
    assert datas[4]["content_block"]["input"] == {} and json.loads(datas[5]["delta"]["partial_json"]) == {
        "a": 2, "b": 3}
    assert datas[7]["delta"]["stop_reason"] == "tool_use" and datas[7]["usage"]["output_tokens"] == len(
        datas[0]["message"]["token_ids"])


async def test_thinking_config_is_accepted_and_nothing_is_invented(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["Four.", "Still four."])
    r0 = await served.client.messages.create(model="policy", max_tokens=4096, messages=HI,
                                             thinking={"type": "enabled", "budget_tokens": 2048})
    assert [b.type for b in r0.content] == ["text"] and r0.content[0].type == "text"
    assert r0.content[0].text == "Four."
    r1 = await served.client.messages.create(model="policy", max_tokens=64, thinking={"type": "adaptive"},
                                             messages=[*HI, r0.to_param(), {"role": "user", "content": "Again."}])
    assert r1.content[0].type == "text" and r1.content[0].text == "Still four."


async def test_count_tokens_counts_what_the_call_would_render(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["Hello!"])
    client, ep = served.client, served.episode
    counted = await client.messages.count_tokens(model="policy", system="Be brief.", messages=HI, tools=[ADD])
    assert ep.requests == [] and ep.started == []  # nothing sampled, nothing recorded
    made = await client.messages.create(model="policy", max_tokens=8, system="Be brief.", messages=HI, tools=[ADD])
    assert counted.input_tokens == made.usage.input_tokens == len(ep.requests[0][0])
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.count_tokens(model="policy", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}])
    assert (bad.value.body or {})["error"]["message"].startswith("messages[0].content[0]: image blocks")  # type: ignore[index]


async def test_errors_come_back_in_anthropics_shape(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["Hello!", "Again."])
    client, ep = served.client, served.episode
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="policy", max_tokens=8, messages=HI, extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400 and bad.value.type == "invalid_request_error"
    assert bad.value.api_message is not None and bad.value.api_message.startswith("temperature: ")
    assert bad.value.body == {"type": "error", "request_id": None, "error": {
        "type": "invalid_request_error", "message": bad.value.api_message, "param": "temperature"}}
    with pytest.raises(anthropic.BadRequestError) as tool:
        await client.messages.create(model="policy", max_tokens=8, messages=HI,
                                     tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert tool.value.api_message is not None and "web_search" in tool.value.api_message
    # max_tokens is required (the SDK's types require it too: the body goes raw)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=session_app(served.registry)))
    async with http:
        raw = await http.post(served.registry.url("e") + "/messages", headers={"x-api-key": served.secret},
                              json={"model": "policy", "messages": HI})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("max_tokens: required")
    assert ep.requests == []  # nothing reached the policy
    for key in ({"api_key": "sess-guessed"}, {"auth_token": "sess-guessed"}):
        wrong = served.other(**key)
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(model="policy", max_tokens=8, messages=HI)
        assert denied.value.type == "authentication_error" and denied.value.error_code == "invalid_api_key"
        await wrong.close()
    bearer = served.other(auth_token=served.secret)  # Authorization: Bearer, as ANTHROPIC_AUTH_TOKEN sends it
    assert (await bearer.messages.create(model="policy", max_tokens=8, messages=HI)).content[0].type == "text"
    await bearer.close()
    missing = served.other("nope", api_key=served.secret)
    with pytest.raises(anthropic.NotFoundError) as gone:
        await missing.messages.create(model="policy", max_tokens=8, messages=HI)
    assert gone.value.type == "not_found_error"
    await missing.close()
    assert len(ep.requests) == 1


async def test_an_inference_failure_is_a_5xx_in_anthropics_shape(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["x"])
    served.episode.fail = True
    with pytest.raises(anthropic.InternalServerError) as err:
        await served.client.messages.create(model="policy", max_tokens=8, messages=HI)
    assert err.value.status_code == 503 and err.value.type == "api_error"
    assert served.session.ending is not None and served.session.ending.failure_class is not None


def test_an_empty_turn_still_has_a_text_block(tok: ChatTokenizer) -> None:
    from rollout_ledger.services.env_worker.sessions.dialects.messages import message
    from rollout_ledger.services.env_worker.sessions.turns import AssistantTurn, TurnResult

    result = TurnResult(turn=AssistantTurn(content="", tool_calls=[], finish_reason="stop"), stop_string=None,
                        prompt_token_ids=[1, 2], token_ids=[2], logprobs=None, token_texts=[], event_id="e:t0",
                        model="m", created=0)
    msg = anthropic.types.Message.model_validate(message(result))
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", "")]
    assert msg.usage.output_tokens == 1 and np.array_equal((msg.model_extra or {})["token_ids"], [2])
