"""OpenAI semantics of the session endpoint, through the official ``openai`` SDK (in process, ASGI transport):
stop strings (content cut before the stop string, ids verbatim), ``tool_choice`` (``required`` and a named
function enforced by the engine and recorded token-exact; a choice no constraint expresses refused with a 400, never
silently accepted), ``model`` required, and tools changing between calls (a new segment).

The turns come from the real ``FakeEngine`` (it stops on a stop string as vLLM does: the ids run through the
one completing it, no eos) or from scripted ids that end the way vLLM's do; the app, session and mapping are the
real ones. The same stop-string rules against vLLM: tests/e2e/test_stop_strings_vllm.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import numpy as np
import openai
import pytest

from rollout_ledger.services.env_worker.sessions.app import SessionRegistry, session_app
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.sessions.turns import clip_texts
from rollout_ledger.services.env_worker.stop_strings import cut_at_stop
from rollout_ledger.services.env_worker.tokenization import Delta, Transcript, TurnTemplate
from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.shared.events import FinishReason, SamplingParams, TurnGenerated
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer

TOOLS: Any = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}},
                                               "required": ["a", "b"]}}}]
MUL: Any = {"type": "function", "function": {"name": "mul", "description": "Multiply two integers.",
                                             "parameters": {"type": "object", "properties": {}}}}


# --- pure rules -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "stop", "want"), [
    ("The answer is 4.", ["answer"], ("The ", True)),
    ("The answer is 4.", ["zzz"], ("The answer is 4.", False)),
    ("The answer is 4.", [], ("The answer is 4.", False)),
    ("xabc", ["abc", "b"], ("xa", True)),  # "b" ends first: it is what stopped the engine
    ("xab", ["ab", "b"], ("x", True)),  # both end together: the first listed
    ("a.\nb", ["."], ("a", True)),  # the token ".\n" carries text after the stop string: dropped
    ("", ["x"], ("", False)),
])
def test_cut_at_stop(text: str, stop: list[str], want: tuple[str, bool]) -> None:
    assert cut_at_stop(text, stop) == want


def test_clip_texts() -> None:
    assert clip_texts(["The", " ans", "wer", ""], 5) == ["The", " a", "", ""]
    assert clip_texts(["a", "b"], 9) == ["a", "b"]


# --- an episode answered by a real engine (the fake) ----------------------------------------------------
@dataclass
class EngineEpisode:
    """An ``EpisodeSink`` whose turns an engine samples (the fake here, vLLM in tests/e2e) or ``scripted`` ids
    (when set for turn t), keeping what the episode would publish (the actions recorded, the deltas)."""

    tok: ChatTokenizer
    engine: Engine
    scripted: dict[int, tuple[list[int], FinishReason]] = field(default_factory=dict)
    max_turns: int = 8
    max_model_len: int = 2048
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=64))
    turns: list[TurnGenerated] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def batch_cancelled(self) -> bool:
        return False

    async def publish_started(self, transcript: Transcript, messages: list[dict[str, Any]]) -> None:
        pass

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        if t in self.scripted:
            ids_list, finish = self.scripted[t]
            ids, reason = np.asarray(ids_list, dtype=np.int32), finish
        else:
            gen = await self.engine.generate(f"r{t}", np.asarray(context), sampling, max_tokens, session_key="e")
            ids, reason = gen.token_ids, gen.finish_reason
        turn = TurnGenerated(
            event_id=f"e:a1:t{t}:r1", episode_id="e", batch_id="b", attempt=1, seq=2 * t + 1, produced_by="test",
            request_id=f"e:a1:t{t}:r1", turn_index=t, prompt_len=len(context), token_ids=ids,
            logprobs=np.full(len(ids), -0.25, dtype=np.float32), finish_reason=reason, weight_version=1,
            engine=self.engine.name, worker_id="w", queue_ms=0.0, generate_ms=0.0)
        self.turns.append(turn)
        return turn

    async def publish_step(self, t: int, turn: TurnGenerated, action: str, observation: list[dict[str, Any]],
                           delta: Delta, *, final: bool, reward: float = 0.0, terminated: bool = False,
                           truncated: bool = False, info: dict[str, Any] | None = None) -> None:
        self.steps.append({"t": t, "action": action, "token_ids": turn.token_ids.tolist(), "final": final,
                           "new_segment": delta.new_segment,
                           "drift": None if delta.drift is None else delta.drift.value})


@dataclass
class Served:
    episode: EngineEpisode
    session: AgentSession
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient


def open_in_process(episode: EngineEpisode) -> Served:
    """A session of ``episode`` on the real app, reached by the SDK in process (ASGI transport)."""
    registry = SessionRegistry("SmolLM2-135M-Instruct")
    registry.base_url = "http://sessions"
    session = AgentSession(episode, TurnTemplate(episode.tok), registry.model_name)
    secret = registry.open("e", session)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=session_app(registry)))
    client = openai.AsyncOpenAI(base_url=registry.url("e"), api_key=secret, http_client=cast(Any, http),
                                max_retries=0)
    return Served(episode, session, client, http)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


@pytest.fixture
async def serve(model_dir: str, tok: ChatTokenizer) -> AsyncIterator[Callable[..., Served]]:
    engine = FakeEngine(model_dir, tokenizer=tok)
    await engine.start()
    clients: list[openai.AsyncOpenAI] = []

    def open_session(**scripted: Any) -> Served:
        served = open_in_process(EngineEpisode(tok, engine, scripted={int(k[1:]): v for k, v in scripted.items()}))
        clients.append(served.client)
        return served

    yield open_session
    for client in clients:
        await client.close()


QUESTION: Any = [{"role": "user", "content": "What is 2 + 2?"}]
"""The fake engine answers "The answer is N." to it."""


async def test_a_stop_string_ends_the_content_and_the_ids_stay_verbatim(serve: Callable[..., Served],
                                                                        tok: ChatTokenizer) -> None:
    served = serve()
    client, ep = served.client, served.episode
    plain = await client.chat.completions.create(model="policy", messages=QUESTION)
    assert plain.choices[0].message.content is not None and plain.choices[0].message.content.startswith("The answer")

    resp = await client.chat.completions.create(model="policy", messages=QUESTION, stop=["answer"], logprobs=True)
    msg, choice = resp.choices[0].message, resp.choices[0]
    assert msg.content == "The " and choice.finish_reason == "stop"
    ids = ep.turns[1].token_ids.tolist()
    assert tok.decode(ids, skip_special_tokens=True) == "The answer"  # what the engine sampled, stop string and all
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == ids
    assert resp.usage is not None and resp.usage.completion_tokens == len(ids)
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == len(ids)

    # the agent sends the content back: the conversation extends (no rewrite), the ids stay in the context
    follow = [*QUESTION, msg, {"role": "user", "content": "And 3 + 3?"}]
    stream = await client.chat.completions.create(model="policy", messages=follow, stop=["is", "swer"],
                                                  stream=True, stream_options={"include_usage": True})
    text, finish, streamed_ids = "", None, cast(list[int], [])
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed_ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
    assert text == "The an" and finish == "stop"  # "swer" ends before "is"
    assert streamed_ids == ep.turns[2].token_ids.tolist()
    assert tok.decode(streamed_ids, skip_special_tokens=True).startswith("The answer")
    await served.session.finish(1.0)

    assert [s["action"] for s in ep.steps] == [plain.choices[0].message.content, "The ", "The an"]
    # call 2 asked the first question again (a rewrite: new segment); call 3 extended call 2's conversation
    assert [s["drift"] for s in ep.steps] == ["history_rewrite", None, None]
    transcript = served.session.transcript
    assert transcript is not None and transcript.check_results() == [True, True]
    assert transcript.mask.sum() == sum(len(t.token_ids) for t in ep.turns)
    starts = [i for i in range(1, len(transcript)) if transcript.mask[i] and not transcript.mask[i - 1]]
    for start, turn in zip(starts, ep.turns, strict=True):  # each turn's ids are in the sequence verbatim
        assert transcript.ids[start:start + len(turn.token_ids)].tolist() == turn.token_ids.tolist()


async def test_a_stop_string_with_text_after_it_and_a_tool_call_before_it(serve: Callable[..., Served],
                                                                        tok: ChatTokenizer) -> None:
    """Ids as vLLM returns them: the last id holds the stop string and more ("END\\n\\nmore")."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = tok.encode(f"{call} END\n\nmore").tolist()
    served = serve(t0=(ids, FinishReason.STOP))
    resp = await served.client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, stop=["END"])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and calls[0].type == "function" and calls[0].function.name == "add"
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == ids
    await served.session.finish(1.0)
    assert served.episode.steps[0]["action"] == f"{call} "


async def test_a_length_finish_that_completed_a_stop_string_is_a_stop(serve: Callable[..., Served],
                                                                     tok: ChatTokenizer) -> None:
    served = serve(t0=(tok.encode("one. two").tolist(), FinishReason.LENGTH))
    resp = await served.client.chat.completions.create(model="policy", messages=QUESTION, stop=["."], max_tokens=4)
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == ("one", "stop")
    served = serve(t0=(tok.encode("one two").tolist(), FinishReason.LENGTH))
    resp = await served.client.chat.completions.create(model="policy", messages=QUESTION, stop=["."], max_tokens=4)
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == ("one two", "length")


# --- tool_choice ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "names"), [
    ("required", ["add", "mul"]),
    ({"type": "function", "function": {"name": "mul"}}, ["mul"]),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function",
                                                                                 "function": {"name": "mul"}}]}},
     ["mul"]),
])
async def test_a_forced_tool_choice_is_enforced_and_recorded_token_exact(
        serve: Callable[..., Served], tok: ChatTokenizer, choice: Any, names: list[str]) -> None:
    """The engine samples under ``SamplingParams.tool_call`` (the fake answers a call of the first allowed name, as
    vLLM's grammar lays it out): the reply is the parsed call, the ids are recorded verbatim and the agent sending the
    call back extends the conversation token-exact."""
    served = serve()
    client, ep = served.client, served.episode
    resp = await client.chat.completions.create(model="policy", messages=QUESTION, tools=[*TOOLS, MUL],
                                                tool_choice=choice)
    choice0 = resp.choices[0]
    calls = choice0.message.tool_calls
    assert choice0.finish_reason == "tool_calls" and calls is not None and len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == names[0] and calls[0].function.arguments == "{}"
    ids = ep.turns[0].token_ids.tolist()
    assert choice0.model_extra is not None and choice0.model_extra["token_ids"] == ids and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == \
        f'<tool_call>\n{{"name": "{names[0]}", "arguments": {{}}}}\n</tool_call>'

    follow = [*QUESTION, choice0.message, {"role": "tool", "tool_call_id": calls[0].id, "content": "6"}]
    again = await client.chat.completions.create(model="policy", messages=follow, tools=[*TOOLS, MUL])
    assert again.choices[0].finish_reason == "stop"  # auto: the fake answers in text
    await served.session.finish(1.0)
    assert [s["drift"] for s in ep.steps] == [None, None]  # one segment: the call extended the conversation
    transcript = served.session.transcript
    assert transcript is not None and transcript.check_results() == [True]


async def test_a_forced_call_streams_as_a_tool_call(serve: Callable[..., Served], tok: ChatTokenizer) -> None:
    served = serve()
    stream = await served.client.chat.completions.create(model="policy", messages=QUESTION, tools=[*TOOLS, MUL],
                                                         tool_choice="required", stream=True)
    calls, finish, ids = [], None, cast(list[int], [])
    async for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls if c.function] == ["add"]
    assert ids == served.episode.turns[0].token_ids.tolist()


async def test_a_tool_choice_naming_no_tool_is_a_400(serve: Callable[..., Served]) -> None:
    served = serve()
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS,
                                                    tool_choice={"type": "function", "function": {"name": "mul"}})
    assert err.value.param == "tool_choice" and "not among the tools" in err.value.message
    assert served.episode.turns == [] and served.session.turns == 0


async def test_allowed_tools_auto_naming_some_tools_is_a_400(serve: Callable[..., Served]) -> None:
    """Text or a call of some of the tools: no engine constraint expresses it, so it is refused, never ignored."""
    served = serve()
    with pytest.raises(openai.BadRequestError) as err:
        await served.client.chat.completions.create(
            model="policy", messages=QUESTION, tools=[*TOOLS, MUL], tool_choice={
                "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                    {"type": "function", "function": {"name": "add"}}]}})
    assert err.value.code == "tool_choice_not_enforced" and err.value.param == "tool_choice"
    body = cast(dict[str, Any], err.value.body)
    assert body["type"] == "invalid_request_error"
    assert served.episode.turns == [] and served.session.turns == 0  # nothing sampled, nothing recorded


@pytest.mark.parametrize("choice", [
    "auto", "none",
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "mul"}}]}},
])
async def test_auto_and_none_are_openai_s(serve: Callable[..., Served], tok: ChatTokenizer, choice: Any) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    served = serve(t0=([*tok.encode(call).tolist(), tok.eos_token_id], FinishReason.STOP))
    resp = await served.client.chat.completions.create(model="policy", messages=QUESTION, tools=[*TOOLS, MUL],
                                                       tool_choice=choice)
    msg = resp.choices[0].message
    if choice == "none":  # the model is not asked to call: its text is content
        assert msg.tool_calls is None and msg.content == call and resp.choices[0].finish_reason == "stop"
    else:
        assert msg.tool_calls is not None and resp.choices[0].finish_reason == "tool_calls"


async def test_model_is_required(serve: Callable[..., Served]) -> None:
    served = serve()  # the SDK always sends a model: post without one
    out = await served.http.post(f"{served.client.base_url}chat/completions", json={"messages": QUESTION},
                                 headers={"Authorization": f"Bearer {served.client.api_key}"})
    assert out.status_code == 400
    assert out.json()["error"]["param"] == "model" and out.json()["error"]["type"] == "invalid_request_error"


# --- tools changing between calls -------------------------------------------------------------------------
async def test_tools_added_changed_or_removed_start_a_new_segment(serve: Callable[..., Served],
                                                                 tok: ChatTokenizer) -> None:
    served = serve()
    client, ep = served.client, served.episode
    msgs: list[Any] = list(QUESTION)
    for tools in (None, TOOLS, TOOLS, [*TOOLS, MUL], None):
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        resp = await client.chat.completions.create(model="policy", messages=msgs, **kwargs)
        msgs += [resp.choices[0].message, {"role": "user", "content": "And 1 + 1?"}]
    await served.session.finish(1.0)
    # added, same, changed, removed: each change re-renders the conversation (the tools are in the system prompt)
    assert [(s["new_segment"], s["drift"]) for s in ep.steps[:-1]] == [
        (True, "history_rewrite"), (False, None), (True, "history_rewrite"), (True, "history_rewrite")]
    transcript = served.session.transcript
    assert transcript is not None and len(transcript.segments) == 4
    assert transcript.check_results() == [True] * 4  # each segment token-exact against its own tools
