"""Model text and token ids <-> OpenAI chat-completion objects: tool calls, logprobs, responses and SSE chunks.

Pure functions. Stop strings follow OpenAI: a turn that stopped on one (``stop_strings.cut_at_stop``) answers the text
before it, and nothing after it; the sampled ids stay as the engine returned them (see "Action text and ids" below).
A turn's text is cut into hermes ``<tool_call>{json}</tool_call>`` blocks by
``envs.tools.scan_blocks`` and each block parsed by ``envs.tools.parse_block`` (the scanner and parser the
built-in tool environments use); when every block parses, the turn becomes an assistant message with
``tool_calls`` (arguments as a JSON string, as OpenAI sends them) and the text outside the blocks as
``content`` (null when empty); when any block is malformed the whole text stays ``content`` and
``finish_reason`` is what the engine said (as vLLM's hermes parser does). Streams are the whole turn replayed
as chunks (the engine returns a turn at once): a role chunk carrying ``prompt_token_ids``, one content chunk
per sampled token with its logprobs and ``token_ids`` (the texts decoded incrementally by
``ChatTokenizer.stream_texts``), one chunk per tool call, a last chunk with ``finish_reason``, and with
``stream_options.include_usage`` a usage chunk without choices; then ``data: [DONE]``.

Action text and ids. The engine returns the ids it sampled, which are recorded verbatim (never re-tokenised or
trimmed). With a stop string, vLLM (and the fake engine, which imitates it) stops after the id whose text
completes the stop string, without an end-of-turn id: decoded, those ids end with the stop string and sometimes
more (a token such as ``".\n"`` for the stop string ``"."``). The turn's **action** (``StepCompleted.action``,
the ``content`` and the parsed tool calls) is ``decode(ids, skip_special_tokens=True)`` cut before the stop string
whose occurrence ends first (ties: the first listed), which is the string that stopped the engine; without a stop
string in the text it is the whole decode. So ``action`` is a prefix of the decoded ids, never longer; the ids
(``token_ids``, ``logprobs.content``, usage) cover every sampled id, stop string and end-of-turn id included, and
the next turn's context continues from those ids, not from the action text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_ledger.services.envs.tools import ToolCallError, parse_block, scan_blocks
from rollout_ledger.shared.kit.chat import ChatTokenizer

Message = dict[str, Any]


@dataclass(frozen=True)
class AssistantTurn:
    """What the endpoint answers for one sampled turn."""

    content: str | None
    """Text for the client: the whole turn, or the text outside its tool calls (None when there is none)."""
    tool_calls: list[dict[str, Any]]
    """OpenAI ``tool_calls`` (empty for a plain turn)."""
    finish_reason: str
    """``tool_calls``, ``stop`` or ``length``."""

    def message(self) -> Message:
        """The response's ``choices[0].message`` (with OpenAI's ``refusal`` and ``annotations``: none here)."""
        out: Message = {"role": "assistant", "content": self.content, "refusal": None, "annotations": []}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def canonical(self) -> Message:
        """The message as ``protocol.normalize_messages`` would give it back (what the next call should send)."""
        out: Message = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


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
    """The OpenAI view of a sampled turn whose action text is ``action`` (the decoded ids, special tokens skipped,
    already cut at a stop string: ``stop_strings.cut_at_stop``).

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


def logprobs_content(tok: ChatTokenizer, token_ids: np.ndarray, logprobs: np.ndarray,
                     top: Sequence[dict[int, float]] | None, k: int) -> list[dict[str, Any]]:
    """``choices[0].logprobs.content``: one entry per sampled id (the end-of-turn id included), with the top ``k``
    alternatives when the engine returned them. Each entry also carries ``token_id``."""
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
        choice: dict[str, Any] = {"index": 0, "message": self.turn.message(), "finish_reason": self.turn.finish_reason,
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


def token_texts(tok: ChatTokenizer, token_ids: Sequence[int]) -> list[str]:
    """The content text each sampled id adds (special tokens skipped; a multi-byte character split across ids
    appears with the id that completes it), so the pieces concatenate to the decoded turn. Linear in the turn's
    length (``ChatTokenizer.stream_texts``)."""
    return tok.stream_texts(token_ids)


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")
