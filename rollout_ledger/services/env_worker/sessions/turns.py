"""The session's protocol-neutral turn types: what a dialect asks of a session (``TurnRequest``) and what it gets
back (``TurnResult``), the conversation's canonical messages, and the model text <-> tool calls mapping every dialect
shares.

The canonical conversation is the chat template's own input (Hugging Face chat messages): ``role`` (``system``,
``user``, ``assistant``, ``tool``), ``content`` as text, an assistant's ``tool_calls`` as
``[{"id", "type": "function", "function": {"name", "arguments"}}]`` with ``arguments`` a JSON string, a tool
message's ``tool_call_id``. Each dialect (``dialects/``) turns its wire format into these and back; the session
(``session``) sees nothing else.

Stop strings follow the APIs: a turn that stopped on one (``stop_strings.stop_hit``) answers the text before it,
and nothing after it; the sampled ids stay as the engine returned them. A turn's text is cut into hermes
``<tool_call>{json}</tool_call>`` blocks by ``envs.tools.scan_blocks`` and each block parsed by
``envs.tools.parse_block`` (the scanner and parser the built-in tool environments use); when every block parses,
the turn is an assistant message with ``tool_calls`` and the text outside the blocks as ``content`` (None when
empty); when any block is malformed the whole text stays ``content`` and the finish reason is the engine's (as
vLLM's hermes parser does).

Action text and ids. The engine returns the ids it sampled, which are recorded verbatim (never re-tokenised or
trimmed). With a stop string, vLLM (and the fake engine, which imitates it) stops after the id whose text completes
the stop string, without an end-of-turn id: decoded, those ids end with the stop string and sometimes more (a token
such as ``".\\n"`` for the stop string ``"."``). The turn's **action** (``StepCompleted.action``, the reply's text and
parsed tool calls) is ``decode(ids, skip_special_tokens=True)`` cut before the stop string whose occurrence ends
first (ties: the first listed), which is the string that stopped the engine; without a stop string in the text it
is the whole decode. So ``action`` is a prefix of the decoded ids, never longer; the ids (``token_ids``,
``logprobs``, usage) cover every sampled id, stop string and end-of-turn id included, and the next turn's context
continues from those ids, not from the action text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_ledger.services.envs.tools import ToolCallError, parse_block, scan_blocks
from rollout_ledger.shared.kit.chat import ChatTokenizer

Message = dict[str, Any]
"""One canonical conversation message (the chat template's input)."""


class ApiError(Exception):
    """A call the session endpoint refuses (4xx for bad input, 404 unknown session, 503 no turn); each dialect
    writes it in its API's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")


@dataclass(frozen=True)
class TurnRequest:
    """One model call, in no protocol's terms: the whole conversation so far and how to sample the next turn."""

    messages: list[Message]
    """The conversation, canonical (``Message``)."""
    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template renders them (``{"type": "function", "function": {...}}``), None without."""
    parse_tools: bool = False
    """Whether the turn's text is searched for tool calls (tools given and not turned off by the call)."""
    tool_call: dict[str, Any] | None = None
    """``SamplingParams.tool_call``: the call the turn must make (names and their parameter schemas)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Top-k cut-off (-1: none; None: the batch's)."""
    stop: list[str] | None = None
    """Stop strings (None: the batch's)."""
    seed: int | None = None
    max_tokens: int | None = None
    """The call's limit on sampled ids (None: the batch's)."""
    logprobs: bool = False
    """Whether the result carries per-token logprob entries."""
    top_logprobs: int = 0
    """Alternatives per token in those entries."""
    stream: bool = False
    """Whether the result carries each id's text (``TurnResult.token_texts``) for a stream."""
    model: str = ""
    """The model the call named (echoed back; the session's policy answers whatever is named)."""


@dataclass(frozen=True)
class AssistantTurn:
    """What a sampled turn says, parsed."""

    content: str | None
    """Text: the whole turn, or the text outside its tool calls (None when there is none)."""
    tool_calls: list[dict[str, Any]]
    """Canonical tool calls (empty for a plain turn)."""
    finish_reason: str
    """``tool_calls``, ``stop`` or ``length``."""

    def canonical(self) -> Message:
        """The canonical assistant message (what the next call should send back, in any dialect)."""
        out: Message = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass(frozen=True)
class TurnResult:
    """One sampled turn as every dialect needs it."""

    turn: AssistantTurn
    stop_string: str | None
    """The stop string the turn ended on (None: it ended otherwise)."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    """The sampled ids, verbatim."""
    logprobs: list[dict[str, Any]] | None
    """Per sampled id (``logprob_entries``) when the request asked for logprobs."""
    token_texts: list[str]
    """Text each sampled id adds, clipped at the action's end (for streams; empty otherwise)."""
    event_id: str
    """The ``TurnGenerated`` event id (responses derive their ids from it)."""
    model: str
    created: int
    extra: dict[str, Any] = field(default_factory=dict)
    """Ledger fields a response carries (``episode_id``, ``turn_index``, ``turn_event_id``, ``segment``)."""
    temperature: float = 1.0
    """The temperature the turn was sampled with (the call's, else the batch's)."""
    top_p: float = 1.0


def split_tool_blocks(text: str) -> tuple[list[str], list[str]] | None:
    """``text`` cut into its ``<tool_call>`` blocks (tags included; an unclosed last one runs to the end) and the
    pieces outside them (``envs.tools.scan_blocks`` as text); None when there is no block."""
    blocks, outside = scan_blocks(text)
    if not blocks:
        return None
    return [text[b.start:b.end] for b in blocks], outside


def clip_texts(pieces: Sequence[str], length: int) -> list[str]:
    """Stream pieces (one per id) clipped so they concatenate to the first ``length`` characters of their
    concatenation (the ids after a stop string stream no text)."""
    out, used = [], 0
    for piece in pieces:
        keep = piece[:max(0, length - used)]
        used += len(keep)
        out.append(keep)
    return out


def call_id(seed: str, index: int) -> str:
    """A deterministic tool-call id (the turn's event id and the call's position)."""
    return f"call_{hashlib.sha256(f'{seed}#{index}'.encode()).hexdigest()[:24]}"


def assistant_turn(action: str, finish_reason: str, *, parse_tools: bool, id_seed: str) -> AssistantTurn:
    """The parsed view of a sampled turn whose action text is ``action`` (the decoded ids, special tokens skipped,
    already cut at a stop string: ``stop_strings.stop_hit``).

    ``finish_reason`` is the engine's (``stop``/``length``/``abort``: abort is reported as ``stop``).
    """
    reason = "length" if finish_reason == "length" else "stop"
    blocks, outside = scan_blocks(action) if parse_tools else ([], [])
    if not blocks:
        return AssistantTurn(content=action, tool_calls=[], finish_reason=reason)
    calls = []
    for i, block in enumerate(blocks):
        try:
            call = parse_block(block)
        except ToolCallError:
            return AssistantTurn(content=action, tool_calls=[], finish_reason=reason)
        calls.append({"id": call_id(id_seed, i), "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})
    text = " ".join(p.strip() for p in outside if p.strip())
    return AssistantTurn(content=text or None, tool_calls=calls, finish_reason="tool_calls")


def _token_text(tok: ChatTokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def logprob_entries(tok: ChatTokenizer, token_ids: np.ndarray, logprobs: np.ndarray,
                    top: Sequence[dict[int, float]] | None, k: int) -> list[dict[str, Any]]:
    """One entry per sampled id (the end-of-turn id included): ``token``, ``logprob``, ``bytes``, ``token_id`` and
    ``top_logprobs`` (the top ``k`` alternatives when the engine returned them), as OpenAI's APIs lay them out."""
    out = []
    for i, (tid, lp) in enumerate(zip(token_ids.tolist(), logprobs.tolist(), strict=True)):
        text = _token_text(tok, tid)
        alts: list[dict[str, Any]] = []
        if k > 0 and top is not None and i < len(top):
            ranked = sorted(top[i].items(), key=lambda kv: kv[1], reverse=True)[:k]
            for alt_id, alt_lp in ranked:
                alt_text = _token_text(tok, int(alt_id))
                alts.append({"token": alt_text, "logprob": float(alt_lp), "bytes": list(alt_text.encode()),
                             "token_id": int(alt_id)})
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": alts,
                    "token_id": int(tid)})
    return out


def token_texts(tok: ChatTokenizer, token_ids: Sequence[int]) -> list[str]:
    """The content text each sampled id adds (special tokens skipped; a multi-byte character split across ids
    appears with the id that completes it), so the pieces concatenate to the decoded turn. Linear in the turn's
    length (``ChatTokenizer.stream_texts``)."""
    return tok.stream_texts(token_ids)


def same_message(sent: Message, returned: Message) -> bool:
    """Whether a canonical message the client sent back is the assistant message the endpoint returned.

    Content must be equal (null and "" are the same). Tool calls must have the same ids, names and arguments;
    arguments are compared as JSON values, since frameworks parse and re-dump them (spacing, key order).
    """
    if sent.get("role") != "assistant" or sent.get("content", "") != returned.get("content", ""):
        return False
    a, b = sent.get("tool_calls") or [], returned.get("tool_calls") or []
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x["id"] and x["id"] != y["id"]:
            return False
        if x["function"]["name"] != y["function"]["name"]:
            return False
        if _json_value(x["function"]["arguments"]) != _json_value(y["function"]["arguments"]):
            return False
    return True


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
