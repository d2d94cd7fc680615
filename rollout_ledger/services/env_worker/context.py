"""Context policies: which messages of an episode's conversation each turn is generated from.

``full`` (the default) generates every turn from the whole conversation, so an episode is one segment. ``window``
keeps the leading system message(s) and the last N turns, as interactor-style agents trim their prompts: the
driver re-renders that window before every turn (``Transcript.add_observation(window=...)``, drift ``window``),
so each turn is a segment of its own, a training sample whose context is exactly what the policy saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_ledger.shared.events import ContextPolicy

Message = dict[str, Any]


def turns_of(messages: Sequence[Message]) -> list[list[Message]]:
    """The messages cut into turns: each turn is the messages before an assistant reply and the reply (the newest
    messages, not answered yet, are a turn of their own)."""
    out: list[list[Message]] = []
    current: list[Message] = []
    for msg in messages:
        if msg.get("role") != "assistant" and current and current[-1].get("role") == "assistant":
            out.append(current)
            current = []
        current.append(msg)
    if current:
        out.append(current)
    return out


def window(messages: Sequence[Message], turns: int) -> list[Message]:
    """The leading system message(s) and the last ``turns`` turns of ``messages``."""
    head = 0
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    kept = turns_of(messages[head:])[-turns:] if turns > 0 else []
    return [*messages[:head], *(m for turn in kept for m in turn)]


def uses_window(policy: ContextPolicy | None) -> bool:
    """Whether ``policy`` generates turns from a window (callers then build the conversation to cut it from)."""
    return policy is not None and policy.policy != "full"


def windowed(policy: ContextPolicy | None, messages: Sequence[Message]) -> list[Message] | None:
    """The window the next turn is generated from under ``policy``, or None for the full history."""
    if policy is None or not uses_window(policy):
        return None
    return window(messages, policy.window_turns)
