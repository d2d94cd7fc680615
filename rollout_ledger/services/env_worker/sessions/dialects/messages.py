"""The Anthropic Messages dialect of the session endpoint (``/v1/messages``, ``/v1/messages/count_tokens``): request
validation into the neutral ``TurnRequest``, content blocks into canonical messages, the ``message`` response and
its stream of typed events, and errors in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

What it honours, and how:

- ``system`` (a string or text blocks) is the conversation's first system message; ``messages`` are user and
  assistant turns whose content is a string or blocks (and system messages, which Claude Code sends there). Text
  blocks of one message are joined with a newline (as vLLM joins text parts). An assistant's ``tool_use`` blocks are
  its canonical ``tool_calls`` (``input`` dumped as the JSON ``arguments``); a user message's ``tool_result`` blocks
  are ``tool`` messages, in order, and the text blocks after them one user message (tool results first, as Anthropic
  requires). ``cache_control`` and ``citations`` are accepted and ignored (they change nothing the policy sees).
  ``is_error`` is accepted and not rendered: the chat template has no place for it, and the result's text says what
  went wrong.
- Text only: ``image``, ``document``, ``search_result`` and every other block is refused with a 400 naming it
  (``messages[i].content[j]``). ``thinking`` and ``redacted_thinking`` blocks are refused too: the endpoint never
  returns them (the policy is not a reasoning model), so one in the history was produced elsewhere, and neither
  dropping it (the policy would not see what the client believes it saw) nor rendering a signed block we cannot
  read would be honest. A conversation ending with an assistant message (Anthropic's prefill, continuing that
  message) is refused: the template renders a new turn, not a continuation.
- ``tools``: custom tools (``name``, ``description``, ``input_schema``; ``type`` absent or ``"custom"``) are
  rendered as the template's function tools (name, description, parameters: nothing else, so a ``cache_control``
  that moves between calls does not change the prompt). Anthropic's server and schema-less tools
  (``web_search_*``, ``bash_*``, ``text_editor_*``, ``code_execution_*``, ...) are refused with a 400 naming the
  tool: the engine runs no tools and the policy was not trained on their hidden schemas. Claude Code sends its
  tools as custom tools (it runs its web search as a separate call with the server tool, which gets that 400).
- ``tool_choice``: ``auto`` (the default) and ``none`` as in chat completions (the tools are in the prompt; calls
  are parsed or not). ``any`` and ``tool`` (a named tool) are enforced by the engine (``SamplingParams.tool_call``:
  exactly one hermes call of an allowed tool, its ``input`` following the tool's schema), so the reply always
  carries a ``tool_use`` block (``stop_reason: "tool_use"``). ``disable_parallel_tool_use`` is accepted: under
  ``any``/``tool`` the grammar already allows one call; under ``auto`` it is not enforced (as chat's
  ``parallel_tool_calls``).
- Sampling: ``max_tokens`` is required (as Anthropic requires; not by ``count_tokens``); ``temperature`` (0-1, as
  Anthropic), ``top_p``, ``top_k`` (0: no cut-off) and ``stop_sequences`` go to the engine. A turn that stopped on
  one answers ``stop_reason: "stop_sequence"`` and the string in ``stop_sequence``; the text ends before it (as
  Anthropic's), while ``token_ids`` and ``usage`` cover every sampled id.
- ``thinking``: the policy does not think, and no reply carries a thinking block. Every documented config
  (``disabled``, ``enabled`` with ``budget_tokens`` >= 1024, ``adaptive``) is accepted, so that clients that turn
  thinking on by default (Claude Code 2.1 sends ``adaptive`` on every call) work unmodified; the reply is what the
  policy sampled, nothing invented.
  ``context_management`` is accepted when its edits only clear thinking (nothing to clear); edits that would
  change the context (``clear_tool_uses_*``, ``compact_*``) are refused. Structured output (``output_config.format``,
  ``output_format``) and ``mcp_servers`` are refused with a 400 naming the field. ``metadata``, ``service_tier``,
  ``output_config.effort``, a tool's ``defer_loading`` and any field we do not know are accepted and ignored.
  Checked against Claude Code 2.1 (``claude -p`` with a Bash tool loop): every call it made was answered and the
  loop extended one segment.

Tool-use ids: a canonical ``call_<24 hex>`` id is written ``toolu_<24 hex>`` (Anthropic's convention) and read
back the same way, so the ids the next call sends in ``tool_use``/``tool_result`` blocks compare equal to the ones
the session returned; any other id passes verbatim.

The response carries the ledger's extra top-level fields (``prompt_token_ids``, ``token_ids``, ``episode_id``,
``turn_index``, ``turn_event_id``, ``segment``; SDKs keep them in ``model_extra``). Anthropic has no logprobs, so
none are returned (the ledger records them). Streams replay the turn (the engine returns it at once) as Anthropic
sends them: ``message_start`` (the message without content, the extra fields included), per block
``content_block_start`` / ``content_block_delta`` (a ``text_delta`` per sampled id, carrying its ``token_ids``; an
``input_json_delta`` with a tool's whole input) / ``content_block_stop``, ``message_delta`` (stop reason and usage)
and ``message_stop``, so the SDKs' stream helpers rebuild the non-stream message.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_ledger.services.env_worker.sessions.dialects.sse import sse
from rollout_ledger.services.env_worker.sessions.turns import ApiError, Message, TurnRequest, TurnResult

THINKING_TYPES = ("disabled", "enabled", "adaptive")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
               529: "overloaded_error"}
"""Anthropic's error ``type`` per HTTP status (another 4xx: ``invalid_request_error``; another 5xx: ``api_error``)."""
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_OUR_CALL_ID = re.compile(r"call_([0-9a-f]{24})")
_OUR_TOOLU_ID = re.compile(r"toolu_([0-9a-f]{24})")


def error_body(exc: ApiError) -> dict[str, Any]:
    """The JSON body Anthropic clients parse (``anthropic.APIStatusError.body``): the error ``type`` follows the
    status; the message names the field; ``param`` and ``details.error_code`` carry ours when set."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    error: dict[str, Any] = {"type": kind, "message": exc.message}
    if exc.param is not None:
        error["param"] = exc.param
    if exc.code is not None:
        error["details"] = {"error_code": exc.code}
    return {"type": "error", "error": error, "request_id": None}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def wire_id(canonical: str) -> str:
    """A canonical tool-call id as the response writes it (ours as ``toolu_...``)."""
    m = _OUR_CALL_ID.fullmatch(canonical)
    return f"toolu_{m[1]}" if m else canonical


def canonical_id(wire: str) -> str:
    """A ``tool_use``/``tool_result`` id as the session compares it (the inverse of ``wire_id``)."""
    m = _OUR_TOOLU_ID.fullmatch(wire)
    return f"call_{m[1]}" if m else wire


class MessagesRequest(BaseModel):
    """POST /sessions/{episode_id}/v1/messages (and ``count_tokens``): the fields we read; blocks, tools and the
    tool choice are checked by hand so that a 400 names the block (``messages[2].content[1]``)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    """Echoed back; the session's policy answers whatever is named (required, as in Anthropic's API)."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    """Required to create a message (checked in ``parse_request``), not to count tokens."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: Any = None
    mcp_servers: list[Any] | None = None


def parse_request(body: Any, counting: bool = False) -> MessagesRequest:
    """The validated request; ``ApiError(400)`` naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        raise _bad(loc, str(err["msg"])) from None
    if req.max_tokens is None and not counting:
        raise _bad("max_tokens", "required (the most tokens the turn may sample)")
    _check_thinking(req.thinking)
    _check_context_management(req.context_management)
    if req.output_config and req.output_config.get("format") is not None:
        raise _bad("output_config.format", "structured output is not supported (leave it unset)")
    if req.output_format is not None:
        raise _bad("output_format", "structured output is not supported (leave it unset)")
    if req.mcp_servers:
        raise _bad("mcp_servers", "MCP servers are not supported: send their tools as custom tools")
    return req


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    """A documented thinking config (the policy does not think whatever it says)."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise _bad("thinking.budget_tokens", f"an integer >= 1024 is required, got {budget!r}")


def _check_context_management(config: dict[str, Any] | None) -> None:
    """Edits that only clear thinking are no-ops here (no reply carries thinking); others would change the context."""
    edits = (config or {}).get("edits") or []
    if not isinstance(edits, list):
        raise _bad("context_management.edits", "must be a list")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith("clear_thinking_")):
            raise _bad(f"context_management.edits[{i}]", f"{kind!r} is not supported: the endpoint records the "
                       "conversation the client sends and edits none of it (clear_thinking edits only)")


# --- content ---------------------------------------------------------------------------------------------------
def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text", "a text block needs a string text")
    return text


def _refuse_block(kind: Any, where: str, role: str) -> ApiError:
    if kind in ("thinking", "redacted_thinking"):
        return _bad(where, f"{kind} blocks are not supported: the policy is not a reasoning model and this endpoint "
                    "never returned one, so this history was produced elsewhere (send it without them)")
    if kind in ("image", "document", "search_result", "container_upload"):
        return _bad(where, f"{kind} blocks are not supported: the policy is a text-only model (text blocks only)")
    allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
    return _bad(where, f"a {role} message may hold {allowed} blocks here, got {kind!r}")


def _system_text(system: str | list[dict[str, Any]] | None, where: str = "system") -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}[{j}]", f"only text blocks are supported, got {kind!r}")
        texts.append(_text_of(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of text blocks")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise _bad(f"{where}[{k}]", f"only text blocks are supported in a tool result (the policy is a text-only "
                       f"model), got {kind!r}")
        texts.append(_text_of(part, f"{where}[{k}]"))
    return "\n".join(texts)


def _user_messages(content: list[Any], where: str) -> list[Message]:
    """A user message's blocks as canonical messages: one ``tool`` message per ``tool_result`` (in order), then one
    user message with the text blocks."""
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            if texts:
                raise _bad(at, "tool_result blocks must come before any text in a user message")
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise _bad(f"{at}.tool_use_id", "a tool_result needs the id of its tool_use")
            out.append({"role": "tool", "content": _tool_result_text(block.get("content"), f"{at}.content"),
                        "tool_call_id": canonical_id(tool_use_id)})
        else:
            raise _refuse_block(kind, at, "user")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(content: list[Any], where: str) -> Message:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise _bad(f"{at}.name", "a tool_use needs a name")
            if not isinstance(args, dict):
                raise _bad(f"{at}.input", "a tool_use's input must be an object")
            calls.append({"id": canonical_id(str(block.get("id") or "")), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise _refuse_block(kind, at, "assistant")
    msg: Message = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def canonical_messages(req: MessagesRequest) -> list[Message]:
    """The request's ``system`` and ``messages`` as the canonical conversation the chat template renders."""
    out: list[Message] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role", f"must be user or assistant, got {role!r}")
        if isinstance(content, list) and not content and role != "assistant":
            raise _bad(f"{where}.content", "must not be empty")
        if role == "system":
            out.append({"role": "system", "content": _system_text(content, f"{where}.content")})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _bad(f"{where}.content", "must be a string or a list of content blocks")
        elif role == "user":
            out.extend(_user_messages(content, f"{where}.content"))
        else:
            out.append(_assistant_message(content, f"{where}.content"))
    if out[-1]["role"] == "assistant":
        n = len(req.messages) - 1
        raise _bad(f"messages[{n}]", "a conversation ending with an assistant message (prefill: continue that "
                   "message) is not supported; end it with a user message")
    return out


# --- tools --------------------------------------------------------------------------------------------------------
def tool_schemas(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools as the chat template renders them (OpenAI function format), None without tools."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, "must be an object")
        kind, name = tool.get("type"), tool.get("name")
        if kind not in (None, "custom"):
            raise _bad(where, f"{name!r} of type {kind!r} is an Anthropic server or schema-less tool, which this "
                       "endpoint does not run; send it as a custom tool (name, description, input_schema)")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _bad(f"{where}.name", f"must match ^[a-zA-Z0-9_-]{{1,128}}$, got {name!r}")
        if name in seen:
            raise _bad(f"{where}.name", f"{name!r} is given twice")
        seen.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _bad(f"{where}.input_schema", "a JSON schema of type 'object' is required")
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


TOOL_CHOICES = "{'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} or {'type': 'none'}"


def tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> tuple[bool, list[str] | None]:
    """Whether the turn's text is searched for tool calls, and the tools it must call one of (None: no call is
    forced)."""
    names = [t["function"]["name"] for t in tools or ()]
    kind = (choice or {"type": "auto"}).get("type")
    if kind == "auto":
        return bool(tools), None
    if kind == "none":
        return False, None
    if kind == "any":
        if not tools:
            raise _bad("tool_choice", "{'type': 'any'} needs tools")
        return True, names
    if kind == "tool":
        name = (choice or {}).get("name")
        if not isinstance(name, str) or name not in names:
            raise _bad("tool_choice", f"names {name!r}, which is not among the tools")
        return True, [name]
    raise _bad("tool_choice", f"must be {TOOL_CHOICES}, got {kind!r}")


def turn_request(req: MessagesRequest) -> TurnRequest:
    """The call in the session's terms."""
    tools = tool_schemas(req.tools)
    parse_tools, forced = tool_choice(req.tool_choice, tools)
    constraint = None
    if forced:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools or ()}
        constraint = {"names": forced, "parameters": {n: schemas[n] for n in forced if schemas.get(n)}}
    stop = [s for s in req.stop_sequences if s] if req.stop_sequences is not None else None
    top_k = None if req.top_k is None else (req.top_k or -1)
    return TurnRequest(messages=canonical_messages(req), tools=tools, parse_tools=parse_tools, tool_call=constraint,
                       temperature=req.temperature, top_p=req.top_p, top_k=top_k, stop=stop,
                       max_tokens=req.max_tokens, stream=bool(req.stream), model=req.model)


# --- the response -------------------------------------------------------------------------------------------------
def stop_reason(result: TurnResult) -> str:
    """``tool_use``, ``stop_sequence``, ``max_tokens`` or ``end_turn``."""
    if result.turn.tool_calls:
        return "tool_use"
    if result.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if result.turn.finish_reason == "length" else "end_turn"


def content_blocks(result: TurnResult) -> list[dict[str, Any]]:
    """The reply's blocks: its text (an empty one when the turn has neither text nor calls), then a ``tool_use``
    per call."""
    turn = result.turn
    blocks: list[dict[str, Any]] = []
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content or "", "citations": None})
    for call in turn.tool_calls:
        blocks.append({"type": "tool_use", "id": wire_id(call["id"]), "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"]), "caller": {"type": "direct"}})
    return blocks


def usage(result: TurnResult) -> dict[str, Any]:
    """Anthropic's usage: every prompt id and every sampled id (no cache, no server tools reported)."""
    return {"input_tokens": len(result.prompt_token_ids), "output_tokens": len(result.token_ids),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "server_tool_use": None, "output_tokens_details": None, "service_tier": "standard",
            "inference_geo": None}


def _head(result: TurnResult) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid5(uuid.NAMESPACE_URL, result.event_id).hex[:24]}", "type": "message",
            "role": "assistant", "model": result.model}


def _extra(result: TurnResult) -> dict[str, Any]:
    return {"prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids, **result.extra}


def message(result: TurnResult) -> dict[str, Any]:
    """The ``message`` object (stream=false)."""
    return {**_head(result), "content": content_blocks(result), "stop_reason": stop_reason(result),
            "stop_sequence": result.stop_string if stop_reason(result) == "stop_sequence" else None,
            "stop_details": None, "container": None, "usage": usage(result), **_extra(result)}


def events(result: TurnResult) -> Iterator[tuple[str, dict[str, Any]]]:
    """The stream's events (name, data) in order."""
    start_usage = {**usage(result), "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": {
        **_head(result), "content": [], "stop_reason": None, "stop_sequence": None, "stop_details": None,
        "container": None, "usage": start_usage, **_extra(result)}}
    for index, block in enumerate(content_blocks(result)):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "text": ""}}
            if result.turn.tool_calls or not result.token_texts:  # text outside the calls: one piece
                pieces: list[tuple[str, list[int]]] = [(block["text"], [])] if block["text"] else []
            else:
                pieces = [(text, [tid]) for tid, text in zip(result.token_ids, result.token_texts, strict=True)]
            for text, ids in pieces:
                delta: dict[str, Any] = {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "text_delta", "text": text}}
                if ids:
                    delta["token_ids"] = ids
                yield "content_block_delta", delta
        else:
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    final = message(result)
    yield "message_delta", {"type": "message_delta", "delta": {
        "stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"], "stop_details": None,
        "container": None}, "usage": {k: final["usage"][k] for k in (
            "input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")}}
    yield "message_stop", {"type": "message_stop"}


# --- the dialect's face to the app ---------------------------------------------------------------------------------
def parse(body: Any, memory: dict[str, Any], counting: bool = False) -> tuple[TurnRequest, MessagesRequest]:
    """The call's ``TurnRequest`` and its validated request (``ApiError(400)`` naming the first bad field);
    ``counting``: for ``count_tokens`` (``max_tokens`` not required)."""
    req = parse_request(body, counting=counting)
    return turn_request(req), req


def response(result: TurnResult, req: MessagesRequest, memory: dict[str, Any]) -> dict[str, Any]:
    return message(result)


def stream(result: TurnResult, req: MessagesRequest, memory: dict[str, Any]) -> Iterator[bytes]:
    for name, data in events(result):
        yield sse(data, event=name)
