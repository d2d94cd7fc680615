"""Generates docs/configuration.md from the settings classes (their field docstrings are the documentation)."""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo

from rollout_ledger.services import catalog
from rollout_ledger.shared.kit.settings import BaseServiceSettings


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
        "from the settings classes (`python -m rollout_ledger.cli.configdoc > docs/configuration.md`;",
        "a test fails when it is out of date).",
        "",
        "## Every service",
        "",
        *_table(dict(base), set()),
    ]
    for service, cls in catalog.settings_classes().items():
        out += ["", f"## {service} (`{cls.__name__}`)", ""]
        out += _table(dict(cls.model_fields), set(base))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
