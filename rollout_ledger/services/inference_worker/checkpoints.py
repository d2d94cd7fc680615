"""Whether a checkpoint may replace the weights an inference worker serves: the same architecture (model type,
layer shapes, vocabulary), the same tokenizer, and weights present and readable.

A trainer's checkpoint is a Hugging Face directory (``config.json``, ``*.safetensors``, optionally the tokenizer
files). A checkpoint that fails here is refused before anything is loaded: the worker keeps serving the version it
has (``WeightsRefused``). Token ids are the contract of the whole system, so a checkpoint with another tokenizer
is refused even when its shapes fit.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from rollout_ledger.shared.errors import InferenceError

SHAPE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
"""``config.json`` fields two checkpoints must agree on for one's weights to load into the other's model."""
TOKENIZER_FILES = ("tokenizer.json",)
"""Tokenizer files compared byte for byte when the checkpoint carries them (a checkpoint without them keeps the
served tokenizer: training does not change it)."""


class WeightsRefused(InferenceError):
    """The checkpoint cannot replace the served weights; nothing was loaded (the worker keeps its version)."""

    retryable = False


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise WeightsRefused(f"{directory} has no config.json") from exc
    except (OSError, ValueError) as exc:
        raise WeightsRefused(f"{path} is unreadable: {exc}") from exc
    return config


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files, each with a readable header; ``WeightsRefused`` otherwise."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise WeightsRefused(f"{checkpoint} has no *.safetensors weights")
    for path in files:
        try:
            with path.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size <= 0 or size > 100 * 1024 * 1024:
                    raise ValueError(f"header of {size} bytes")
                header = json.loads(fh.read(size))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (OSError, ValueError, struct.error) as exc:
            raise WeightsRefused(f"{path} is not a readable safetensors file: {exc}") from exc
    return files


def check_compatible(serving: str | Path, checkpoint: str | Path) -> None:
    """Raise ``WeightsRefused`` naming the first difference unless ``checkpoint`` can replace ``serving``."""
    served, new = Path(serving), Path(checkpoint)
    if not new.is_dir():
        raise WeightsRefused(f"checkpoint {new} is not a directory this worker can read")
    ours, theirs = _config(served), _config(new)
    for key in SHAPE_KEYS:
        if ours.get(key) != theirs.get(key):
            raise WeightsRefused(f"checkpoint {new} has another architecture: {key} is {theirs.get(key)!r}, "
                                 f"the served model's is {ours.get(key)!r}")
    for name in TOKENIZER_FILES:
        if (new / name).is_file() and (served / name).is_file() and _digest(new / name) != _digest(served / name):
            raise WeightsRefused(f"checkpoint {new} has another tokenizer ({name} differs): token ids would "
                                 "not mean the same")
    weight_files(new)
