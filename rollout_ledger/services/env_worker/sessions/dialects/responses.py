"""The OpenAI Responses API dialect of the session endpoint (``/v1/responses``): input items and instructions into
canonical messages, function tools and their ``function_call`` / ``function_call_output`` items,
``previous_response_id`` within the session, the ``response`` object, its stream of typed events, usage and logprobs.

What it honours, and how:

- ``input`` is a string (one user message) or a list of items: messages (``role`` user, system, developer,
  assistant; content a string or ``input_text`` / ``output_text`` parts; ``phase`` and ``status`` accepted and
  ignored), ``function_call`` items (joined to the assistant message right before them, as one turn's calls) and
  ``function_call_output`` items (tool messages). ``instructions`` is a system message before them; as in OpenAI's
  API, a response's instructions are not carried over by ``previous_response_id``.
- ``previous_response_id`` names a response of this session (stored unless ``store`` is false): the conversation is
  that response's input items and output, then this call's input. So an agent that chains responses and one that
  resends its whole history give the same canonical conversation, and the transcript extends the same segment.
- ``tools``: function tools (``{"type": "function", "name", "parameters", ...}``) render into the prompt like chat's,
  a ``namespace`` tool's functions too (a call of one carries its ``namespace``; Codex groups its sub-agent tools
  so); built-in tools (web search, file search, computer use, code interpreter, MCP, ...) cannot run here and are a 400
  naming the tool. ``tool_choice`` is chat's (``auto``, ``none``, ``required``, a named function, ``allowed_tools``),
  enforced the same way (``SamplingParams.tool_call``).
- ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``top_logprobs`` with
  ``include: ["message.output_text.logprobs"]``; ``reasoning`` is accepted and produces no reasoning item (the policy
  is not a reasoning model: its effort changes nothing, the summary is absent); structured output (``text.format``
  other than text), ``background``, ``conversation``, images and files, and items of other types are a 400 naming the
  field or the item.
- The response: ``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``
  when the turn hit its limit; ``output`` a message item (one ``output_text`` part, with logprobs when asked) and one
  ``function_call`` item per parsed call (``call_id`` is the canonical tool-call id); ``usage`` counts the prompt and
  sampled ids; the ledger's fields (``prompt_token_ids``, ``token_ids``, ``episode_id``, ``turn_index``,
  ``turn_event_id``, ``segment``) ride along as extra top-level fields, as in chat completions.
- A stream is the whole turn replayed as the API's events (``response.created``, ``response.in_progress``, per item
  ``response.output_item.added``, for text ``response.content_part.added``, one ``response.output_text.delta`` per
  sampled id with its logprobs, ``response.output_text.done``, ``response.content_part.done``, for a call
  ``response.function_call_arguments.delta`` / ``.done``, then ``response.output_item.done``; last
  ``response.completed`` or ``response.incomplete`` with the whole response), each with its ``sequence_number``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout_ledger.services.env_worker.sessions.dialects.chat_completions import error_body as error_body
from rollout_ledger.services.env_worker.sessions.dialects.chat_completions import text_content
from rollout_ledger.services.env_worker.sessions.dialects.sse import sse
from rollout_ledger.services.env_worker.sessions.turns import ApiError, Message, TurnRequest, TurnResult

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MEMORY_KEY = "responses"
"""Where a session's stored responses live in ``AgentSession.memory``."""
STORED_MAX = 256
"""Responses kept per session (the oldest go first): an agent chains from its last few."""


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API lays it out flat: no ``function`` wrapper)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """POST /sessions/{episode_id}/v1/responses (the subset of OpenAI's request we honour; unknown fields are
    accepted and ignored, as vLLM does)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = False
    store: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    seed: int | None = None
    """Not OpenAI's; vLLM's extension, honoured the same way."""
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        fmt = (self.text or {}).get("format") or {}
        if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
            raise ValueError("text.format: only {'type': 'text'} is supported (no structured output)")
        if self.background:
            raise ValueError("background: not supported (each call is one turn of the episode, answered at once)")
        if self.conversation is not None:
            raise ValueError("conversation: not supported; chain responses with previous_response_id, or send the "
                             "whole input")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


def _function_tools(req: ResponsesRequest) -> tuple[list[FunctionTool], dict[str, str]]:
    """The request's function tools, a ``namespace`` tool's functions among them (Codex groups its sub-agent tools
    so), and the namespace of each function that came from one (its calls carry it back)."""
    out: list[FunctionTool] = []
    namespaces: dict[str, str] = {}

    def add(tool: Any, at: str, namespace: str | None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and namespace is None:
            inner, name = tool.get("tools"), tool.get("name")
            if not isinstance(inner, list) or not isinstance(name, str):
                raise ApiError(400, f"{at}: a namespace tool needs a name and a list of tools", param=at)
            for j, sub in enumerate(inner):
                add(sub, f"{at}.tools[{j}]", name)
            return
        if kind != "function":
            raise ApiError(400, f"{at}: only function tools (also grouped in a namespace) can run here, got {kind!r} "
                           "(built-in tools such as web search, file search, computer use and MCP have no executor "
                           "behind a session)", param=at)
        try:
            fn = FunctionTool.model_validate(tool)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ApiError(400, f"{at}.{loc}: {err['msg']}", param=f"{at}.{loc}") from None
        if any(t.name == fn.name for t in out):
            raise ApiError(400, f"{at}.name: {fn.name!r} is named twice (a function's name is what the model calls)",
                           param=f"{at}.name")
        out.append(fn)
        if namespace is not None:
            namespaces[fn.name] = namespace

    for i, tool in enumerate(req.tools or ()):
        add(tool, f"tools[{i}]", None)
    return out, namespaces


def _tool_call_constraint(choice: Any, tools: list[FunctionTool]) -> tuple[dict[str, Any] | None, bool]:
    """(``SamplingParams.tool_call`` for the call ``tool_choice`` forces, whether tool calls are parsed)."""
    names = [t.name for t in tools]
    if choice is None or choice == "auto":
        return None, bool(tools)
    if choice == "none":
        return None, False
    forced: list[str]
    if choice == "required":
        if not tools:
            raise ApiError(400, "tool_choice: 'required' needs tools", param="tool_choice")
        forced = names
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice: names {name!r}, which is not among the tools", param="tool_choice")
        forced = [str(name)]
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = [str(t.get("name")) for t in choice.get("tools") or () if isinstance(t, dict)]
        unknown = [n for n in allowed if n not in names]
        if not allowed or unknown:
            raise ApiError(400, f"tool_choice: allowed_tools must name some of the tools (got {unknown or allowed})",
                           param="tool_choice")
        if choice.get("mode") == "required":
            forced = list(dict.fromkeys(allowed))
        elif set(allowed) == set(names):
            return None, True
        else:
            raise ApiError(400, "tool_choice: allowed_tools in mode 'auto' naming only some of the tools is not "
                           "supported: the endpoint enforces a call but not a choice between text and some of the "
                           "tools; send those tools only, or mode 'required'", param="tool_choice",
                           code="tool_choice_not_enforced")
    else:
        got = choice.get("type") if isinstance(choice, dict) else choice
        raise ApiError(400, f"tool_choice: must be 'none', 'auto', 'required', {{'type': 'function', 'name': ...}} "
                       f"or {{'type': 'allowed_tools', ...}} (only function tools exist here), got {got!r}",
                       param="tool_choice")
    schemas = {t.name: t.parameters for t in tools if t.parameters}
    return {"names": forced, "parameters": {n: schemas[n] for n in forced if n in schemas}}, True


def input_messages(items: str | list[dict[str, Any]], where: str = "input") -> list[Message]:
    """Input items as canonical messages: ``function_call`` items join the assistant message right before them
    (one turn's text and calls), ``function_call_output`` items become tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{at}: an input item must be an object", param=at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{at}.role: must be user, system, developer or assistant, got {role!r}",
                               param=f"{at}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": text_content(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(cid, str):
                raise ApiError(400, f"{at}: a function_call item needs call_id, name and arguments (a string)",
                               param=at)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str):
                raise ApiError(400, f"{at}.call_id: a function_call_output item needs the call_id it answers",
                               param=f"{at}.call_id")
            output = text_content(item.get("output"), f"{at}.output")
            out.append({"role": "tool", "content": output, "tool_call_id": cid})
        else:
            raise ApiError(400, f"{at}.type: items of type {kind!r} are not supported here (messages, function_call "
                           "and function_call_output are)", param=f"{at}.type")
    return out


def _stored(memory: dict[str, Any]) -> dict[str, dict[str, Any]]:
    stored: dict[str, dict[str, Any]] = memory.setdefault(MEMORY_KEY, {})
    return stored


class Call:
    """A validated call and what its response needs (the conversation to store, its request fields)."""

    def __init__(self, req: ResponsesRequest, history: list[Message], tools: list[FunctionTool],
                 namespaces: dict[str, str] | None = None) -> None:
        self.req = req
        self.namespaces = namespaces or {}
        """Function name -> the namespace tool it came in."""
        self.history = history
        """The conversation without instructions (previous response's, then this input): what a response stores."""
        self.tools = tools


def parse(body: Any, memory: dict[str, Any]) -> tuple[TurnRequest, Call]:
    """The call's ``TurnRequest`` (``ApiError(400)`` naming the first bad field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        msg = str(err["msg"]).removeprefix("Value error, ")
        if loc is None and ":" in msg:
            loc = msg.split(":", 1)[0]
        raise ApiError(400, f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg, param=loc) from None
    tools, namespaces = _function_tools(req)
    constraint, parse_tools = _tool_call_constraint(req.tool_choice, tools)
    history: list[Message] = []
    if req.previous_response_id is not None:
        previous = _stored(memory).get(req.previous_response_id)
        if previous is None:
            raise ApiError(404, f"previous_response_id: no stored response {req.previous_response_id!r} in this "
                           "session (unknown, stored with store=false, or from another episode)",
                           param="previous_response_id", code="previous_response_not_found", type_="not_found_error")
        history = [dict(m) for m in previous["history"]]
    history += input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    if not messages:
        raise ApiError(400, "input: the conversation is empty", param="input")
    template_tools = [{"type": "function", "function": t.model_dump(mode="json", exclude_none=True,
                                                                    exclude={"type", "strict"})} for t in tools]
    turn = TurnRequest(
        messages=messages, tools=template_tools or None, parse_tools=parse_tools, tool_call=constraint,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, max_tokens=req.max_output_tokens,
        logprobs=req.wants_logprobs, top_logprobs=req.top_logprobs or 0, stream=bool(req.stream), model=req.model)
    return turn, Call(req, history, tools, namespaces)


# --- the response -------------------------------------------------------------------------------------------------
def _ids(result: TurnResult) -> tuple[str, str]:
    """The response's id and its message item's id (both from the turn's event id: stable on a replay)."""
    key = uuid.uuid5(uuid.NAMESPACE_URL, result.event_id).hex
    return f"resp_{key}", f"msg_{key}"


def _logprobs(result: TurnResult) -> list[dict[str, Any]] | None:
    if result.logprobs is None:
        return None
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": [{"token": a["token"], "logprob": a["logprob"], "bytes": a["bytes"]}
                              for a in e["top_logprobs"]]} for e in result.logprobs]


def _output(result: TurnResult, msg_id: str, namespaces: dict[str, str]) -> list[dict[str, Any]]:
    turn = result.turn
    out: list[dict[str, Any]] = []
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    if turn.content or not turn.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": turn.content or "", "annotations": []}
        lps = _logprobs(result)
        if lps is not None:
            part["logprobs"] = lps
        out.append({"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": [part]})
    for call in turn.tool_calls:
        item = {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
        if call["function"]["name"] in namespaces:
            item["namespace"] = namespaces[call["function"]["name"]]
        out.append(item)
    return out


def _response(result: TurnResult, call: Call, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
    req = call.req
    resp_id, _ = _ids(result)
    p, c = len(result.prompt_token_ids), len(result.token_ids)
    return {
        "id": resp_id, "object": "response", "created_at": result.created, "completed_at": result.created,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": result.model,
        "output": output, "parallel_tool_calls": True, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store is not False, "background": False,
        "temperature": result.temperature, "top_p": result.top_p, "top_logprobs": req.top_logprobs or 0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "max_tool_calls": None,
        "tools": [t.model_dump(mode="json") for t in call.tools if t.name not in call.namespaces]
        + _namespace_tools(call), "service_tier": "default",
        "truncation": "disabled", "metadata": req.metadata or {}, "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "usage": {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c},
        "prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids, **result.extra,
    }


def _namespace_tools(call: Call) -> list[dict[str, Any]]:
    """The request's namespace tools as it sent them (echoed in the response's ``tools``)."""
    return [t for t in call.req.tools or () if isinstance(t, dict) and t.get("type") == "namespace"]


def _remember(memory: dict[str, Any], call: Call, result: TurnResult, resp: dict[str, Any]) -> None:
    if call.req.store is False:
        return
    stored = _stored(memory)
    while len(stored) >= STORED_MAX:
        stored.pop(next(iter(stored)))
    stored[resp["id"]] = {"history": [*call.history, result.turn.canonical()], "response": resp}


def response(result: TurnResult, call: Call, memory: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object (stream=false), stored for ``previous_response_id`` unless ``store`` is false."""
    _, msg_id = _ids(result)
    status = "incomplete" if result.turn.finish_reason == "length" else "completed"
    resp = _response(result, call, _output(result, msg_id, call.namespaces), status)
    _remember(memory, call, result, resp)
    return resp


def stream(result: TurnResult, call: Call, memory: dict[str, Any]) -> Iterator[bytes]:
    """The response's events, in order (stored before the first is sent)."""
    final = response(result, call, memory)
    return _events(result, call, final)


def _events(result: TurnResult, call: Call, final: dict[str, Any]) -> Iterator[bytes]:
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return sse(data, event=kind)

    pending = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            lps = part.get("logprobs")
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})
            if result.turn.tool_calls:  # the text outside the calls, at once, with every id's logprob
                deltas = [(part["text"], lps or [])] if part["text"] else []
            else:  # one delta per sampled id (after a stop string: empty text, its logprob still)
                deltas = [(text, lps[i:i + 1] if lps is not None else [])
                          for i, text in enumerate(result.token_texts)]
            for text, delta_lps in deltas:
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=text, logprobs=delta_lps)
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=lps or [])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


# --- stored responses ---------------------------------------------------------------------------------------------
def retrieve(memory: dict[str, Any], response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: a stored response of this session."""
    stored = _stored(memory).get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response {response_id!r} in this session", code="response_not_found",
                       type_="not_found_error")
    resp: dict[str, Any] = stored["response"]
    return resp


def delete(memory: dict[str, Any], response_id: str) -> dict[str, Any]:
    """DELETE /v1/responses/{id}."""
    if _stored(memory).pop(response_id, None) is None:
        raise ApiError(404, f"no stored response {response_id!r} in this session", code="response_not_found",
                       type_="not_found_error")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
