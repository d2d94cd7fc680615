"""Agent functions the agent tests run as episodes: unmodified ``openai`` SDK, LangChain and OpenAI Agents SDK
code, one behaviour each.

The env worker imports them by name (``ROLLOUT_AGENTS="plain=tests.agents:plain,..."``); each gets its
episode's task and an ``openai.AsyncOpenAI`` client on the episode's session endpoint (the LangChain agent
builds its own ``ChatOpenAI`` from that client's ``base_url``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIProvider, RunConfig, Runner, function_tool
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

ADD_TOOL: Any = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                                    "b": {"type": "integer", "description": "second"}},
                   "required": ["a", "b"]}}}
SYSTEM = "You are a concise assistant."


def _check_ids(resp: Any) -> dict[str, Any]:
    """The extra token fields of a response, checked against ``usage`` (what a tracing agent could log)."""
    extra = resp.model_extra or {}
    choice_extra = resp.choices[0].model_extra or {}
    prompt_ids, ids = extra["prompt_token_ids"], choice_extra["token_ids"]
    assert len(prompt_ids) == resp.usage.prompt_tokens and len(ids) == resp.usage.completion_tokens
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)}


async def plain(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """Two plain calls (a question, then a follow-up), with logprobs; reward 1 when the answer has a digit."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=task.get("max_tokens", 24), logprobs=True, top_logprobs=2,
                                                 temperature=task.get("temperature", 1.0), seed=task.get("seed"))
    lp = first.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == first.usage.completion_tokens  # type: ignore[union-attr]
    messages += [first.choices[0].message, {"role": "user", "content": "Say it again in one sentence."}]
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  max_tokens=task.get("max_tokens", 24))
    answer = second.choices[0].message.content or ""
    return {"reward": float(any(c.isdigit() for c in answer)), "answer": answer,
            "info": {"calls": [_check_ids(first), _check_ids(second)]}}


async def streaming(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """Two streamed calls with usage in the last chunk; reward 1 when both streams ended with [DONE] and usage."""
    messages: list[Any] = [{"role": "user", "content": task["question"]}]
    ok = 0
    for follow_up in ("Thanks. Anything else?", None):
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                      stream_options={"include_usage": True},
                                                      max_tokens=task.get("max_tokens", 24))
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        ok += int(usage is not None and finish is not None)
        messages.append({"role": "assistant", "content": text})
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return ok / 2


async def tools(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """Offers ``add``; runs every tool call the model makes and sends the results back, up to three calls."""
    messages: list[Any] = [{"role": "system", "content": "Use the add tool to add numbers."}]
    if task.get("few_shot"):  # an example exchange: assistant tool calls and a tool result in the history
        messages += [{"role": "user", "content": "What is 1 + 1?"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": "call_example", "type": "function",
                         "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 1})}}]},
                     {"role": "tool", "tool_call_id": "call_example", "content": "2"},
                     {"role": "assistant", "content": "1 + 1 = 2."}]
    messages.append({"role": "user", "content": f"What is {task['a']} + {task['b']}?"})
    calls = 0
    answer = ""
    for _ in range(3):
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL],
                                                    tool_choice="auto", max_tokens=task.get("max_tokens", 48))
        msg = resp.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        for call in msg.tool_calls:
            calls += 1
            assert call.type == "function"
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    total = str(task["a"] + task["b"])
    return {"reward": float(total in answer), "answer": answer, "info": {"tool_calls": calls}}


async def rewrite(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """Edits its history between calls (drops the first answer and rephrases the question): two segments."""
    first = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=16)
    summary = (first.choices[0].message.content or "")[:40]
    await client.chat.completions.create(model="policy", max_tokens=16, messages=[
        {"role": "system", "content": f"Earlier you said: {summary}"},
        {"role": "user", "content": "Answer again, shorter."}])
    return 0.5


async def raises(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """One call, then a bug in the agent's own code."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["question"]}],
                                         max_tokens=8)
    return _parse_score("not a number")


def _parse_score(text: str) -> float:
    return float(text)


async def silent(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """Returns without calling the model."""
    return 1.0


async def sleepy(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """One call, then hangs (the episode's timeout cancels it)."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["question"]}],
                                         max_tokens=8)
    await asyncio.sleep(3600)
    return 1.0


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


async def langchain(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """LangChain's ``ChatOpenAI`` on the session: a plain ``ainvoke``, then ``bind_tools([add])`` until the model
    answers without a tool call (the tools appearing is a rewrite of the prompt: a second segment)."""
    llm = ChatOpenAI(base_url=str(client.base_url), api_key=client.api_key, model="policy",
                     max_completion_tokens=task.get("max_tokens", 48), temperature=task.get("temperature", 1.0))
    messages: list[BaseMessage] = [SystemMessage("You are a careful calculator."),
                                   HumanMessage(f"What is {task['a']} + {task['b']}?")]
    first = await llm.ainvoke(messages)
    messages += [first, HumanMessage("Use the add tool to check.")]
    with_tools = llm.bind_tools([add])
    calls, answer = 0, ""
    for _ in range(3):
        msg = await with_tools.ainvoke(messages)
        assert isinstance(msg, AIMessage)
        messages.append(msg)
        if not msg.tool_calls:
            answer = msg.text
            break
        for call in msg.tool_calls:
            calls += 1
            result = await add.ainvoke(call["args"]) if call["name"] == "add" else f"error: no tool {call['name']}"
            messages.append(ToolMessage(str(result), tool_call_id=call["id"] or ""))
    total = str(task["a"] + task["b"])
    usage = first.usage_metadata["total_tokens"] if first.usage_metadata else None  # LangChain read our usage
    return {"reward": float(total in answer), "answer": answer,
            "info": {"tool_calls": calls, "first": first.text, "usage": usage}}


@function_tool
def add_numbers(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


async def openai_agents(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """The OpenAI Agents SDK with its chat-completions model on the session client: one ``Runner.run`` of an agent
    with a function tool (tracing off: nothing leaves the machine)."""
    agent = Agent(name="adder", instructions="Use the add_numbers tool to add numbers, then state the sum.",
                  tools=[add_numbers], model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=task.get("max_tokens", 48), parallel_tool_calls=False,
                                               temperature=task.get("temperature", 1.0), top_logprobs=1,
                                               metadata={"suite": "agents"}))
    result = await Runner.run(agent, f"What is {task['a']} + {task['b']}?", max_turns=3,
                              run_config=RunConfig(tracing_disabled=True))
    answer = str(result.final_output)
    calls = sum(1 for item in result.new_items if item.type == "tool_call_item")
    total = str(task["a"] + task["b"])
    return {"reward": float(total in answer), "answer": answer,
            "info": {"tool_calls": calls, "requests": result.context_wrapper.usage.requests}}


async def openai_agents_responses(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """The OpenAI Agents SDK with its default model, which speaks the Responses API: the agent names a model and the
    run's provider is the SDK's own ``OpenAIProvider`` on the session client (tracing off: nothing leaves the
    machine)."""
    agent = Agent(name="adder", instructions="Use the add_numbers tool to add numbers, then state the sum.",
                  tools=[add_numbers], model="policy",
                  model_settings=ModelSettings(max_tokens=task.get("max_tokens", 48), parallel_tool_calls=False,
                                               temperature=task.get("temperature", 1.0), top_logprobs=1))
    provider = OpenAIProvider(openai_client=client)
    result = await Runner.run(agent, f"What is {task['a']} + {task['b']}?", max_turns=3,
                              run_config=RunConfig(tracing_disabled=True, model_provider=provider))
    answer = str(result.final_output)
    calls = sum(1 for item in result.new_items if item.type == "tool_call_item")
    total = str(task["a"] + task["b"])
    return {"reward": float(total in answer), "answer": answer,
            "info": {"tool_calls": calls, "requests": result.context_wrapper.usage.requests,
                     "model": type(provider.get_model("policy")).__name__}}


async def counting(task: dict[str, Any], client: AsyncOpenAI) -> float:
    """``task["calls"]`` calls, each adding "Turn k." to the conversation; deterministic given the replies (a
    resumed attempt's repeated calls are answered from the recorded turns)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    for k in range(int(task.get("calls", 4))):
        messages.append({"role": "user", "content": f"Turn {k}."})
        resp = await client.chat.completions.create(model="policy", messages=messages,
                                                    max_tokens=task.get("max_tokens", 8))
        messages.append(resp.choices[0].message)
    return 1.0


ALL = ("plain", "streaming", "tools", "rewrite", "raises", "silent", "sleepy", "langchain", "openai_agents",
       "openai_agents_responses", "counting")
AGENTS_SETTING = ",".join(f"{name}=tests.agents:{name}" for name in ALL)
"""``ROLLOUT_AGENTS`` registering every agent above."""
