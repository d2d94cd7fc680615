"""The session endpoint through the official ``openai`` SDK, in process (ASGI transport), on a scripted episode.

The episode is a fake ``EpisodeSink`` (scripted turns of real SmolLM2 ids, events kept in lists); the app,
the session's token-exact rules and the protocol mapping are the real ones. The same endpoint against the
real model, NATS and Postgres is tested in tests/e2e/test_agents_vllm.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import numpy as np
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rollout_ledger.services.env_worker.sessions.app import SessionRegistry, session_app
from rollout_ledger.services.env_worker.sessions.dialects.chat_completions import (
    Completion,
    normalize_messages,
    parse_request,
)
from rollout_ledger.services.env_worker.sessions.dialects.chat_completions import error_body as chat_error_body
from rollout_ledger.services.env_worker.sessions.dialects.sse import sse
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.sessions.turns import (
    ApiError,
    assistant_turn,
    same_message,
    split_tool_blocks,
    token_texts,
)
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript, TurnTemplate
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import FinishReason, SamplingParams, TurnGenerated
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer

EOS = "<|im_end|>"
TOOLS: Any = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}},
                                               "required": ["a", "b"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


# --- protocol ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function",
                                                                      "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "nope"}}]}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "custom", "custom": {"name": "add"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "any"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"50256": -100}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "add"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "final_output", "schema": {}}}},
     "response_format"),
])
def test_bad_requests_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request({"model": "policy", **body})
    assert err.value.status == 400
    assert err.value.param is not None and err.value.param.startswith(param)
    assert chat_error_body(err.value)["error"]["type"] == "invalid_request_error"
    assert param in err.value.message


STRICT_ADD: Any = {"type": "function", "function": {
    "name": "add_numbers", "description": "Add two integers and return the sum.", "strict": True,
    "parameters": {"properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
                   "required": ["a", "b"], "title": "add_numbers_args", "type": "object",
                   "additionalProperties": False}}}


@pytest.mark.parametrize("body", [
    pytest.param({  # OpenAIChatCompletionsModel with ModelSettings(...) (Runner.run_streamed)
        "model": "policy", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"content": "Use the tool.", "role": "system"}, {"role": "user", "content": "2+3?"}],
        "tools": [STRICT_ADD], "tool_choice": "auto",
        "parallel_tool_calls": False, "store": False, "metadata": {"suite": "agents"}, "logprobs": True,
        "top_logprobs": 1, "max_tokens": 48, "temperature": 0.3, "verbosity": "low", "reasoning_effort": "low",
        "prompt_cache_retention": "in_memory"}, id="openai-agents"),
    pytest.param({  # ChatOpenAI(stream_usage=True).bind_tools([add], tool_choice="auto", strict=True).astream
        "model": "policy", "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
        "max_completion_tokens": 48, "temperature": 0.7, "tool_choice": "auto", "parallel_tool_calls": False,
        "messages": [{"content": "sys", "role": "system"}, {"content": "hi", "role": "user", "name": "ann"}],
        "tools": [STRICT_ADD]}, id="langchain"),
    pytest.param({  # OpenAI's allowed_tools choice (every tool, auto), and nulls where OpenAI takes null for "unset"
        "model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": [STRICT_ADD], "stream": None,
        "n": None, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "add_numbers"}}]}},
        "stream_options": {"include_usage": None}, "logit_bias": {}, "seed": None, "user": "u",
        "prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto", "modalities": ["text"],
        "a_field_nobody_knows": {"x": 1}}, id="allowed-tools-and-nulls"),
])
def test_what_the_sdks_send_is_accepted(body: dict[str, Any]) -> None:
    req = parse_request(body)
    assert req.parses_tool_calls
    assert req.include_usage == bool(body.get("stream_options", {}).get("include_usage"))
    assert req.completion_limit == body.get("max_tokens", body.get("max_completion_tokens"))
    schemas = req.tool_schemas
    assert schemas is not None and schemas[0]["function"]["strict"] is True  # rendered as sent


def test_messages_are_normalised() -> None:
    msgs = normalize_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "refusal": None, "audio": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    with pytest.raises(ApiError, match=r"messages\[0\].content\[0\]: only text"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ApiError, match=r"messages\[0\].role"):
        normalize_messages([{"role": "robot", "content": "x"}])


def test_returned_assistant_message_matches_semantically() -> None:
    returned = {"role": "assistant", "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add",
                                                                            "arguments": '{"a": 1, "b": 2}'}}]}
    redumped = json.loads(json.dumps(returned))
    redumped["tool_calls"][0]["function"]["arguments"] = '{"b":2,"a":1}'
    assert same_message(redumped, returned)
    other_id = json.loads(json.dumps(returned))
    other_id["tool_calls"][0]["id"] = "c2"
    assert not same_message(other_id, returned)
    assert not same_message({"role": "assistant", "content": "edited"}, {"role": "assistant", "content": "x"})


# --- mapping ----------------------------------------------------------------------------------------------
def test_tool_calls_are_parsed_from_hermes_text() -> None:
    turn = assistant_turn(f"Let me add. {CALL_TEXT}", "stop", parse_tools=True, id_seed="t0")
    assert turn.finish_reason == "tool_calls" and turn.content == "Let me add."
    assert turn.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    two = assistant_turn(CALL_TEXT + CALL_TEXT.replace("2", "7"), "stop", parse_tools=True, id_seed="t0")
    assert [c["function"]["arguments"] for c in two.tool_calls] == ['{"a": 2, "b": 3}', '{"a": 7, "b": 3}']
    assert two.content is None and len({c["id"] for c in two.tool_calls}) == 2
    bad = assistant_turn("<tool_call>{not json}</tool_call>", "stop", parse_tools=True, id_seed="t0")
    assert bad.tool_calls == [] and bad.content == "<tool_call>{not json}</tool_call>" and bad.finish_reason == "stop"
    off = assistant_turn(CALL_TEXT, "length", parse_tools=False, id_seed="t0")
    assert off.tool_calls == [] and off.finish_reason == "length"
    assert split_tool_blocks("plain") is None


def _completion(tok: ChatTokenizer, text: str, *, tools: bool, logprobs: bool) -> Completion:
    ids = [*tok.encode(text).tolist(), tok.tokenizer.token_to_id(EOS)]
    lps = [-0.5] * len(ids)
    from rollout_ledger.services.env_worker.sessions.turns import logprob_entries as logprobs_content

    top = [{i: -0.5, 42: -1.5} for i in ids]
    turn = assistant_turn(text, "stop", parse_tools=tools, id_seed="x")
    return Completion(id="chatcmpl-1", created=1, model="m", turn=turn, prompt_token_ids=[1, 2, 3], token_ids=ids,
                      logprobs=logprobs_content(tok, np.array(ids), np.array(lps), top, 2) if logprobs else None,
                      token_texts=token_texts(tok, ids), extra={"episode_id": "e"})


def test_response_and_chunks_parse_with_the_sdk_types(model_dir: str) -> None:
    tok = load_chat_tokenizer(model_dir)
    text = "Héllo wörld 🎲, twelve!"
    c = _completion(tok, text, tools=False, logprobs=True)
    resp = ChatCompletion.model_validate(c.response())
    assert resp.choices[0].message.content == text
    assert resp.usage is not None and resp.usage.completion_tokens == len(c.token_ids)
    assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content is not None
    assert len(resp.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = [ChatCompletionChunk.model_validate(ch) for ch in c.chunks(include_usage=True)]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 3 + len(
        c.token_ids)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    state = ChatCompletionStreamState()
    for ch in c.chunks(include_usage=True):
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    assert state.get_final_completion().choices[0].message.content == text
    wire = b"".join(sse(ch) for ch in c.chunks(include_usage=False))
    assert wire.startswith(b"data: {") and wire.endswith(b"\n\n")

    calls = _completion(tok, CALL_TEXT, tools=True, logprobs=False)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for ch in calls.chunks(include_usage=False):
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    final = state.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    tool_calls = final.choices[0].message.tool_calls
    assert tool_calls is not None and tool_calls[0].type == "function" and tool_calls[0].function.name == "add"


def test_token_texts_concatenate_to_the_text(model_dir: str) -> None:
    tok = load_chat_tokenizer(model_dir)
    for text in ("plain ascii", "ünïcödé 🎲🎲 and 漢字", ""):
        ids = [*tok.encode(text).tolist(), tok.tokenizer.token_to_id(EOS)]
        assert "".join(token_texts(tok, ids)) == text


# --- the endpoint on a scripted episode -----------------------------------------------------------------
@dataclass
class ScriptedEpisode:
    """An ``EpisodeSink`` answering turn t with ``script[t]`` (real ids), keeping what it would publish."""

    tok: ChatTokenizer
    script: list[str]
    max_turns: int = 8
    max_model_len: int = 2048
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=64))
    started: list[list[dict[str, Any]]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[np.ndarray, SamplingParams, int]] = field(default_factory=list)
    fail: bool = False

    def batch_cancelled(self) -> bool:
        return False

    async def publish_started(self, transcript: Transcript, messages: list[dict[str, Any]]) -> None:
        self.started.append(messages)

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        if self.fail:
            raise InferenceError("no worker", retryable=True)
        self.requests.append((np.array(context), sampling, max_tokens))
        ids = np.append(self.tok.encode(self.script[t]), np.int32(self.tok.tokenizer.token_to_id(EOS)))
        return TurnGenerated(
            event_id=f"e:a1:t{t}:r1", episode_id="e", batch_id="b", attempt=1, seq=2 * t + 1, produced_by="test",
            request_id=f"e:a1:t{t}:r1", turn_index=t, prompt_len=len(context), token_ids=ids.astype(np.int32),
            logprobs=np.full(len(ids), -0.25, dtype=np.float32), top_logprobs=[{int(i): -0.25} for i in ids],
            finish_reason=FinishReason.STOP, weight_version=3, engine="test", worker_id="w", queue_ms=0.0,
            generate_ms=0.0)

    async def publish_step(self, t: int, turn: TurnGenerated, action: str, observation: list[dict[str, Any]],
                           delta: Delta, *, final: bool, reward: float = 0.0, terminated: bool = False,
                           truncated: bool = False, info: dict[str, Any] | None = None) -> None:
        self.steps.append({"t": t, "ids": delta.ids.tolist(), "new_segment": delta.new_segment,
                           "drift": None if delta.drift is None else delta.drift.value, "final": final,
                           "reward": reward, "observation": observation})


@pytest.fixture
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


@dataclass
class Served:
    episode: ScriptedEpisode
    session: AgentSession
    client: openai.AsyncOpenAI
    registry: SessionRegistry


@pytest.fixture
async def served(tok: ChatTokenizer) -> AsyncIterator[Served]:
    episode = ScriptedEpisode(tok, ["Hello!", CALL_TEXT, "It is 5.", "Bye."])
    registry = SessionRegistry("SmolLM2-135M-Instruct")
    registry.base_url = "http://sessions"
    session = AgentSession(episode, TurnTemplate(tok), registry.model_name)
    secret = registry.open("e", session)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=session_app(registry)))
    client = openai.AsyncOpenAI(base_url=registry.url("e"), api_key=secret, http_client=cast(Any, http),
                                max_retries=0)
    yield Served(episode, session, client, registry)
    await client.close()


def _ids_of(transcript: Transcript) -> list[int]:
    return transcript.ids.tolist()


async def test_a_conversation_through_the_sdk_is_token_exact(served: Served, tok: ChatTokenizer) -> None:
    client, ep = served.client, served.episode
    models = await client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    msgs: list[Any] = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Hi"}]
    r0 = await client.chat.completions.create(model="policy", messages=msgs, logprobs=True, top_logprobs=1,
                                              temperature=0.5, seed=7)
    assert r0.choices[0].message.content == "Hello!"
    assert r0.model_extra is not None and r0.model_extra["prompt_token_ids"] == ep.requests[0][0].tolist()
    assert r0.choices[0].model_extra is not None and r0.choices[0].model_extra["token_ids"][-1] == 2
    assert ep.requests[0][1].temperature == 0.5 and ep.requests[0][1].seed == 7 and ep.requests[0][1].logprobs == 1
    msgs += [r0.choices[0].message, {"role": "user", "content": "What is 2 + 3?"}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    # a tools change is a rewrite of the conversation: a new segment
    assert ep.steps[0]["new_segment"] and ep.steps[0]["drift"] == "history_rewrite"
    call = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls" and call is not None
    msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": call[0].id, "content": "5"}]
    stream = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS,
                                                  stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == "It is 5." and usage is not None
    # the tool result extended the context: only the template delta was appended
    assert ep.steps[1] == {"t": 1, "ids": ep.steps[1]["ids"], "new_segment": False, "drift": None, "final": False,
                           "reward": 0.0, "observation": [{"role": "tool", "content": "5",
                                                            "tool_call_id": call[0].id}]}
    await served.session.finish(1.0)
    assert ep.steps[-1]["final"] and ep.steps[-1]["ids"] == [] and ep.steps[-1]["reward"] == 1.0
    transcript = served.session.transcript
    assert transcript is not None
    assert transcript.check_results() == [True, True]
    # each request's context is exactly the open segment: previous request + sampled ids + the delta
    seg2 = transcript.segments[1]
    ctx1, ctx2 = ep.requests[1][0].tolist(), ep.requests[2][0].tolist()
    assert _ids_of(transcript)[seg2[0]:seg2[0] + len(ctx1)] == ctx1
    sampled1 = [*tok.encode(CALL_TEXT).tolist(), 2]
    assert ctx2 == ctx1 + sampled1 + ep.steps[1]["ids"]


async def test_rewritten_history_starts_a_new_segment_never_a_500(served: Served) -> None:
    client, ep = served.client, served.episode
    msgs: list[Any] = [{"role": "user", "content": "Hi"}]
    r0 = await client.chat.completions.create(model="p", messages=msgs)
    edited: Any = {"role": "assistant", "content": (r0.choices[0].message.content or "") + " (edited)"}
    await client.chat.completions.create(model="p", messages=[*msgs, edited, {"role": "user", "content": "Again"}])
    assert ep.steps[0]["new_segment"] and ep.steps[0]["drift"] == "history_rewrite"
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Fresh start"}])
    assert ep.steps[1]["new_segment"]
    transcript = served.session.transcript
    assert transcript is not None and len(transcript.segments) == 3


async def test_errors_come_back_in_the_openai_shape(served: Served) -> None:
    client, ep = served.client, served.episode
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], n=2)
    assert bad.value.status_code == 400 and "n=1" in bad.value.message
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "n"
    other = openai.AsyncOpenAI(base_url=served.registry.url("nope"), api_key="k", max_retries=0,
                               http_client=cast(Any, httpx.AsyncClient(transport=httpx.ASGITransport(
                                   app=session_app(served.registry)))))
    with pytest.raises(openai.NotFoundError):
        await other.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    await other.close()
    ep.max_turns = 1
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as budget:
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert budget.value.code == "max_turns_exceeded"
    assert served.session.ending is not None and served.session.ending.reason == "max_turns"


async def test_a_call_without_the_sessions_own_key_is_a_401_and_stores_nothing(
        live: Callable[[dict[str, list[str]]], Live]) -> None:
    served = live({"a": ["Hello from A.", "Bye."], "b": ["Hello from B.", "Bye."]})
    assert served.secrets["a"] != served.secrets["b"]
    msgs: Any = [{"role": "user", "content": "Hi"}]
    own_a = served.client("a")
    assert (await own_a.chat.completions.create(model="p", messages=msgs)).choices[0].message.content == \
        "Hello from A."
    # A's key on B's path, a made-up key and no key at all: 401 in the OpenAI shape, B's episode untouched
    for key in (served.secrets["a"], "sess-guessed"):
        foreign = served.client("b", api_key=key)
        with pytest.raises(openai.AuthenticationError) as denied:
            await foreign.chat.completions.create(model="p", messages=msgs)
        assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
        assert isinstance(denied.value.body, dict) and "api_key" in denied.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            await foreign.models.list()
        await foreign.close()
    async with httpx.AsyncClient() as raw:
        bare = await raw.post(served.registry.url("b") + "/chat/completions", json={"model": "p", "messages": msgs})
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "invalid_request_error"
    assert served.episodes["b"].requests == [] and served.episodes["b"].steps == []
    assert served.sessions["b"].turns == 0
    # B's own agent still works, and A's episode got exactly its own call
    own_b = served.client("b")
    assert (await own_b.chat.completions.create(model="p", messages=msgs)).choices[0].message.content == \
        "Hello from B."
    assert len(served.episodes["a"].requests) == 1 and len(served.episodes["b"].requests) == 1
    # a closed session's key is refused with the rest of it
    served.registry.close("a")
    with pytest.raises(openai.NotFoundError):
        await own_a.chat.completions.create(model="p", messages=msgs)
    await own_a.close()
    await own_b.close()


async def test_an_inference_failure_is_a_503_and_ends_the_session(served: Served) -> None:
    served.episode.fail = True
    with pytest.raises(openai.InternalServerError) as err:
        await served.client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503
    assert served.session.ending is not None and served.session.ending.failure_class is not None


async def test_refusals_tell_the_sdks_not_to_retry(served: Served) -> None:
    """A retried call would only meet the same refusal (or be another turn): errors say ``x-should-retry: false``,
    which the SDKs obey even with retries on."""
    sent: list[str] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.url.path)

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=session_app(served.registry)),
                             event_hooks={"request": [count]})
    client = openai.AsyncOpenAI(base_url=served.registry.url("e"), api_key=served.client.api_key,
                                http_client=cast(Any, http), max_retries=3)
    served.episode.fail = True
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert err.value.response.headers["x-should-retry"] == "false" and len(sent) == 1
    with pytest.raises(openai.APIStatusError):  # the session is over: refused, once
        await client.responses.create(model="p", input="x")
    assert len(sent) == 2
    await client.close()


# --- agent functions ------------------------------------------------------------------------------------
def test_agents_are_parsed_and_imported() -> None:
    from rollout_ledger.services.env_worker.agents.run import AgentLoadError, load_agents, parse_agents

    assert parse_agents(" a=tests.agents:plain, b = tests.agents:tools ,") == {"a": "tests.agents:plain",
                                                                             "b": "tests.agents:tools"}
    for bad in ("a", "a=tests.agents", "=m:f", "a=m:f,a=m:g"):
        with pytest.raises(AgentLoadError):
            parse_agents(bad)
    agents = load_agents("calc=examples.agent.calculator:run")
    assert agents["calc"].advert("w")["agent"] == "examples.agent.calculator:run"
    assert agents["calc"].description.startswith("Answer")
    with pytest.raises(AgentLoadError, match="async function"):
        load_agents("x=tests.agents:_check_ids")
    with pytest.raises(AgentLoadError, match="has no"):
        load_agents("x=tests.agents:nope")
    with pytest.raises(AgentLoadError, match="cannot import"):
        load_agents("x=tests.no_such_module:run")


def test_agent_results() -> None:
    from rollout_ledger.services.env_worker.agents.run import agent_result

    assert agent_result(1).reward == 1.0
    full = agent_result({"reward": 0.5, "info": {"k": {1, 2}}, "answer": ["x"]})
    assert (full.reward, full.answer) == (0.5, ["x"]) and isinstance(full.info["k"], list | str)
    bads: list[Any] = [None, "1", True, {"info": {}}, {"reward": "1"}, {"reward": 1, "info": [1]}, float("nan")]
    for bad in bads:
        with pytest.raises(ValueError):
            agent_result(bad)


# --- LangChain and the OpenAI Agents SDK on a live endpoint ---------------------------------------------
@dataclass
class Live:
    """The session app on a real socket (LangChain builds its own HTTP client from a URL), one session each."""

    registry: SessionRegistry
    episodes: dict[str, ScriptedEpisode]
    sessions: dict[str, AgentSession]
    secrets: dict[str, str]

    def client(self, episode_id: str, api_key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.registry.url(episode_id), max_retries=0,
                                  api_key=self.secrets[episode_id] if api_key is None else api_key)


@pytest.fixture
async def live(tok: ChatTokenizer) -> AsyncIterator[Callable[[dict[str, list[str]]], Live]]:
    from rollout_ledger.shared.kit.runtime import HttpServer

    registry = SessionRegistry("SmolLM2-135M-Instruct")
    server = HttpServer(session_app(registry), "127.0.0.1", 0)
    await server.start()
    registry.base_url = f"http://127.0.0.1:{server.port}"

    def open_sessions(scripts: dict[str, list[str]]) -> Live:
        episodes = {ep: ScriptedEpisode(tok, script) for ep, script in scripts.items()}
        sessions = {ep: AgentSession(episode, TurnTemplate(tok), registry.model_name)
                    for ep, episode in episodes.items()}
        keys = {ep: registry.open(ep, session) for ep, session in sessions.items()}
        return Live(registry, episodes, sessions, keys)

    yield open_sessions
    await server.stop()


def _check_contexts(episode: ScriptedEpisode, transcript: Transcript, tok: ChatTokenizer) -> None:
    """Every request after the first was the previous one + its sampled ids + the step's delta (no new segment),
    or the step's whole re-rendered context (new segment); decode == render for every segment."""
    for t in range(1, len(episode.requests)):
        prev, ctx = episode.requests[t - 1][0].tolist(), episode.requests[t][0].tolist()
        step = episode.steps[t - 1]
        sampled = [*tok.encode(episode.script[t - 1]).tolist(), tok.tokenizer.token_to_id(EOS)]
        assert ctx == (step["ids"] if step["new_segment"] else prev + sampled + step["ids"])
    assert transcript.check_results() == [True] * len(transcript.segments)


async def test_langchain_and_the_openai_agents_sdk_are_token_exact(live: Callable[[dict[str, list[str]]], Live],
                                                                    tok: ChatTokenizer) -> None:
    from tests.agents import langchain, openai_agents

    add_call = CALL_TEXT.replace('"add"', '"add_numbers"')
    served = live({"lc": ["Maybe 5.", f"Let me check. {CALL_TEXT}", "The sum is 5."],
                   "oa": [add_call, "The sum is 5."]})
    task = {"a": 2, "b": 3, "temperature": 0.5}
    lc_client, oa_client = served.client("lc"), served.client("oa")
    lc = await langchain(task, lc_client)
    oa = await openai_agents(task, oa_client)
    await lc_client.close()
    await oa_client.close()
    assert lc == {"reward": 1.0, "answer": "The sum is 5.", "info": {"tool_calls": 1, "first": "Maybe 5.",
                                                                      "usage": lc["info"]["usage"]}}
    assert oa == {"reward": 1.0, "answer": "The sum is 5.", "info": {"tool_calls": 1, "requests": 2}}
    for ep, session in served.sessions.items():
        await session.finish(1.0)
        episode, transcript = served.episodes[ep], session.transcript
        assert transcript is not None
        _check_contexts(episode, transcript, tok)
        assert all(r[1].temperature == 0.5 and r[2] == 48 for r in episode.requests)
    lc_steps, oa_steps = served.episodes["lc"].steps, served.episodes["oa"].steps
    # LangChain: bind_tools adds the tools to the prompt (a rewrite: new segment); the tool round trip extends it
    assert [(s["new_segment"], s["drift"]) for s in lc_steps] == [(True, "history_rewrite"), (False, None),
                                                                 (False, None)]
    (tool_result,) = lc_steps[1]["observation"]
    assert tool_result["role"] == "tool" and tool_result["content"] == "5"
    assert tool_result["tool_call_id"].startswith("call_")  # the id we returned, sent back by LangChain
    assert [(s["new_segment"], s["drift"]) for s in oa_steps] == [(False, None), (False, None)]
    assert served.episodes["oa"].requests[0][1].logprobs == 1  # ModelSettings(top_logprobs=1)


async def test_an_openai_agents_sdk_streamed_run(live: Callable[[dict[str, list[str]]], Live],
                                                 tok: ChatTokenizer) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner

    from tests.agents import add_numbers

    add_call = CALL_TEXT.replace('"add"', '"add_numbers"')
    served = live({"s": [f"Adding. {add_call}", "It is 5 🎲."], "f": [add_call, "It is 5."]})
    forced = Agent(name="adder", instructions="Add.", tools=[add_numbers],
                   model=OpenAIChatCompletionsModel(model="policy", openai_client=served.client("f")),
                   model_settings=ModelSettings(tool_choice="required", include_usage=True))
    done = await Runner.run(forced, "2 + 3?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    # required is sent to the engine as a constraint; the SDK resets tool_choice after the call
    first, second = (r[1].tool_call for r in served.episodes["f"].requests)
    assert done.final_output == "It is 5." and second is None
    assert first is not None and first.names == ["add_numbers"] and first.parameters["add_numbers"] == \
        add_numbers.params_json_schema  # the tool's schema: the engine constrains the arguments with it
    client = served.client("s")
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="adder", instructions="Add.", tools=[add_numbers], model=model,
                  model_settings=ModelSettings(tool_choice="auto", parallel_tool_calls=True, include_usage=True))
    result = Runner.run_streamed(agent, "2 + 3?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    deltas = [e async for e in result.stream_events() if e.type == "raw_response_event"]
    await client.close()
    assert result.final_output == "It is 5 🎲." and deltas
    usage = result.context_wrapper.usage
    # include_usage: the SDK summed our usage chunks (sampled ids, end-of-turn included)
    assert usage.requests == 2
    assert usage.output_tokens == sum(len(tok.encode(t)) + 1 for t in served.episodes["s"].script)
    session = served.sessions["s"]
    await session.finish(1.0)
    assert session.transcript is not None
    _check_contexts(served.episodes["s"], session.transcript, tok)
    assert [s["drift"] for s in served.episodes["s"].steps] == [None, None]  # same tools: one segment
