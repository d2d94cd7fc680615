"""Agent functions that drive the session endpoint through another harness's SDK than ``openai``: the official
``anthropic`` SDK on the Anthropic Messages route, unmodified.

Like tests/agents.py, each is ``async def run(task, client)`` with ``client`` an ``openai.AsyncOpenAI`` on the
episode's session; the agent builds its own client from that one's ``base_url`` (Anthropic's is the session URL
without ``/v1``) and ``api_key`` (the session's secret, sent as ``x-api-key``).
"""

from __future__ import annotations

from typing import Any

import anthropic
from openai import AsyncOpenAI

ADD_TOOL: Any = {"name": "add", "description": "Add two integers and return the sum.",
                 "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                                                   "b": {"type": "integer", "description": "second"}},
                                  "required": ["a", "b"]}}


def anthropic_client(client: AsyncOpenAI) -> anthropic.AsyncAnthropic:
    """An ``anthropic`` client on the same session as ``client``."""
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    return anthropic.AsyncAnthropic(base_url=base, api_key=client.api_key, max_retries=0)


async def anthropic_tools(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """A tool loop with the ``anthropic`` SDK: counts the prompt's tokens, then offers ``add`` and runs every
    ``tool_use`` the model makes, sending ``tool_result`` blocks back, until it answers in text (at most four
    calls). The first call is plain, the others streamed (``messages.stream``); reward 1 when the answer holds the
    sum."""
    system = "Use the add tool to add numbers, then state the sum."
    messages: list[Any] = [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
    sampling = {"temperature": task.get("temperature", 1.0)}  # deprecated by Anthropic: the SDK takes it as extra
    calls, streamed, answer = 0, 0, ""
    async with anthropic_client(client) as claude:
        counted = await claude.messages.count_tokens(model="policy", system=system, messages=messages,
                                                     tools=[ADD_TOOL])
        first_input = 0
        for k in range(4):
            kw: dict[str, Any] = {"model": "policy", "max_tokens": task.get("max_tokens", 48), "system": system,
                                  "messages": messages, "tools": [ADD_TOOL], "extra_body": sampling}
            if k == 0:
                msg = await claude.messages.create(**kw)
                first_input = msg.usage.input_tokens
            else:
                async with claude.messages.stream(**kw) as stream:
                    msg = await stream.get_final_message()
                streamed += 1
            extra = msg.model_extra or {}
            assert len(extra["token_ids"]) == msg.usage.output_tokens  # the sampled ids, as recorded
            messages.append(msg.to_param())
            if msg.stop_reason != "tool_use":
                answer = "".join(b.text for b in msg.content if b.type == "text")
                break
            results: list[Any] = []
            for block in msg.content:
                if block.type != "tool_use":
                    continue
                calls += 1
                try:
                    value, error = str(int(block.input["a"]) + int(block.input["b"])), False
                except (KeyError, TypeError, ValueError) as exc:
                    value, error = f"error: {exc}", True
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": value, "is_error": error})
            messages.append({"role": "user", "content": results})
    total = str(task["a"] + task["b"])
    return {"reward": float(total in answer), "answer": answer,
            "info": {"tool_calls": calls, "streamed": streamed, "counted": counted.input_tokens == first_input}}
