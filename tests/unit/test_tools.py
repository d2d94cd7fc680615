"""Hermes tool-call parsing and argument checks: plain text, one call, many calls, and every malformed kind."""

from __future__ import annotations

import json

import pytest

from rollout_ledger.services.envs.tools import (
    AgentTurn,
    Param,
    ToolBlock,
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    ToolSpec,
    format_call,
    parse_block,
    parse_turn,
    scan_blocks,
    validate_call,
)

K = ToolCallErrorKind

TOOLS = (
    ToolSpec("get_order", "Get an order.", {"order_id": Param("string", "id")}),
    ToolSpec("cancel", "Cancel.", {"order_id": Param("string", "id"),
                                   "reason": Param("string", "why", enum=("a", "b"))}),
    ToolSpec("ret", "Return.", {"ids": Param("array", "ids", items="string"), "n": Param("integer", "n"),
                                "rush": Param("boolean", "fast")}, optional=frozenset({"rush"})),
    ToolSpec("done", "End."),
)


@pytest.mark.parametrize("text, expected", [
    ("Hello, how can I help?", AgentTurn("Hello, how can I help?", None)),
    ("  \n", AgentTurn("", None)),
    ("", AgentTurn("", None)),
    ('<tool_call>{"name": "done", "arguments": {}}</tool_call>', AgentTurn("", ToolCall("done", {}))),
    ('<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>',
     AgentTurn("", ToolCall("get_order", {"order_id": "#W1"}))),
    ('Let me check. <tool_call>{"name": "get_order", "arguments": {"order_id": "#W1"}}</tool_call> One moment.',
     AgentTurn("Let me check. One moment.", ToolCall("get_order", {"order_id": "#W1"}))),
    ('<tool_call>{"name": "done"}</tool_call>', AgentTurn("", ToolCall("done", {}))),
    ('<tool_call>{"name": "done", "arguments": null}</tool_call>', AgentTurn("", ToolCall("done", {}))),
    ('<tool_call>{"name": "get_order", "arguments": "{\\"order_id\\": \\"#W2\\"}"}</tool_call>',
     AgentTurn("", ToolCall("get_order", {"order_id": "#W2"}))),
    ('<tool_call>{"name": "done", "arguments": ""}</tool_call>', AgentTurn("", ToolCall("done", {}))),
    ('<tool_call>{"name": "get_order", "arguments": {"order_id": "ünï 🎲"}}</tool_call>',
     AgentTurn("", ToolCall("get_order", {"order_id": "ünï 🎲"}))),
    # unclosed but complete JSON (an engine that stopped on "</tool_call>")
    ('<tool_call>\n{"name": "done", "arguments": {}}\n', AgentTurn("", ToolCall("done", {}))),
])
def test_parse_turn(text: str, expected: AgentTurn) -> None:
    assert parse_turn(text) == expected


def test_only_the_first_call_is_taken() -> None:
    text = ('a <tool_call>{"name": "get_order", "arguments": {"order_id": "1"}}</tool_call> b '
            '<tool_call>{"name": "done", "arguments": {}}</tool_call> c <tool_call>not json</tool_call> d')
    turn = parse_turn(text)
    assert turn.call == ToolCall("get_order", {"order_id": "1"})
    assert turn.extra_calls == 2
    assert turn.text == "a b c d"
    # a malformed later call does not matter; a trailing unclosed one is dropped from the text
    turn = parse_turn('<tool_call>{"name": "done"}</tool_call> then <tool_call>{"name": ')
    assert turn.call == ToolCall("done", {}) and turn.extra_calls == 1 and turn.text == "then"


def test_scan_blocks_cuts_blocks_and_the_text_outside_them() -> None:
    assert scan_blocks("no call") == ([], ["no call"])
    assert scan_blocks("") == ([], [""])
    text = 'a <tool_call>{"name": "x"}</tool_call> b <tool_call>[1]</tool_call><tool_call>{"name": '
    blocks, outside = scan_blocks(text)
    assert outside == ["a ", " b ", "", ""]  # one piece more than blocks; empty after an unclosed block
    assert [(b.body, b.closed) for b in blocks] == [('{"name": "x"}', True), ("[1]", True), ('{"name": ', False)]
    assert [text[b.start:b.end] for b in blocks] == [
        '<tool_call>{"name": "x"}</tool_call>', "<tool_call>[1]</tool_call>", '<tool_call>{"name": ']
    assert "".join(o + text[b.start:b.end] for o, b in zip(outside, blocks, strict=False)) + outside[-1] == text
    # a nested open tag belongs to the body of the block around it
    inner = scan_blocks("<tool_call> <tool_call> </tool_call>x")
    assert inner == ([ToolBlock(0, 36, " <tool_call> ", True)], ["", "x"])


def test_parse_block_is_parse_turn_on_one_block() -> None:
    blocks, _ = scan_blocks('<tool_call>{"name": "done"}</tool_call> <tool_call>{"name": "get_order"')
    assert parse_block(blocks[0]) == ToolCall("done", {})
    with pytest.raises(ToolCallError) as err:
        parse_block(blocks[1])
    assert err.value.kind is K.UNCLOSED
    assert parse_block(scan_blocks('<tool_call>{"name": "done"}')[0][0]) == ToolCall("done", {})


@pytest.mark.parametrize("text, kind", [
    ("<tool_call>{name: done}</tool_call>", K.MALFORMED_JSON),
    ("<tool_call></tool_call>", K.MALFORMED_JSON),
    ('<tool_call>{"name": "done", "arguments": {}}}</tool_call>', K.MALFORMED_JSON),
    ("<tool_call>{'name': 'done'}</tool_call>", K.MALFORMED_JSON),
    ('<tool_call>{"name": "done"', K.UNCLOSED),
    ("I will call <tool_call>", K.UNCLOSED),
    ('<tool_call>["done"]</tool_call>', K.NOT_AN_OBJECT),
    ('<tool_call>"done"</tool_call>', K.NOT_AN_OBJECT),
    ("<tool_call>42</tool_call>", K.NOT_AN_OBJECT),
    ('<tool_call>{"arguments": {}}</tool_call>', K.MISSING_NAME),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', K.MISSING_NAME),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', K.MISSING_NAME),
    ('<tool_call>{"name": "done", "arguments": [1]}</tool_call>', K.BAD_ARGUMENTS),
    ('<tool_call>{"name": "done", "arguments": 3}</tool_call>', K.BAD_ARGUMENTS),
    ('<tool_call>{"name": "done", "arguments": "{oops"}</tool_call>', K.BAD_ARGUMENTS),
    ('<tool_call>{"name": "done", "arguments": "[1, 2]"}</tool_call>', K.BAD_ARGUMENTS),
])
def test_malformed_calls_raise_typed_errors(text: str, kind: ToolCallErrorKind) -> None:
    with pytest.raises(ToolCallError) as err:
        parse_turn(text)
    assert err.value.kind is kind and str(err.value)


@pytest.mark.parametrize("call, kind, words", [
    (ToolCall("refund", {}), K.UNKNOWN_TOOL, ["refund", "get_order"]),
    (ToolCall("get_order", {}), K.INVALID_ARGUMENTS, ["missing order_id"]),
    (ToolCall("get_order", {"order_id": 5}), K.INVALID_ARGUMENTS, ["order_id must be of type string"]),
    (ToolCall("get_order", {"order_id": "1", "x": 1}), K.INVALID_ARGUMENTS, ["unexpected x"]),
    (ToolCall("cancel", {"order_id": "1", "reason": "c"}), K.INVALID_ARGUMENTS, ["reason must be one of a, b"]),
    (ToolCall("ret", {"ids": "i1", "n": 1}), K.INVALID_ARGUMENTS, ["ids must be of type array"]),
    (ToolCall("ret", {"ids": ["i1", 2], "n": 1}), K.INVALID_ARGUMENTS, ["ids[1] must be of type string"]),
    (ToolCall("ret", {"ids": [], "n": True}), K.INVALID_ARGUMENTS, ["n must be of type integer"]),
    (ToolCall("ret", {"ids": [], "n": 1.5}), K.INVALID_ARGUMENTS, ["n must be of type integer"]),
    (ToolCall("ret", {"ids": [], "n": 1, "rush": 1}), K.INVALID_ARGUMENTS, ["rush must be of type boolean"]),
])
def test_validate_call_rejects(call: ToolCall, kind: ToolCallErrorKind, words: list[str]) -> None:
    with pytest.raises(ToolCallError) as err:
        validate_call(call, TOOLS)
    assert err.value.kind is kind
    for word in words:
        assert word in str(err.value)


def test_validate_call_accepts_and_returns_the_spec() -> None:
    assert validate_call(ToolCall("done", {}), TOOLS).name == "done"
    assert validate_call(ToolCall("ret", {"ids": ["a"], "n": 2}), TOOLS).name == "ret"
    assert validate_call(ToolCall("ret", {"ids": [], "n": 2, "rush": False}), TOOLS).name == "ret"
    assert validate_call(ToolCall("cancel", {"order_id": "1", "reason": "b"}), TOOLS).name == "cancel"


def test_schema_is_the_hermes_function_format() -> None:
    schema = TOOLS[2].schema()
    assert schema == {"type": "function", "function": {
        "name": "ret", "description": "Return.",
        "parameters": {"type": "object", "properties": {
            "ids": {"type": "array", "description": "ids", "items": {"type": "string"}},
            "n": {"type": "integer", "description": "n"},
            "rush": {"type": "boolean", "description": "fast"}},
            "required": ["ids", "n"]}}}
    assert TOOLS[1].schema()["function"]["parameters"]["properties"]["reason"]["enum"] == ["a", "b"]
    json.dumps(schema)  # plain JSON


def test_format_call_round_trips() -> None:
    args = {"order_id": "#W1", "ids": ["ü", "b"]}
    text = format_call("get_order", args)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert parse_turn(text) == AgentTurn("", ToolCall("get_order", args))
