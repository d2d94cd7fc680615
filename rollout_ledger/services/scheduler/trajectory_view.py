"""The readable view of a trajectory: its prompt, sampled and observation spans, decoded with the policy tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rollout_ledger.shared.kit.chat import ChatTokenizer, ModelNotFoundError, load_chat_tokenizer

ViewSpanKind = Literal["prompt", "sampled", "observation", "context"]
"""``context``: a segment's re-rendered context (the template or a context policy re-rendered the conversation)."""


@dataclass(frozen=True)
class ViewSpan:
    """``[start, end)`` of the token sequence and what produced it."""

    kind: ViewSpanKind
    start: int
    end: int
    turn_index: int | None


def trajectory_spans(num_tokens: int, prompt_len: int, action_ranges: Sequence[Sequence[int]],
                     segments: Sequence[Sequence[int]] = ()) -> list[ViewSpan]:
    """Split ``[0, num_tokens)`` into the prompt, each sampled span and the observation spans between them.

    The tokens after sampled span ``i`` and before span ``i+1`` (or the end) are the observation answering
    turn ``i``; where a segment starts there instead, they are that segment's re-rendered ``context``. Ranges are
    clipped to the sequence so a malformed row still yields a view.
    """
    spans: list[ViewSpan] = []
    prompt_end = max(0, min(prompt_len, num_tokens))
    spans.append(ViewSpan("prompt", 0, prompt_end, None))
    starts = {int(seg[0]) for seg in segments if int(seg[0]) > 0}
    pos = prompt_end
    last_turn: int | None = None

    def gap(until: int) -> None:
        kind: ViewSpanKind = "context" if pos in starts else "observation"
        spans.append(ViewSpan(kind, pos, until, last_turn))

    for turn, rng in enumerate(action_ranges):
        start = max(pos, min(int(rng[0]), num_tokens))
        end = max(start, min(int(rng[1]), num_tokens))
        if start > pos:
            gap(start)
        spans.append(ViewSpan("sampled", start, end, turn))
        pos = end
        last_turn = turn
    if pos < num_tokens:
        gap(num_tokens)
    return spans


class TokenizerCache:
    """Loads the policy tokenizer on first use, off the event loop; a missing model is retried on the next use."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._tokenizer: ChatTokenizer | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> tuple[ChatTokenizer | None, str | None]:
        """The tokenizer, or None and a note saying why it is unavailable."""
        if self._tokenizer is not None:
            return self._tokenizer, None
        async with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = await asyncio.to_thread(load_chat_tokenizer, self.model_dir)
                except ModelNotFoundError as exc:
                    return None, f"token ids are not decoded: {exc}"
        return self._tokenizer, None


def decode_spans(tokenizer: ChatTokenizer, token_ids: Sequence[int], spans: Sequence[ViewSpan]) -> list[str]:
    """The text of each span (special tokens kept, so template tokens stay visible)."""
    return [tokenizer.decode(token_ids[s.start : s.end]) for s in spans]
