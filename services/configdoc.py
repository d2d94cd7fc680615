"""Generates docs/configuration.md from the settings classes (their field docstrings are the documentation)."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic.fields import FieldInfo

from rollout_ledger.shared.settings import BaseServiceSettings

SETTINGS = {
    "scheduler": "rollout_ledger.services.scheduler.settings:SchedulerSettings",
    "env-worker": "rollout_ledger.services.env_worker.settings:EnvWorkerSettings",
    "inference-worker": "rollout_ledger.services.inference_worker.settings:InferenceSettings",
    "recorder": "rollout_ledger.services.recorder.settings:RecorderSettings",
    "exporter": "rollout_ledger.services.exporter.settings:ExporterSettings",
}


def _load(path: str) -> type[BaseServiceSettings]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def env_name(name: str, info: FieldInfo) -> str:
    alias: Any = info.validation_alias
    if alias is not None and hasattr(alias, "choices"):
        return " / ".join(str(c) for c in alias.choices)
    return f"ROLLOUT_{name.upper()}"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed)"
    value = info.default
    return f"`{value!r}`" if value not in ("", None) else "—"


def _table(fields: dict[str, FieldInfo], skip: set[str]) -> list[str]:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, info in fields.items():
        if name in skip:
            continue
        doc = " ".join((info.description or "").split()).replace("|", "\\|")
        lines.append(f"| `{env_name(name, info)}` | {_default(info)} | {doc} |")
    return lines


def render() -> str:
    base = BaseServiceSettings.model_fields
    out = [
        "# Configuration",
        "",
        "Every service reads its settings from environment variables, once, at start. This file is generated",
        "from the settings classes (`python -m rollout_ledger.services.configdoc > docs/configuration.md`;",
        "a test fails when it is out of date).",
        "",
        "## Every service",
        "",
        *_table(dict(base), set()),
    ]
    for service, path in SETTINGS.items():
        cls = _load(path)
        out += ["", f"## {service} (`{cls.__name__}`)", ""]
        out += _table(dict(cls.model_fields), set(base))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
