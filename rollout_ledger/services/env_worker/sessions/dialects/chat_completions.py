"""The OpenAI Chat Completions dialect of the session endpoint (``/v1/chat/completions``): request validation into
the neutral ``TurnRequest``, message normalisation into canonical messages, the ``chat.completion`` response and its
stream of chunks, and errors in the OpenAI shape (``{"error": {"message", "type", "param", "code"}}``).

Requests are validated here and nowhere else. Fields the SDKs send that change nothing for us (``user``,
``metadata``, ``parallel_tool_calls``, ``store``, ``verbosity``, ``prompt_cache_key``, ..., and any field we do
not know, as vLLM does) are accepted and ignored; fields that would change the sampling or the reply in a way
the engine cannot honour (``n > 1``, penalties, ``logit_bias``, structured output, the legacy ``functions``
API) are refused with a 400 that names the field, never silently dropped. ``model`` is required, as OpenAI
requires it (any name is answered by the session's policy).

``tool_choice``: ``auto`` (the default with tools) and ``none`` are OpenAI's: the model sees the tools and its
hermes calls are parsed (``auto``) or its text is returned as content (``none``). A choice that OpenAI guarantees
by constrained sampling is enforced the same way: ``required`` (a call of any of the tools), a named function (a
call of that one) and ``allowed_tools`` in mode ``required`` (a call of one of those listed) sample the turn under
``SamplingParams.tool_call``, which the engine turns into a grammar (exactly one hermes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of an allowed name, then end of turn), so the reply
always carries a parsed call (``finish_reason`` ``tool_calls``) and the recorded ids are the ones sampled under the
constraint. ``allowed_tools`` in mode ``auto`` naming every tool is ``auto``; naming only some of the tools (the
model may answer in text or call one of those) is refused with a 400 (code ``tool_choice_not_enforced``): no
engine constraint expresses it, and a turn calling another tool would be recorded under a promise the policy never
kept.

Streams are the whole turn replayed as chunks (the engine returns a turn at once): a role chunk carrying
``prompt_token_ids``, one content chunk per sampled token with its logprobs and ``token_ids``, one chunk per tool
call, a last chunk with ``finish_reason``, and with ``stream_options.include_usage`` a usage chunk without choices;
then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout_ledger.services.env_worker.sessions.dialects.sse import DONE, sse
from rollout_ledger.services.env_worker.sessions.turns import ApiError, AssistantTurn, Message, TurnRequest, TurnResult

ROLES = ("system", "developer", "user", "assistant", "tool")


def error_body(exc: ApiError) -> dict[str, Any]:
    """The JSON body OpenAI clients parse (``openai.APIStatusError.body``)."""
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


class FunctionDef(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    """One entry of ``tools`` (only ``function`` tools exist in chat completions)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.function.get("name", ""))


class AllowedTools(BaseModel):
    """The body of an ``allowed_tools`` choice: the tools the model may call, and whether it must call one."""

    model_config = ConfigDict(extra="allow")

    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(min_length=1)

    @property
    def names(self) -> list[str]:
        return [str((t.get("function") or {}).get("name", "")) for t in self.tools]


class AllowedToolsChoice(BaseModel):
    """``tool_choice`` restricting the calls to some of the tools (``{"type": "allowed_tools", ...}``)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


TOOL_CHOICES = ("'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} or "
                "{'type': 'allowed_tools', 'allowed_tools': {'mode': ..., 'tools': [...]}}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]`` (null: no)."""


class ChatRequest(BaseModel):
    """POST /sessions/{episode_id}/v1/chat/completions (the subset of OpenAI's request we honour)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    """Echoed back; the session's policy answers whatever is named (required, as in OpenAI's API)."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    """The legacy function-calling API (refused: send ``tools``)."""
    function_call: Any = None

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_shape(cls, data: Any) -> Any:
        """A ``tool_choice`` of no known shape is refused naming the shapes (not pydantic's union errors)."""
        choice = data.get("tool_choice") if isinstance(data, dict) else None
        known = choice is None or choice in ("none", "auto", "required") or (
            isinstance(choice, dict) and choice.get("type") in ("function", "allowed_tools"))
        if not known:
            got = choice.get("type") if isinstance(choice, dict) else choice
            raise ValueError(f"tool_choice: must be {TOOL_CHOICES} (only function tools exist here), got {got!r}")
        return data

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.n is not None and self.n != 1:
            raise ValueError("n: only n=1 is supported (each call is one turn of the episode)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported by the rollout engine (leave it unset or 0)")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by the rollout engine (leave it unset or empty)")
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise ValueError(f"{name}: the legacy function-calling API is not supported; send tools instead")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice: names {self.tool_choice.name!r}, which is not among the tools")
        if isinstance(self.tool_choice, AllowedToolsChoice):
            names = {t.function.name for t in self.tools or ()}
            unknown = [n for n in self.tool_choice.allowed_tools.names if n not in names]
            if unknown:
                raise ValueError(f"tool_choice: allowed_tools names {unknown[0]!r}, which is not among the tools")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return self

    def unenforced_tool_choice(self) -> str | None:
        """What the request's ``tool_choice`` would promise that the endpoint cannot enforce (None: it can)."""
        choice = self.tool_choice
        if isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "auto" \
                and set(choice.allowed_tools.names) != {t.function.name for t in self.tools or ()}:
            return "allowed_tools in mode 'auto' naming only some of the tools"
        return None

    @property
    def forced_tools(self) -> list[str] | None:
        """The functions the turn must call one of (``SamplingParams.tool_call``), None when no call is forced:
        every tool for ``required``, the named one, those listed by ``allowed_tools`` in mode ``required``."""
        choice = self.tool_choice
        if choice == "required":
            return [t.function.name for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice):
            return [choice.name]
        if isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "required":
            return list(dict.fromkeys(choice.allowed_tools.names))
        return None

    @property
    def tool_call_constraint(self) -> dict[str, Any] | None:
        """``SamplingParams.tool_call`` for the call ``tool_choice`` forces (the names and their tools' parameter
        schemas), None when no call is forced."""
        names = self.forced_tools
        if not names:
            return None
        schemas = {t.function.name: t.function.parameters for t in self.tools or () if t.function.parameters}
        return {"names": names, "parameters": {n: schemas[n] for n in names if n in schemas}}

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (OpenAI function format), None without tools."""
        if not self.tools:
            return None
        return [t.model_dump(mode="json", exclude_none=True) for t in self.tools]

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the model's text is searched for tool calls (tools given and ``tool_choice`` is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def parse_request(body: Any) -> ChatRequest:
    """The validated request; ``ApiError(400)`` naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        msg = str(err["msg"]).removeprefix("Value error, ")
        if loc is None and ":" in msg:  # a model-level check names its field first
            loc = msg.split(":", 1)[0]
        text = f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg
        raise ApiError(400, text, param=loc) from None
    forced = req.unenforced_tool_choice()
    if forced is not None:
        raise ApiError(400, f"tool_choice: {forced} is not supported: the endpoint enforces a call ('required', a "
                       "named function, allowed_tools in mode 'required') but not a choice between text and some of "
                       "the tools; send those tools only, or mode 'required'", param="tool_choice",
                       code="tool_choice_not_enforced")
    return req


def text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, null (empty) or a list of text parts (concatenated)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}[{i}]: only text content parts are supported, got {kind!r}",
                               param=f"{where}[{i}]")
        return "".join(out)
    raise ApiError(400, f"{where}: content must be a string, null or a list of text parts", param=where)


def normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """``tool_calls`` of an assistant message as ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    with ``arguments`` a string (an object is dumped as JSON)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}: tool_calls must be a list", param=where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{i}]: a tool call needs function.name", param=f"{where}[{i}]")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(raw: list[dict[str, Any]]) -> list[Message]:
    """The request's messages in the canonical form the chat template renders and the session compares.

    ``developer`` becomes ``system``; content is text; an assistant message keeps ``tool_calls`` only when it
    has some; a ``tool`` message keeps its ``tool_call_id``; ``name`` is kept where given. Anything else a
    client attaches (``refusal``, ``annotations``, ``audio``: what the SDK dumps from a returned message) is
    dropped.
    """
    out: list[Message] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"{where}.role")
        norm: Message = {"role": "system" if role == "developer" else role,
                         "content": text_content(msg.get("content"), f"{where}.content")}
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = normalize_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if msg.get("tool_call_id") is not None:
                norm["tool_call_id"] = str(msg["tool_call_id"])
        elif role in ("user", "system") and msg.get("content") is None:
            raise ApiError(400, f"{where}.content: a {role} message needs content", param=f"{where}.content")
        if isinstance(msg.get("name"), str):
            norm["name"] = msg["name"]
        out.append(norm)
    return out


def turn_request(req: ChatRequest) -> TurnRequest:
    """The call in the session's terms."""
    return TurnRequest(
        messages=normalize_messages(req.messages), tools=req.tool_schemas, parse_tools=req.parses_tool_calls,
        tool_call=req.tool_call_constraint, temperature=req.temperature, top_p=req.top_p,
        stop=req.stop_strings if req.stop is not None else None, seed=req.seed, max_tokens=req.completion_limit,
        logprobs=bool(req.logprobs), top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        stream=bool(req.stream), model=req.model)


def message(turn: AssistantTurn) -> Message:
    """The response's ``choices[0].message`` (with OpenAI's ``refusal`` and ``annotations``: none here)."""
    out: Message = {"role": "assistant", "content": turn.content, "refusal": None, "annotations": []}
    if turn.tool_calls:
        out["tool_calls"] = turn.tool_calls
    return out


def completion(result: TurnResult) -> Completion:
    """The chat-completions view of a sampled turn."""
    return Completion(id=f"chatcmpl-{uuid.uuid5(uuid.NAMESPACE_URL, result.event_id).hex}",
                      created=result.created or int(time.time()), model=result.model, turn=result.turn,
                      prompt_token_ids=result.prompt_token_ids, token_ids=result.token_ids, logprobs=result.logprobs,
                      token_texts=result.token_texts, extra=result.extra)


@dataclass(frozen=True)
class Completion:
    """Everything a response needs about one call, whichever way it is sent."""

    id: str
    created: int
    model: str
    turn: AssistantTurn
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None
    """``logprobs.content`` when the request asked for logprobs."""
    token_texts: list[str]
    """Content text of each sampled id for streaming (concatenated: the turn's text, special tokens skipped)."""
    extra: dict[str, Any]
    """Extra top-level fields (``episode_id``, ``turn_index``, ``turn_event_id``, ``segment``)."""

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def response(self) -> dict[str, Any]:
        """The ``chat.completion`` object (stream=false)."""
        choice: dict[str, Any] = {"index": 0, "message": message(self.turn), "finish_reason": self.turn.finish_reason,
                                  "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
                                  "token_ids": self.token_ids}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage, "prompt_token_ids": self.prompt_token_ids, **self.extra}

    def chunks(self, include_usage: bool) -> Iterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of the stream, in order."""
        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
                  **fields: Any) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            choice.update(fields)
            out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                   "model": self.model, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return out

        first = chunk({"role": "assistant", "content": ""})
        first["prompt_token_ids"] = self.prompt_token_ids
        first.update(self.extra)
        yield first
        if self.turn.tool_calls:
            if self.turn.content:
                yield chunk({"content": self.turn.content}, logprobs=self._logprobs(0, len(self.token_ids)),
                            token_ids=self.token_ids)
            else:
                yield chunk({}, logprobs=self._logprobs(0, len(self.token_ids)), token_ids=self.token_ids)
            for i, call in enumerate(self.turn.tool_calls):
                yield chunk({"tool_calls": [{"index": i, **call}]})
        else:
            for i, (tid, text) in enumerate(zip(self.token_ids, self.token_texts, strict=True)):
                yield chunk({"content": text}, logprobs=self._logprobs(i, i + 1), token_ids=[tid])
        yield chunk({}, finish=self.turn.finish_reason)
        if include_usage:
            yield {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [], "usage": self.usage}

    def _logprobs(self, start: int, end: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": self.logprobs[start:end]}


# --- the dialect's face to the app ---------------------------------------------------------------------------------
def parse(body: Any, memory: dict[str, Any]) -> tuple[TurnRequest, ChatRequest]:
    """The call's ``TurnRequest`` and its validated request (``ApiError(400)`` naming the first bad field)."""
    req = parse_request(body)
    return turn_request(req), req


def response(result: TurnResult, req: ChatRequest, memory: dict[str, Any]) -> dict[str, Any]:
    return completion(result).response()


def stream(result: TurnResult, req: ChatRequest, memory: dict[str, Any]) -> Iterator[bytes]:
    for chunk in completion(result).chunks(req.include_usage):
        yield sse(chunk)
    yield DONE
