"""Stop strings as OpenAI answers them: the text a turn that stopped on one stands for (its sampled ids are kept
verbatim elsewhere; only the action text is cut)."""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the stop string that occurs in it and ends first (ties: the first listed), and whether
    one occurred: the stop string that made the engine stop (vLLM's ``check_stop_strings`` picks the same one), so
    the result is OpenAI's content, with neither the stop string nor anything after it."""
    end = start = -1
    for s in stop:
        at = text.find(s) if s else -1
        if at >= 0 and (end < 0 or at + len(s) < end):
            start, end = at, at + len(s)
    return (text, False) if end < 0 else (text[:start], True)
