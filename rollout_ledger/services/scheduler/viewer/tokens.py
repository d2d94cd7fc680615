"""Per-token rows of a trajectory for the viewer: each token's text and origin, tool-call folds, first divergence.

Pure functions over the stored arrays; no token is re-encoded. A token's *origin* says what put it in the sequence:

- ``sampled``: the policy sampled it (inside an action range; loss mask 1);
- ``template``: the chat template inserted it: a special token (``<|im_start|>``, ``<|im_end|>``, ...) outside
  the sampled spans, the role header after a special token up to its newline (``assistant\\n``), and text the
  template writes whatever the messages say (a default system prompt, separators: ``template_texts``);
- ``environment``: every other token: the task's prompt text, observations, tool results, re-rendered context.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.tool_blocks import scan_blocks


class Origin(IntEnum):
    """What put a token in the sequence (the viewer's colours; the JSON carries the numbers)."""

    SAMPLED = 0
    ENVIRONMENT = 1
    TEMPLATE = 2


@dataclass(frozen=True)
class Fold:
    """Tokens ``[start, end)`` of one ``<tool_call>`` block in a sampled span, folded in the viewer."""

    start: int
    end: int
    turn_index: int
    label: str
    """``name(arguments)``, shortened; ``tool_call`` when the block is not a JSON object."""


def special_ids(tokenizer: ChatTokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (what the chat template inserts)."""
    decoder = tokenizer.tokenizer.get_added_tokens_decoder()
    return frozenset(int(i) for i, tok in decoder.items() if getattr(tok, "special", False))


def token_pieces(tokenizer: ChatTokenizer, token_ids: Sequence[int], specials: frozenset[int]) -> list[str]:
    """The text of each token: what it adds to the decoded sequence; a special token shows as itself.

    Built from ``stream_texts`` (exact, linear time): the pieces of the non-special tokens concatenate to the
    decode. A token that leaves a UTF-8 character incomplete shows as "" and the one completing it carries it.
    """
    pieces = tokenizer.stream_texts(token_ids)
    for i, tid in enumerate(token_ids):
        if int(tid) in specials:
            pieces[i] = tokenizer.tokenizer.id_to_token(int(tid)) or ""
    return pieces


def token_origins(pieces: Sequence[str], token_ids: Sequence[int], loss_mask: Sequence[int],
                  specials: frozenset[int], template_texts: frozenset[str] = frozenset()) -> list[int]:
    """The ``Origin`` of every token (see the module docstring).

    Between two special tokens (or a special token and a sampled one), a run of tokens whose text is one the
    template always writes (``template_texts``: a default system prompt, a separator) is the template's; in
    any other run, the role header after a special token (up to its first newline) is.
    """
    origins = [int(Origin.SAMPLED) if m else int(Origin.ENVIRONMENT) for m in loss_mask]
    run: list[int] = []
    after_special = False

    def close() -> None:
        if not run:
            return
        if "".join(pieces[i] for i in run) in template_texts:
            for i in run:
                origins[i] = Origin.TEMPLATE
        elif after_special:
            for i in run:
                origins[i] = Origin.TEMPLATE
                if "\n" in pieces[i]:
                    break
        run.clear()

    for i, (tid, mask) in enumerate(zip(token_ids, loss_mask, strict=True)):
        if mask:
            close()
            after_special = False
        elif int(tid) in specials:
            close()
            origins[i] = Origin.TEMPLATE
            after_special = True
        else:
            run.append(i)
    close()
    return origins


def _label(body: str) -> str:
    try:
        call = json.loads(body)
    except ValueError:
        return "tool_call"
    if not isinstance(call, dict):
        return "tool_call"
    name = str(call.get("name", "?"))
    args = json.dumps(call.get("arguments", {}), ensure_ascii=False, separators=(",", ":"))
    text = f"{name}({args[1:-1] if args.startswith('{') else args})"
    return text if len(text) <= 80 else text[:77] + "..."


def tool_call_folds(pieces: Sequence[str], action_ranges: Sequence[Sequence[int]]) -> list[Fold]:
    """The ``<tool_call>`` blocks of each sampled span, as token ranges (a token is in a block when any of its
    characters is)."""
    folds: list[Fold] = []
    for turn, (start, end) in enumerate(action_ranges):
        start, end = int(start), min(int(end), len(pieces))
        offsets = [0]
        for piece in pieces[start:end]:
            offsets.append(offsets[-1] + len(piece))
        text = "".join(pieces[start:end])
        blocks, _ = scan_blocks(text)
        for block in blocks:
            first = next(i for i in range(end - start) if offsets[i + 1] > block.start)
            last = next((i for i in range(first, end - start) if offsets[i + 1] >= block.end), end - start - 1)
            folds.append(Fold(start + first, start + last + 1, turn, _label(block.body.strip())))
    return folds


def first_divergence(sequences: Sequence[Sequence[int]]) -> int:
    """The first position at which the sequences do not all hold the same token (the length of their common
    prefix); the shortest length when one is a prefix of all others; 0 for no sequences."""
    if not sequences:
        return 0
    shortest = min(len(s) for s in sequences)
    head = sequences[0]
    for i in range(shortest):
        tid = head[i]
        if any(s[i] != tid for s in sequences[1:]):
            return i
    return shortest
