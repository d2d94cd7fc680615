"""Token in, token out: an episode's exact token sequence, built from verbatim sampled ids and template deltas.

Design note. Re-tokenising a whole conversation after every turn is wrong twice: it costs O(history) per
turn, and the chat template or BPE merges may turn the sampled ids into different ids (the trainer would
then learn from tokens the policy never sampled). So:

- the prompt is rendered once (``add_generation_prompt=True``) and encoded once;
- sampled ids are appended verbatim (mask 1) and never re-encoded;
- after each step only the NEW text is encoded (mask 0): the text the chat template puts after the sampled
  turn. It is found by rendering a small fixed conversation, ``ANCHOR + [assistant(action)] + observation``
  (plus the generation prompt unless the episode ends), and cutting off the anchor's rendering with its
  generation prompt and the sampled text. When the sampled ids did not end with the end-of-turn token
  (finish ``length`` or a stop string) the delta therefore starts with the template's end-of-turn token(s).
  The per-turn cost depends on the sizes of the action and the observation, never on the history;
- the episode's last turn appends nothing: the sequence ends with the last sampled ids (the environment's
  final observation conditions no action, so it is not part of the trajectory, and trainers expect the last
  action span to end the sequence). The template's closing text after that turn (``"\n"`` after an eos, or
  the end-of-turn token(s) after a cut turn) is kept as ``closing_text``;
- at the end, ``verify`` checks once that decode(all ids) + ``closing_text`` equals the rendering of the whole
  conversation (without the final observation);
- when a turn's rendering does not extend the context (a template that rewrites past turns, as reasoning
  templates drop earlier thinking, or drops special tokens the model emitted) the turn's sampled ids are kept
  verbatim and the NEXT context is re-rendered from the whole conversation: a new **segment** starts with
  those ids (mask 0) and the step carries the drift class (see ``Drift``). ``restart`` does the same for a
  caller that rewrites the conversation itself (an agent editing its history, a sliding context window). Each
  segment is a context the policy really saw, so a trainer trains on each as its own sample; the cost of a
  re-render is paid only on the turns that need it;
- ``verify`` checks every segment: decode(its ids) equals the rendering of its conversation (for a segment
  that a re-render closed: the rendering before its last turn plus that turn's sampled text, since the
  template no longer renders that text the way it was sampled);
- an environment with tools gets ``TurnTemplate.with_tools``: every rendering (prompt, deltas, ``verify``)
  passes the tool schemas, and a model whose own template has no tools section (SmolLM2) renders with the
  tool-aware ChatML template shipped in ``templates/chatml_tools.jinja`` (prefix-stable: each message renders
  on its own, so the deltas stay exact across ``tool`` turns).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import numpy as np

from rollout_ledger.shared.errors import TokenizationError
from rollout_ledger.shared.kit.chat import ChatTokenizer

Message = dict[str, Any]

_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False

_ANCHORS: tuple[tuple[Message, ...], ...] = (
    ({"role": "system", "content": "anchor"}, {"role": "user", "content": "anchor"}),
    ({"role": "user", "content": "anchor"},),
)
"""Constant context rendered before the turn, so the template sees a well-formed conversation (first that renders)."""

TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
"""ChatML with a Hermes ``<tools>`` system block, for ChatML models whose own template has no tools section."""
_MAX_TOOL_TEMPLATES = 32


class Drift(enum.StrEnum):
    """Why a turn's rendering did not extend the context token-exactly."""

    ANCHOR_PREFIX = "anchor_prefix"
    """The template rendered the constant context differently once an assistant turn followed it."""
    ASSISTANT_RENDER = "assistant_render"
    """The template's rendering of the assistant turn is not the sampled text (trimmed, rewritten, specials)."""
    HISTORY_REWRITE = "history_rewrite"
    """The caller's conversation is not the previous one plus the sampled turn (an agent edited its history)."""
    WINDOW = "window"
    """A context policy re-rendered the conversation from a window of it (system + last turns)."""


@dataclass(frozen=True)
class Delta:
    """The template text appended after one sampled turn, and its ids (all mask 0)."""

    text: str
    ids: np.ndarray
    drift: Drift | None = None
    rendered_chars: int = 0
    """Characters of the small conversation rendered to find the delta (its cost; constant per turn)."""
    new_segment: bool = False
    """``ids`` is the whole re-rendered context of the next turn, the start of a new segment."""


class TurnTemplate:
    """The chat-template arithmetic of one tokenizer: the prompt, and the delta after a sampled turn."""

    def __init__(self, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        """Tool schemas every rendering passes to the template (None: no tools)."""
        self.eos_token_id = tokenizer.eos_token_id
        self._tools_tokenizer: ChatTokenizer | None = None
        self._with_tools: dict[str, TurnTemplate] = {}
        self.anchor: list[Message] = []
        self.anchor_prefix = ""
        last: Exception | None = None
        for anchor in _ANCHORS:
            try:
                self.anchor_prefix = tokenizer.render(list(anchor), add_generation_prompt=True, tools=self.tools)
                self.anchor = list(anchor)
                break
            except jinja2.TemplateError as exc:
                last = exc
        else:
            raise TokenizationError(f"the chat template renders none of the anchor conversations: {last}")

    def with_tools(self, tools: list[dict[str, Any]] | None) -> TurnTemplate:
        """This template rendering ``tools`` (itself when there are none); cached per distinct tool list.

        The model's own template is used when it renders tools; a ChatML template without a tools section is
        replaced by ``TOOLS_TEMPLATE``; any other raises ``TokenizationError``.
        """
        if not tools:
            return self
        key = json.dumps(tools, sort_keys=True, default=str)
        cached = self._with_tools.get(key)
        if cached is None:
            if len(self._with_tools) >= _MAX_TOOL_TEMPLATES:
                self._with_tools.clear()
            cached = self._with_tools[key] = TurnTemplate(self._tool_tokenizer(), tools)
        return cached

    def _tool_tokenizer(self) -> ChatTokenizer:
        if renders_tools(self.tokenizer.template_source):
            return self.tokenizer
        if "<|im_start|>" not in self.tokenizer.template_source:
            raise TokenizationError("the model's chat template has no tools section and is not ChatML: "
                                    "no tool-aware template for it")
        if self._tools_tokenizer is None:
            self._tools_tokenizer = ChatTokenizer(self.tokenizer.model_dir, chat_template=TOOLS_TEMPLATE.read_text())
        return self._tools_tokenizer

    def prompt(self, messages: Sequence[Message]) -> tuple[str, np.ndarray]:
        """Rendered initial messages with the generation prompt, and their ids."""
        text = self._render(messages, add_generation_prompt=True)
        return text, self.tokenizer.encode(text)

    def delta(self, sampled_text: str, action: str, observation: Sequence[Message], final: bool) -> Delta:
        """Ids of the text after ``sampled_text`` when ``observation`` follows the assistant's ``action``.

        ``final``: no generation prompt (the episode ends after this turn).
        """
        turn: list[Message] = [*self.anchor, {"role": "assistant", "content": action}, *observation]
        rendered = self._render(turn, add_generation_prompt=not final)
        cost = len(rendered)
        drift: Drift | None = None
        if rendered.startswith(self.anchor_prefix) and rendered.startswith(sampled_text, len(self.anchor_prefix)):
            text = rendered[len(self.anchor_prefix) + len(sampled_text):]
        else:
            drift = Drift.ASSISTANT_RENDER if rendered.startswith(self.anchor_prefix) else Drift.ANCHOR_PREFIX
            closed = self._render([*self.anchor, {"role": "assistant", "content": action}], add_generation_prompt=False)
            cost += len(closed)
            text = rendered[_common_prefix_len(closed, rendered):]
        return Delta(text=text, ids=self.tokenizer.encode(text), drift=drift, rendered_chars=cost)

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.render(messages, add_generation_prompt=add_generation_prompt, tools=self.tools)
        except (jinja2.TemplateError, TypeError, KeyError) as exc:
            raise TokenizationError(f"chat template cannot render the messages: {type(exc).__name__}: {exc}") from exc


def renders_tools(template_source: str) -> bool:
    """Whether a chat template uses the ``tools`` variable."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template_source))
    except jinja2.TemplateError:  # a syntax this parser lacks: fall back to the word
        return re.search(r"\btools\b", template_source) is not None


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Transcript:
    """One episode's token sequence (prompt, sampled turns, deltas) with its loss mask, segments and messages."""

    def __init__(self, template: TurnTemplate, messages: Sequence[Message]) -> None:
        self.template = template
        self.tokenizer = template.tokenizer
        self.messages: list[Message] = list(messages)
        """The whole conversation (what a re-render after a drift renders)."""
        self.prompt_text, self.prompt_ids = template.prompt(self.messages)
        self._ids = np.zeros(max(256, 2 * len(self.prompt_ids)), dtype=np.int32)
        self._mask = np.zeros_like(self._ids, dtype=np.int8)
        self._len = 0
        self.ends_with_generation_prompt = True
        self.closing_text = ""
        """Template text after the last sampled turn, not part of the sequence (see the module docstring)."""
        self.drifts: list[tuple[int, Drift]] = []
        """(turn index, drift class) of every turn whose rendering did not extend the context."""
        self.segment_starts: list[int] = [0]
        self.segment_checks: list[bool] = []
        """decode == render of each closed segment (the open one is checked by ``verify``)."""
        self._segment_messages: list[Message] = self.messages
        """The conversation the open segment renders (the same list as ``messages`` until a window)."""
        self._pending: tuple[str, str] | None = None
        self._turns = 0
        self._final_drift = False
        self._last_turn_start = 0
        self._append(self.prompt_ids, 0)

    def __len__(self) -> int:
        return self._len

    @property
    def ids(self) -> np.ndarray:
        """The whole sequence so far (a read-only view; later appends do not change it)."""
        view = self._ids[: self._len]
        view.flags.writeable = False
        return view

    @property
    def mask(self) -> np.ndarray:
        """1 on sampled ids, 0 elsewhere (same length as ``ids``)."""
        view = self._mask[: self._len]
        view.flags.writeable = False
        return view

    @property
    def segments(self) -> list[list[int]]:
        """``[start, end)`` of each segment; they cover ``ids`` in order."""
        ends = [*self.segment_starts[1:], self._len]
        return [[a, b] for a, b in zip(self.segment_starts, ends, strict=True)]

    @property
    def context_len(self) -> int:
        """Length of the open segment: the context the next turn is generated from."""
        return self._len - self.segment_starts[-1]

    @property
    def context(self) -> np.ndarray:
        """The open segment's ids: what the engine sees for the next turn."""
        return self.ids[self.segment_starts[-1]:]

    def add_sampled(self, token_ids: np.ndarray) -> str:
        """Append a turn's sampled ids verbatim (mask 1); return the action text (special tokens skipped)."""
        if self._pending is not None:
            raise TokenizationError("add_sampled() twice without add_observation() between")
        sampled_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        action = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self._pending = (sampled_text, action)
        self._append(token_ids, 1)
        return action

    def add_observation(self, observation: Sequence[Message], final: bool,
                        window: Sequence[Message] | None = None) -> Delta:
        """Append the template text after the pending turn: ``observation`` and the generation prompt.

        ``final``: the episode ends with this turn; nothing is appended (the returned delta is empty and
        ``observation`` is dropped) and the template's closing text is kept in ``closing_text``.
        When the template does not extend the context token-exactly, the whole conversation is re-rendered as a
        new segment instead (``Delta.new_segment``). ``window``: a context policy's view of the conversation
        after this observation; the next context is re-rendered from it (a new segment, drift ``window``).
        """
        if self._pending is None:
            raise TokenizationError("add_observation() without a sampled turn before it")
        sampled_text, action = self._pending
        assistant = {"role": "assistant", "content": action}
        turn = self._turns
        if final:
            closing = self.template.delta(sampled_text, action, (), final=True)
            self._close_turn(assistant, ())
            self.closing_text = closing.text
            self.ends_with_generation_prompt = False
            self._final_drift = closing.drift is not None
            if closing.drift is not None:
                self.drifts.append((turn, closing.drift))
            return Delta(text="", ids=_EMPTY, drift=closing.drift, rendered_chars=closing.rendered_chars)
        delta = self.template.delta(sampled_text, action, observation, final=False)
        if delta.drift is None and window is None:
            self._close_turn(assistant, observation)
            self._append(delta.ids, 0)
            return delta
        drift = delta.drift or Drift.WINDOW
        self._check_closing_segment()
        self._close_turn(assistant, observation)
        target = list(window) if window is not None else self.messages
        segment = self._start_segment(target, drift, turn)
        return Delta(text=segment.text, ids=segment.ids, drift=drift,
                     rendered_chars=delta.rendered_chars + segment.rendered_chars, new_segment=True)

    def restart(self, messages: Sequence[Message], drift: Drift = Drift.HISTORY_REWRITE,
                template: TurnTemplate | None = None) -> Delta:
        """The pending turn is followed by ``messages``, a conversation the caller rewrote (it does not extend the
        previous one plus the sampled turn): re-render it with the generation prompt as a new segment.
        ``template``: render the new segment (and what follows) with it, e.g. other tools (the closing segment is
        still checked with the template it was rendered with)."""
        if self._pending is None:
            raise TokenizationError("restart() without a sampled turn before it")
        turn = self._turns
        self._check_closing_segment()
        if template is not None:
            self.template, self.tokenizer = template, template.tokenizer
        self._pending = None
        self._turns += 1
        self.messages = list(messages)
        return self._start_segment(self.messages, drift, turn)

    def verify(self) -> bool:
        """Every segment decodes to its conversation's rendering (once per episode; see the module docstring)."""
        return all(self.segment_checks) and self._check_open_segment()

    def check_results(self) -> list[bool]:
        """``verify`` per segment, in order."""
        return [*self.segment_checks, self._check_open_segment()]

    # --- internals ------------------------------------------------------------------------------------
    def _close_turn(self, assistant: Message, observation: Sequence[Message]) -> None:
        self._pending = None
        self._turns += 1
        self.messages.append(assistant)
        self.messages.extend(observation)
        if self._segment_messages is not self.messages:
            self._segment_messages.append(assistant)
            self._segment_messages.extend(observation)

    def _check_closing_segment(self) -> None:
        """Record decode == render for the segment a re-render is about to close (its last turn is pending):
        the rendering of its conversation before that turn, plus the turn's sampled text."""
        assert self._pending is not None
        self.segment_checks.append(self._segment_matches(self._segment_messages, add_generation_prompt=True,
                                                         sampled_tail=self._pending[0]))

    def _check_open_segment(self) -> bool:
        if self._pending is not None:
            return False
        messages = self._segment_messages
        if self._final_drift:
            # The template renders the last turn differently from its sampled text: the segment is the
            # rendering before that turn plus the turn's sampled text.
            last = self._ids[self._last_turn_start: self._len]
            return self._segment_matches(messages[:-1], add_generation_prompt=True,
                                         sampled_tail=self.tokenizer.decode(last, skip_special_tokens=False))
        return self._segment_matches(messages, add_generation_prompt=self.ends_with_generation_prompt,
                                     closing_text=self.closing_text)

    def _segment_matches(self, messages: Sequence[Message], add_generation_prompt: bool, *,
                         sampled_tail: str = "", closing_text: str = "") -> bool:
        """decode(open segment's ids) + ``closing_text`` == render(``messages``) + ``sampled_tail``; False when the
        template cannot render ``messages``."""
        try:
            rendered = self._render(messages, add_generation_prompt=add_generation_prompt)
        except TokenizationError:
            return False
        start = self.segment_starts[-1]
        decoded = self.tokenizer.decode(self._ids[start: self._len], skip_special_tokens=False)
        return decoded + closing_text == rendered + sampled_tail

    def _start_segment(self, messages: list[Message], drift: Drift, turn: int) -> Delta:
        text = self._render(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text)
        self.drifts.append((turn, drift))
        self.segment_starts.append(self._len)
        self._segment_messages = messages
        self._append(ids, 0)
        return Delta(text=text, ids=ids, drift=drift, rendered_chars=len(text), new_segment=True)

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.render(messages, add_generation_prompt=add_generation_prompt,
                                         tools=self.template.tools)
        except (jinja2.TemplateError, TypeError, KeyError) as exc:
            raise TokenizationError(f"chat template cannot render the messages: {exc}") from exc

    def _append(self, ids: np.ndarray, mask: int) -> None:
        n = len(ids)
        end = self._len + n
        if end > len(self._ids):
            size = max(end, 2 * len(self._ids))
            grown = np.zeros(size, dtype=np.int32)
            grown[: self._len] = self._ids[: self._len]
            grown_mask = np.zeros(size, dtype=np.int8)
            grown_mask[: self._len] = self._mask[: self._len]
            self._ids, self._mask = grown, grown_mask
        if mask:
            self._last_turn_start = self._len
        self._ids[self._len: end] = ids
        self._mask[self._len: end] = mask
        self._len = end
