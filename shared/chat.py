"""The policy's tokenizer and chat template, loaded from a Hugging Face model directory without transformers.

``tokenizer.json`` goes to the Rust ``tokenizers`` library and the chat template (``chat_template.jinja`` or
the ``chat_template`` of ``tokenizer_config.json``) to jinja2, rendered the way transformers renders it.
Every service that needs token ids (env worker, fake engine, scheduler's decoded views) loads it from here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

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
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self.tokenizer.get_vocab_size()

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
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


@lru_cache(maxsize=4)
def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    """Cached per process (a tokenizer is immutable and ~10 MB)."""
    return ChatTokenizer(model_dir)
