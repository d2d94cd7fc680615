"""Hermes-style tool calls: tool schemas, parsing ``<tool_call>{json}</tool_call>`` from a turn, argument checks.

Pure functions. ``scan_blocks`` (shared/tool_blocks.py) is the one scanner of ``<tool_call>`` blocks: the built-in
tool environments take at most one call from it (``parse_turn``: the first, as in the slime tau-bench agent;
``AgentTurn.extra_calls`` counts the others) and the session endpoint (``env_worker/sessions/turns.py``)
turns every block into an OpenAI tool call. Everything wrong with a call raises ``ToolCallError`` with a
``ToolCallErrorKind``; the environment decides whether that is an error observation for the model or the end
of the episode.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_ledger.shared.tool_blocks import CLOSE, OPEN, ToolBlock, scan_blocks


class ToolCallErrorKind(enum.StrEnum):
    """What was wrong with a tool call."""

    UNCLOSED = "unclosed"
    """``<tool_call>`` without ``</tool_call>`` and no JSON object after it."""
    MALFORMED_JSON = "malformed_json"
    """The text between the tags is not JSON."""
    NOT_AN_OBJECT = "not_an_object"
    """The JSON is not an object."""
    MISSING_NAME = "missing_name"
    """The object has no string ``name``."""
    BAD_ARGUMENTS = "bad_arguments"
    """``arguments`` is neither an object nor a string holding one."""
    UNKNOWN_TOOL = "unknown_tool"
    """No tool of that name."""
    INVALID_ARGUMENTS = "invalid_arguments"
    """The arguments do not match the tool's parameters (missing, unexpected or wrongly typed)."""


class ToolCallError(ValueError):
    """A tool call that cannot be executed; ``kind`` says why."""

    def __init__(self, kind: ToolCallErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AgentTurn:
    """An assistant turn split into its plain text and its (first) tool call."""

    text: str
    """The text outside the tool-call blocks, each piece stripped, joined by single spaces."""
    call: ToolCall | None
    """The first tool call; ``None`` for a plain-text turn."""
    extra_calls: int = 0
    """Further ``<tool_call>`` blocks in the turn (ignored, not parsed)."""


def parse_block(block: ToolBlock) -> ToolCall:
    """The call a block holds; ``ToolCallError`` when it is malformed.

    An unclosed block is accepted when its body is a JSON object (an engine may stop on ``</tool_call>`` and
    drop the stop string).
    """
    return _parse_call(block.body, unclosed=not block.closed)


def parse_turn(text: str) -> AgentTurn:
    """Split ``text`` into plain text and the first tool call; ``ToolCallError`` when that call is malformed.

    An unclosed last ``<tool_call>`` is accepted when what follows it is a JSON object (see ``parse_block``).
    """
    blocks, outside = scan_blocks(text)
    if not blocks:
        return AgentTurn(text=text.strip(), call=None)
    first = blocks[0]
    call = parse_block(first)
    pieces = (p.strip() for p in outside)
    return AgentTurn(text=" ".join(p for p in pieces if p), call=call, extra_calls=text.count(OPEN, first.end))


def _parse_call(body: str, unclosed: bool) -> ToolCall:
    try:
        value = json.loads(body)
    except ValueError:
        if unclosed:
            raise ToolCallError(ToolCallErrorKind.UNCLOSED, "<tool_call> is not closed by </tool_call>") from None
        raise ToolCallError(ToolCallErrorKind.MALFORMED_JSON,
                            f"the tool call is not valid JSON: {_clip(body.strip())}") from None
    if not isinstance(value, dict):
        raise ToolCallError(ToolCallErrorKind.NOT_AN_OBJECT,
                            f"the tool call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(ToolCallErrorKind.MISSING_NAME, "the tool call has no string \"name\"")
    arguments = value.get("arguments", {})
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ToolCallError(ToolCallErrorKind.BAD_ARGUMENTS,
                                f"\"arguments\" of {name} is a string but not JSON: {_clip(arguments)}") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(ToolCallErrorKind.BAD_ARGUMENTS,
                            f"\"arguments\" of {name} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name=name, arguments=arguments)


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


# --- tool schemas -------------------------------------------------------------------------------------
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


@dataclass(frozen=True)
class Param:
    """One parameter of a tool (a small JSON-schema subset: type, enum, array item type)."""

    type: str
    description: str
    enum: tuple[Any, ...] = ()
    items: str | None = None
    """Element type of an ``array``."""

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.enum:
            out["enum"] = list(self.enum)
        if self.items is not None:
            out["items"] = {"type": self.items}
        return out

    def check(self, name: str, value: Any) -> None:
        if not _JSON_TYPES[self.type](value):
            raise ValueError(f"{name} must be of type {self.type}, got {type(value).__name__}")
        if self.enum and value not in self.enum:
            raise ValueError(f"{name} must be one of {', '.join(map(str, self.enum))}, got {value!r}")
        if self.items is not None:
            for i, item in enumerate(value):
                if not _JSON_TYPES[self.items](item):
                    raise ValueError(f"{name}[{i}] must be of type {self.items}, got {type(item).__name__}")


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, description and parameters (all required unless listed)."""

    name: str
    description: str
    params: Mapping[str, Param] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema the chat template renders."""
        return {"type": "function", "function": {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": {k: p.schema() for k, p in self.params.items()},
                "required": [k for k in self.params if k not in self.optional],
            },
        }}

    def check(self, arguments: Mapping[str, Any]) -> None:
        """``ToolCallError(INVALID_ARGUMENTS)`` unless ``arguments`` match the parameters exactly."""
        unexpected = sorted(set(arguments) - set(self.params))
        missing = [k for k in self.params if k not in arguments and k not in self.optional]
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected {', '.join(unexpected)}")
        for key, param in self.params.items():
            if key in arguments:
                try:
                    param.check(key, arguments[key])
                except ValueError as exc:
                    problems.append(str(exc))
        if problems:
            raise ToolCallError(ToolCallErrorKind.INVALID_ARGUMENTS, f"{self.name}: {'; '.join(problems)}")


def validate_call(call: ToolCall, tools: Iterable[ToolSpec]) -> ToolSpec:
    """The spec ``call`` names, after checking its arguments; ``ToolCallError`` otherwise."""
    by_name = {t.name: t for t in tools}
    spec = by_name.get(call.name)
    if spec is None:
        raise ToolCallError(ToolCallErrorKind.UNKNOWN_TOOL,
                            f"unknown tool {call.name!r}; available: {', '.join(sorted(by_name))}")
    spec.check(call.arguments)
    return spec


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The Hermes text of a call (what a well-behaved model emits; used by scripted policies)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{CLOSE}"
