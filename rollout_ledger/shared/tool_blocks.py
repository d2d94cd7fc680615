"""Where the ``<tool_call>`` blocks of a turn's text are: the one scanner, shared by the env library's tool parsing
(services/envs/tools.py), the agent session endpoint and the scheduler's trajectory viewer.

Only the block boundaries; what a block means (its JSON call, the errors of a malformed one) is the env library's.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolBlock:
    """One ``<tool_call>`` block of a text, as ``scan_blocks`` found it."""

    start: int
    """Offset of its ``<tool_call>``."""
    end: int
    """Offset just past its ``</tool_call>`` (the text's length for an unclosed block)."""
    body: str
    """The text between the tags (to the end of the text for an unclosed block)."""
    closed: bool
    """Whether a ``</tool_call>`` ends it (only the last block of a text may be unclosed)."""


def scan_blocks(text: str) -> tuple[list[ToolBlock], list[str]]:
    """The ``<tool_call>`` blocks of ``text`` in order (an unclosed last one runs to the end) and the pieces of
    text outside them: one before each block and one after the last (empty after an unclosed block), so there
    is always one piece more than blocks. No block when ``text`` holds no ``<tool_call>``."""
    blocks: list[ToolBlock] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        body_start = start + len(OPEN)
        close = text.find(CLOSE, body_start)
        if close < 0:
            blocks.append(ToolBlock(start=start, end=len(text), body=text[body_start:], closed=False))
            pos = len(text)
            break
        pos = close + len(CLOSE)
        blocks.append(ToolBlock(start=start, end=pos, body=text[body_start:close], closed=True))
    outside.append(text[pos:])
    return blocks, outside
