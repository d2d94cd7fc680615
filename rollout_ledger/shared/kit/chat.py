"""The policy's tokenizer and chat template, loaded from a Hugging Face model directory without transformers.

``tokenizer.json`` goes to the Rust ``tokenizers`` library and the chat template (``chat_template.jinja`` or
the ``chat_template`` of ``tokenizer_config.json``) to jinja2, rendered the way transformers renders it.
Every service that needs token ids (env worker, fake engine, scheduler's decoded views) loads it from here.

Encoding cost (the env worker encodes the template text after every turn): for a byte-level BPE tokenizer
without a normalizer, ``tokenizers`` cuts the text at added tokens and encodes the pieces between them
independently, so ``SegmentEncoder`` does the same cut in Python, looks the chat template's constant pieces
(``"\n"``, ``"assistant\n"``, a default system prompt, found by rendering placeholder conversations) up in a
table, and hands only the other pieces to ``tokenizers``. It is checked against ``tokenizers`` on sample texts
when built and not used when any differs.

Streaming a turn (the session endpoint sends one chunk per sampled id) needs the text each id adds:
``ChatTokenizer.stream_texts`` gets it from ``tokenizers``' ``DecodeStream`` in one pass over the ids (decoding
every prefix of the turn instead costs O(n²)), then compares it once with the whole turn's decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from rollout_ledger.shared.errors import RolloutError


class ModelNotFoundError(RolloutError):
    """The model directory does not exist or lacks a tokenizer."""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTokenizer:
    """Encode, decode and render chat messages for one model."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(
                f"no tokenizer.json in {path}: run `rollout model fetch` (or `make model`), "
                "or point ROLLOUT_MODEL at a Hugging Face model directory"
            )
        self.model_dir = path
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        template = chat_template
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if template is None:
            template = config.get("chat_template")
        if not isinstance(template, str):
            raise ModelNotFoundError(f"no chat template in {path}")
        self.template_source = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        # A template's globals are a ChainMap over the environment's; every render copies them into its context
        # (twice). Nothing changes them after this point, so one flat dict renders the same, ~20% faster.
        self._template.globals = dict(self._template.globals)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self.tokenizer.get_vocab_size()
        self._segments = SegmentEncoder.build(self)
        self._template_texts: frozenset[str] | None = None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text for ``messages``."""
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (special tokens in the text are recognised; nothing is added)."""
        if self._segments is not None:
            return np.asarray(self._segments.encode(text), dtype=np.int32)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        as_list = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        return str(self.tokenizer.decode(as_list, skip_special_tokens=skip_special_tokens))

    def template_texts(self) -> frozenset[str]:
        """The texts the chat template writes between special tokens whatever the messages say: role headers,
        separators, a default system prompt (from renderings of small conversations; computed once)."""
        if self._template_texts is None:
            specials = [str(t.content) for t in self.tokenizer.get_added_tokens_decoder().values() if t.content]
            cut = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) if specials \
                else None
            texts: set[str] = set()
            for text in _placeholder_renders(self, _PLACEHOLDER):
                parts = cut.split(text) if cut is not None else [text]
                texts.update(p for p in parts if p and _PLACEHOLDER not in p)
            self._template_texts = frozenset(texts)
        return self._template_texts

    def stream_texts(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """The text each id adds to ``decode(ids, skip_special_tokens=True)``: one piece per id, in linear time.

        A special token adds ""; an id that leaves a UTF-8 character incomplete adds "" and the id completing it
        carries the character. The pieces always concatenate to exactly that decode: ``DecodeStream`` decodes a
        short window of ids per step, and where its text parts from the whole decode (a decoder rewriting text
        across more ids than the window, a character that never completes) ``_agree`` mends the pieces.
        """
        as_list = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        stream = DecodeStream(skip_special_tokens=True)
        pieces: list[str] = []
        for tid in as_list:
            try:
                piece = stream.step(self.tokenizer, tid)
            except Exception:  # tokenizers' "invalid prefix": the window's text no longer extends what was
                break  # sent; the remaining ids go to the mend
            pieces.append(piece or "")
        pieces.extend("" for _ in range(len(as_list) - len(pieces)))
        return _agree(pieces, self.decode(as_list, skip_special_tokens=True))


_PLACEHOLDER = "PLACEHOLDER"
_SAMPLES = ("", "x", " spaces  and ünïcödé 🎲 ", "\n\n  ", "What is 12 + 7?", "it's   \t done.\n", "a<|im_end|>b")
"""Message contents the segment encoder is checked with (whitespace at the edges, non-ASCII, specials)."""


class SegmentEncoder:
    """Exactly ``tokenizers``' encoding of a text, with the chat template's constant pieces looked up.

    Only built for tokenizers where cutting at added tokens is exact (see the module docstring): no
    normalizer, a ``ByteLevel`` pre-tokenizer without a prefix space, added tokens without strip or
    single-word rules.
    """

    def __init__(self, tokenizer: Tokenizer, added: dict[str, int], constant: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.added = added
        longest_first = sorted(added, key=len, reverse=True)
        self.pattern = re.compile("|".join(re.escape(t) for t in longest_first))
        self.table: dict[str, list[int]] = {}
        for piece in constant:
            self.table[piece] = self._encode_piece(piece)

    @classmethod
    def build(cls, chat: ChatTokenizer) -> SegmentEncoder | None:
        """The encoder for ``chat``'s tokenizer and template, or None when it would not be exact."""
        config = json.loads(chat.tokenizer.to_str())
        pre = config.get("pre_tokenizer") or {}
        if config.get("normalizer") is not None or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space"):
            return None
        added: dict[str, int] = {}
        for token in config.get("added_tokens") or []:
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word") or not token.get("content"):
                return None
            added[str(token["content"])] = int(token["id"])
        if not added:
            return None
        probe = cls(chat.tokenizer, added, ())
        constant: set[str] = set()
        for text in _placeholder_renders(chat, _PLACEHOLDER):
            constant.update(p for p in probe.pieces(text) if _PLACEHOLDER not in p and p not in added)
        encoder = cls(chat.tokenizer, added, constant)
        for content in _SAMPLES:
            for text in (*_placeholder_renders(chat, content), content):
                if encoder.encode(text) != chat.tokenizer.encode(text, add_special_tokens=False).ids:
                    return None
        return encoder

    def pieces(self, text: str) -> list[str]:
        """``text`` cut before and after every added token."""
        out: list[str] = []
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                out.append(text[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        added, table = self.added, self.table
        for piece in self.pieces(text):
            known = added.get(piece)
            if known is not None:
                ids.append(known)
                continue
            cached = table.get(piece)
            ids.extend(cached if cached is not None else self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        return list(self.tokenizer.encode(piece, add_special_tokens=False).ids)


def _agree(pieces: list[str], full: str) -> list[str]:
    """``pieces`` made to concatenate to ``full``: kept while they spell it, the one where they part cut back to
    what it shares with ``full``, the ones after it emptied, and the rest of ``full`` added to the last piece."""
    if not pieces or "".join(pieces) == full:
        return pieces
    out: list[str] = []
    pos = 0
    for piece in pieces:
        if full.startswith(piece, pos):
            out.append(piece)
            pos += len(piece)
            continue
        rest = full[pos:pos + len(piece)]
        shared = next((k for k, (a, b) in enumerate(zip(piece, rest, strict=False)) if a != b), len(rest))
        out.append(piece[:shared])
        pos += shared
        break
    out.extend("" for _ in range(len(pieces) - len(out)))
    out[-1] += full[pos:]
    return out


def _placeholder_renders(chat: ChatTokenizer, content: str) -> list[str]:
    """Renderings of small conversations whose every message says ``content`` (those the template accepts)."""
    conversations = (
        [("user", "")],
        [("system", ""), ("user", ""), ("assistant", ""), ("user", "")],
        [("user", ""), ("assistant", ""), ("user", ""), ("assistant", "")],
        [("user", ""), ("assistant", ""), ("tool", "")],
    )
    out = []
    for conversation in conversations:
        messages = [{"role": role, "content": content} for role, _ in conversation]
        for gen in (True, False):
            try:
                out.append(ChatTokenizer.render(chat, messages, add_generation_prompt=gen))  # not a subclass's
            except (jinja2.TemplateError, TypeError, KeyError):
                continue
    return out


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


@lru_cache(maxsize=4)
def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    """Cached per process (a tokenizer is immutable and ~10 MB)."""
    return ChatTokenizer(model_dir)
