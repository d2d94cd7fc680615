"""The viewer's per-token rows: pieces, origins, tool-call folds and the first divergence, on the real tokenizer;
histogram bins; an audit's per-token logprobs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rollout_ledger.services.scheduler.viewer.queries import bin_edges, bin_of, version_label
from rollout_ledger.services.scheduler.viewer.routes import _audit, _resume, _turns
from rollout_ledger.services.scheduler.viewer.tokens import (
    Origin,
    first_divergence,
    special_ids,
    token_origins,
    token_pieces,
    tool_call_folds,
)
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


def _conversation(tok: ChatTokenizer) -> tuple[list[int], list[int], list[list[int]]]:
    """prompt (system + user), a sampled answer with a tool call, the tool's observation, a second answer."""
    prompt = tok.encode(tok.render([{"role": "user", "content": "Cancel order #W1 ünïcödé 🎲"}],
                                   add_generation_prompt=True)).tolist()
    answer = tok.encode('Sure.<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "#W1"}}\n'
                        "</tool_call><|im_end|>").tolist()
    obs = tok.encode("\n<|im_start|>tool\n{\"status\": \"cancelled\"}<|im_end|>\n<|im_start|>assistant\n").tolist()
    second = tok.encode("Done.<|im_end|>").tolist()
    ids = prompt + answer + obs + second
    a0 = [len(prompt), len(prompt) + len(answer)]
    a1 = [a0[1] + len(obs), a0[1] + len(obs) + len(second)]
    mask = [0] * len(ids)
    for start, end in (a0, a1):
        mask[start:end] = [1] * (end - start)
    return ids, mask, [a0, a1]


def test_pieces_show_every_token_and_concatenate_to_the_text(tok: ChatTokenizer) -> None:
    ids, _, _ = _conversation(tok)
    specials = special_ids(tok)
    pieces = token_pieces(tok, ids, specials)
    assert len(pieces) == len(ids)
    assert "".join(p for p, i in zip(pieces, ids, strict=True) if i not in specials) == tok.decode(
        ids, skip_special_tokens=True)
    assert "".join(pieces) == tok.decode(ids)  # specials shown as themselves: the whole sequence, exactly
    assert pieces[0] == "<|im_start|>"


def test_origins_sampled_template_environment(tok: ChatTokenizer) -> None:
    ids, mask, ranges = _conversation(tok)
    specials = special_ids(tok)
    pieces = token_pieces(tok, ids, specials)
    origins = token_origins(pieces, ids, mask, specials, tok.template_texts())
    assert [i for i, o in enumerate(origins) if o == Origin.SAMPLED] == [i for i, m in enumerate(mask) if m]
    # the sampled <|im_end|> stays sampled: what the policy sampled is never the template's
    assert origins[ranges[0][1] - 1] == Origin.SAMPLED and ids[ranges[0][1] - 1] in specials
    text = {o: "".join(p for p, oo in zip(pieces, origins, strict=True) if oo == o) for o in Origin}
    assert "Cancel order #W1 ünïcödé 🎲" in text[Origin.ENVIRONMENT]
    assert '{"status": "cancelled"}' in text[Origin.ENVIRONMENT]
    assert "<|im_start|>user\n" in text[Origin.TEMPLATE] and "<|im_start|>tool\n" in text[Origin.TEMPLATE]
    assert "<|im_start|>assistant\n" in text[Origin.TEMPLATE]
    assert "You are a helpful AI assistant" in text[Origin.TEMPLATE]  # the template's default system prompt
    assert text[Origin.ENVIRONMENT] == 'Cancel order #W1 ünïcödé 🎲{"status": "cancelled"}'  # separators: template
    # without the template's texts, the default system prompt counts as the environment's (all but its header)
    plain = token_origins(pieces, ids, mask, specials)
    assert "You are a helpful AI assistant" in "".join(p for p, o in zip(pieces, plain, strict=True)
                                                       if o == Origin.ENVIRONMENT)


def test_tool_call_folds_cover_the_block(tok: ChatTokenizer) -> None:
    ids, _, ranges = _conversation(tok)
    pieces = token_pieces(tok, ids, special_ids(tok))
    folds = tool_call_folds(pieces, ranges)
    assert len(folds) == 1
    fold = folds[0]
    assert fold.turn_index == 0 and fold.label == 'cancel_order("order_id":"#W1")'
    text = "".join(pieces[fold.start:fold.end])
    # the first token holds the block's opening (a BPE token may carry text before it), the last its closing
    assert text.index("<tool_call>") < len(pieces[fold.start]) and text.endswith("</tool_call>")
    assert ranges[0][0] < fold.start and fold.end < ranges[0][1]


def test_tool_call_folds_label_a_broken_block() -> None:
    pieces = ["a", "<tool", "_call>", "{oops", "</tool_call>", "b", "<tool_call>", "[1]"]
    folds = tool_call_folds(pieces, [[0, 6], [6, 8]])
    assert [(f.start, f.end, f.turn_index, f.label) for f in folds] == [(1, 5, 0, "tool_call"),
                                                                        (6, 8, 1, "tool_call")]


def test_first_divergence() -> None:
    assert first_divergence([]) == 0
    assert first_divergence([[1, 2, 3]]) == 3
    assert first_divergence([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 2
    assert first_divergence([[1, 2], [1, 2, 3]]) == 2
    assert first_divergence([[5], [6]]) == 0


def test_histogram_bins_and_version_labels() -> None:
    edges = bin_edges([0.0, 1.0, 0.5])
    assert len(edges) == 11 and edges[0] == 0.0 and edges[-1] == 1.0
    assert [bin_of(edges, x) for x in (0.0, 0.05, 0.5, 0.99, 1.0)] == [0, 0, 5, 9, 9]
    assert bin_edges([2.0, 2.0]) == pytest.approx([1.5 + 0.1 * i for i in range(11)])
    assert bin_edges([]) == [0.0, 1.0]
    assert version_label(None) == "none" and version_label([3]) == "v3" and version_label([3, 2, 3]) == "v2-3"


def _audit_row(values: list[float] | None) -> dict[str, Any]:
    return {"source": "audit", "checkpoint": "/ckpt/1", "engine": "vllm", "num_tokens": 2, "mean_abs_delta": 0.1,
            "p99_abs_delta": 0.1, "max_abs_delta": 0.1, "created_at": datetime.now(UTC), "token_logprobs": values}


def test_an_audit_is_shown_per_token_only_when_its_values_line_up_with_the_sampled_tokens() -> None:
    kept = _audit(_audit_row([-0.5, float("nan")]), num_sampled=2)
    assert kept.token_logprobs == [-0.5, None] and kept.token_note is None  # NaN: not recomputed
    aggregates = _audit(_audit_row(None), num_sampled=2)
    assert aggregates.token_logprobs is None and aggregates.token_note is None
    short = _audit(_audit_row([-0.5]), num_sampled=2)
    assert short.token_logprobs is None
    assert short.token_note == "1 recomputed logprobs for 2 sampled tokens: not shown per token"


def test_turns_own_one_action_range_per_version_run_and_say_where_they_resumed() -> None:
    """A turn a keep swap carried across versions owns two action ranges (one per version): the viewer shows it as
    one turn with the position where its version changes; a carried-over turn names the step it repeats."""
    detail: dict[str, Any] = {
        "prompt_len": 10, "num_turns": 3,
        "action_ranges": [[10, 14], [16, 19], [19, 25], [27, 30]], "action_versions": [0, 0, 1, 1],
        "turns": [
            {"turn_index": 0, "attempt": 1, "weight_version": 0, "version_runs": None, "num_ids": 4},
            {"turn_index": 1, "attempt": 2, "weight_version": 0, "version_runs": [[0, 0], [3, 1]], "num_ids": 9},
            {"turn_index": 2, "attempt": 2, "weight_version": 1, "version_runs": None, "num_ids": 3},
        ],
        "steps": [
            {"turn_index": t, "observation": "o", "reward": 0.0, "terminated": t == 2, "truncated": False,
             "drift": None, "new_segment": False, "info": {}, "reused_from": "e:a1:s0" if t == 0 else None}
            for t in range(3)],
        "resume": {"mode": "replay", "from_attempt": 1, "turns_recorded": 1, "turns_unstepped": 1, "reason": ""},
    }
    turns = _turns(detail)
    assert [(t.start, t.end, t.weight_version, t.version_changes) for t in turns] == [
        (10, 14, 0, []), (16, 25, 0, [[19, 1]]), (27, 30, 1, [])]
    assert [t.reused_from for t in turns] == ["e:a1:s0", None, None] and turns[0].attempt == 1
    resume = _resume(detail)
    assert resume is not None and (resume.mode, resume.turns_reused, resume.from_attempt) == ("replay", 1, 1)
    assert _resume({**detail, "resume": None}) is None
