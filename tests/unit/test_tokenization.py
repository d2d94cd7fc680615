"""Token in, token out with the real SmolLM2 tokenizer: exact sequences, masks, finish-length, constant cost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from rollout_ledger.services.env_worker.tokenization import Drift, Transcript, TurnTemplate
from rollout_ledger.shared.kit.chat import ChatTokenizer


class SpyTokenizer(ChatTokenizer):
    """The real tokenizer, recording the sizes of what it is asked to render and encode."""

    def __init__(self, model_dir: str, chat_template: str | None = None) -> None:
        super().__init__(model_dir, chat_template)
        self.rendered: list[int] = []
        self.encoded: list[int] = []

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        text = super().render(messages, add_generation_prompt, tools)
        self.rendered.append(len(text))
        return text

    def encode(self, text: str) -> np.ndarray:
        self.encoded.append(len(text))
        return super().encode(text)

    def reset_counts(self) -> None:
        self.rendered.clear()
        self.encoded.clear()


@pytest.fixture(scope="module")
def tok(model_dir: str) -> SpyTokenizer:
    return SpyTokenizer(model_dir)


def sample(tok: ChatTokenizer, text: str, eos: bool = True) -> np.ndarray:
    """What an engine could return for ``text`` (ids + end-of-turn when it stopped on eos)."""
    ids = tok.encode(text)
    if eos:
        assert tok.eos_token_id is not None
        ids = np.append(ids, np.int32(tok.eos_token_id))
    return ids.astype(np.int32)


def test_multi_turn_sequence_is_exact_and_mask_is_on_sampled_ids(tok: SpyTokenizer) -> None:
    template = TurnTemplate(tok)
    prompt = [{"role": "user", "content": "Guess a number between 1 and 100."}]
    tr = Transcript(template, prompt)
    assert tok.decode(tr.ids) == tok.render(prompt, add_generation_prompt=True)
    sampled_spans = []
    answers = ["50", "I think 25.", " spaces  and ünïcödé 🎲 ", "37"]
    observations = [[{"role": "user", "content": "lower"}], [{"role": "user", "content": "higher"}],
                    [{"role": "user", "content": "Please reply with a single integer."}], []]
    for i, (answer, obs) in enumerate(zip(answers, observations, strict=True)):
        ids = sample(tok, answer)
        start = len(tr)
        action = tr.add_sampled(ids)
        assert action == answer
        sampled_spans.append((start, start + len(ids)))
        delta = tr.add_observation(obs, final=i == len(answers) - 1)
        assert delta.drift is None
        assert np.array_equal(tr.ids[start:start + len(ids)], ids)  # verbatim
    assert tr.verify()
    conversation = [*prompt]
    for answer, obs in zip(answers, observations, strict=True):
        conversation += [{"role": "assistant", "content": answer}, *obs]
    # the sequence ends with the last sampled ids; the template's closing "\n" is not part of it
    assert tr.closing_text == "\n"
    assert tok.decode(tr.ids) + "\n" == tok.render(conversation)
    assert tr.messages == conversation
    assert tr.ids[-1] == tok.eos_token_id and tr.mask[-1] == 1
    expected_mask = np.zeros(len(tr), dtype=np.int8)
    for a, b in sampled_spans:
        expected_mask[a:b] = 1
    assert np.array_equal(tr.mask, expected_mask)


def test_sampled_ids_are_never_re_encoded(tok: SpyTokenizer) -> None:
    """A non-canonical tokenisation (one id per character) survives exactly; decode still matches the render."""
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "Spell hello."}])
    odd = np.asarray([tok.tokenizer.token_to_id(c) for c in "hello"] + [tok.eos_token_id], dtype=np.int32)
    assert not np.array_equal(odd[:-1], tok.encode("hello"))
    start = len(tr)
    tr.add_sampled(odd)
    tr.add_observation([{"role": "user", "content": "again"}], final=False)
    assert np.array_equal(tr.ids[start:start + len(odd)], odd)
    assert tr.verify()


def test_finish_length_delta_carries_end_of_turn(tok: SpyTokenizer) -> None:
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "Count to ten."}])
    cut = sample(tok, "one two three", eos=False)
    tr.add_sampled(cut)
    delta = tr.add_observation([{"role": "user", "content": "go on"}], final=False)
    assert delta.text.startswith("<|im_end|>")
    assert int(delta.ids[0]) == tok.eos_token_id
    assert delta.text == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    tr.add_sampled(sample(tok, "four five six", eos=False))
    final = tr.add_observation([{"role": "user", "content": "dropped: the episode ends"}], final=True)
    assert final.text == "" and len(final.ids) == 0
    assert tr.closing_text == "<|im_end|>\n"
    assert tr.messages[-1] == {"role": "assistant", "content": "four five six"}
    assert tr.verify()
    assert int(tr.mask.sum()) == len(cut) + len(sample(tok, "four five six", eos=False))


def test_stop_on_eos_delta_has_no_second_end_of_turn(tok: SpyTokenizer) -> None:
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "Hi"}])
    tr.add_sampled(sample(tok, "Hello!"))
    delta = tr.add_observation([{"role": "user", "content": "bye"}], final=False)
    assert delta.text == "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
    assert tr.verify()


def test_per_turn_cost_is_constant(tok: SpyTokenizer) -> None:
    """Turn 40 hands the tokenizer exactly as much text as turn 1: nothing grows with the history."""
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "Let us talk for a long time."}])
    costs = []
    for _ in range(40):
        tok.reset_counts()
        tr.add_sampled(sample(tok, "A fixed answer of some length."))
        tr.add_observation([{"role": "user", "content": "Continue, please."}], final=False)
        costs.append((tuple(tok.rendered), tuple(tok.encoded)))
    # The sample() helper's own encode is the first entry; the rest is the transcript's work.
    assert costs[0] == costs[39]
    assert sum(costs[39][0]) < 400
    assert len(tr) > 40 * 15
    assert tr.verify()


REASONING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A reasoning-model style template: earlier turns are rendered without their thinking (history rewritten)."""


def _segment_text(tok: ChatTokenizer, tr: Transcript, k: int) -> str:
    a, b = tr.segments[k]
    return tok.decode(tr.ids[a:b], skip_special_tokens=False)


def test_drift_starts_a_new_segment(tok: SpyTokenizer, model_dir: str) -> None:
    """A template that trims assistant content does not extend the sampled text: the turn's ids stay verbatim and
    the next context is the template's re-rendering of the whole conversation, as a new segment (mask 0)."""
    trimming = tok.template_source.replace("message['content']", "message['content'] | trim")
    reference = ChatTokenizer(model_dir, chat_template=trimming)
    prompt = [{"role": "user", "content": "x"}]
    tr = Transcript(TurnTemplate(reference), prompt)
    ids = sample(tok, "  padded answer  ")
    start = len(tr)
    tr.add_sampled(ids)
    delta = tr.add_observation([{"role": "user", "content": "ok"}], final=False)
    assert delta.drift == Drift.ASSISTANT_RENDER and delta.new_segment
    assert tr.drifts == [(0, Drift.ASSISTANT_RENDER)]
    assert np.array_equal(tr.ids[start:start + len(ids)], ids)  # the sampled ids stay verbatim
    conversation = [*prompt, {"role": "assistant", "content": "  padded answer  "}, {"role": "user", "content": "ok"}]
    rendered = reference.render(conversation, add_generation_prompt=True)
    assert "padded answer<|im_end|>" in rendered  # trimmed by the template
    assert tr.segments == [[0, start + len(ids)], [start + len(ids), len(tr)]]
    assert np.array_equal(tr.context, reference.encode(rendered))
    assert delta.ids.tolist() == tr.context.tolist() and tr.context_len == len(delta.ids)
    assert not tr.mask[start + len(ids):].any()
    # The next turn extends the new segment without drift (its own rendering is already trimmed).
    tr.add_sampled(sample(tok, "done"))
    final = tr.add_observation([], final=True)
    assert final.drift is None and not final.new_segment
    assert tr.check_results() == [True, True] and tr.verify()
    assert _segment_text(tok, tr, 1) + tr.closing_text == reference.render(
        [*conversation, {"role": "assistant", "content": "done"}])


def test_reasoning_template_rewrites_history_into_segments(tok: SpyTokenizer, model_dir: str) -> None:
    """Earlier thinking is dropped by the template: every turn after the first starts a segment whose context has
    no earlier thinking, each segment decodes to its rendering, and the mask is 1 exactly on sampled ids."""
    reference = ChatTokenizer(model_dir, chat_template=REASONING)
    tr = Transcript(TurnTemplate(reference), [{"role": "user", "content": "What is 2 + 2?"}])
    sampled: list[np.ndarray] = []
    for t, answer in enumerate(["<think>2 and 2</think>4", "<think>again</think>Still 4", "<think>last</think>4!"]):
        ids = sample(tok, answer)
        sampled.append(ids)
        tr.add_sampled(ids)
        final = t == 2
        delta = tr.add_observation([] if final else [{"role": "user", "content": "Sure?"}], final=final)
        assert delta.new_segment is (not final)
        assert (delta.drift is None) is final
    assert [t for t, _ in tr.drifts] == [0, 1]
    assert len(tr.segments) == 3
    assert "<think>2 and 2</think>" not in _segment_text(tok, tr, 1)
    assert "<think>last</think>4!" in _segment_text(tok, tr, 2)
    assert tr.check_results() == [True, True, True]
    mask_ids = tr.ids[tr.mask.astype(bool)]
    assert mask_ids.tolist() == np.concatenate(sampled).tolist()


def test_restart_and_window_segments(tok: SpyTokenizer) -> None:
    """A caller that rewrites the conversation (an agent) or a context window starts a segment per re-render."""
    tr = Transcript(TurnTemplate(tok), [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}])
    tr.add_sampled(sample(tok, "first"))
    rewritten = [{"role": "system", "content": "s"}, {"role": "user", "content": "a, rephrased"}]
    delta = tr.restart(rewritten)
    assert delta.new_segment and delta.drift == Drift.HISTORY_REWRITE
    assert tok.decode(tr.context) == tok.render(rewritten, add_generation_prompt=True)
    assert tr.messages == rewritten
    tr.add_sampled(sample(tok, "second"))
    window = [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]
    delta = tr.add_observation([{"role": "user", "content": "b"}], final=False, window=window)
    assert delta.new_segment and delta.drift == Drift.WINDOW
    assert tok.decode(tr.context) == tok.render(window, add_generation_prompt=True)
    assert tr.messages[-1] == {"role": "user", "content": "b"} and len(tr.messages) == 4
    tr.add_sampled(sample(tok, "third"))
    tr.add_observation([], final=True)
    assert len(tr.segments) == 3 and tr.verify()
    assert [d for _, d in tr.drifts] == [Drift.HISTORY_REWRITE, Drift.WINDOW]


def test_verify_catches_ids_that_do_not_decode_to_the_rendering(tok: SpyTokenizer) -> None:
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "x"}])
    tr.add_sampled(sample(tok, "fine"))
    tr.add_observation([], final=True)
    assert tr.verify()
    tr._ids[1] = tok.encode(" corrupted")[0]  # a prompt id that is not the template's
    assert not tr.verify() and tr.check_results() == [False]


def test_ids_view_is_stable_across_appends(tok: SpyTokenizer) -> None:
    tr = Transcript(TurnTemplate(tok), [{"role": "user", "content": "x"}])
    before = tr.ids
    snapshot = before.copy()
    for _ in range(30):
        tr.add_sampled(sample(tok, "some words " * 5))
        tr.add_observation([{"role": "user", "content": "more"}], final=False)
    assert np.array_equal(before, snapshot)
    assert not before.flags.writeable
