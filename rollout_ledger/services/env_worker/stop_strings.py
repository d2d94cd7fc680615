"""Stop strings as OpenAI answers them: the text a turn that stopped on one stands for (its sampled ids are kept
verbatim elsewhere; only the action text is cut)."""

from __future__ import annotations

from collections.abc import Sequence


def stop_hit(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """``text`` cut before the stop string that occurs in it and ends first (ties: the first listed), and that
    string (None when none occurs): the stop string that made the engine stop (vLLM's ``check_stop_strings`` picks
    the same one), so the text is the APIs' content, with neither the stop string nor anything after it."""
    end = start = -1
    hit = None
    for s in stop:
        at = text.find(s) if s else -1
        if at >= 0 and (end < 0 or at + len(s) < end):
            start, end, hit = at, at + len(s), s
    return (text, None) if hit is None else (text[:start], hit)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``stop_hit``'s text, and whether a stop string occurred."""
    cut, hit = stop_hit(text, stop)
    return cut, hit is not None
