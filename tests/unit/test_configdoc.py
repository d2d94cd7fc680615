"""docs/configuration.md is generated from the settings classes and must match them."""

from __future__ import annotations

from pathlib import Path

from rollout_ledger.cli.configdoc import render
from rollout_ledger.services import catalog

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_doc_is_current() -> None:
    assert DOC.read_text() == render(), "python -m rollout_ledger.cli.configdoc > docs/configuration.md"


def test_every_setting_is_documented() -> None:
    for cls in catalog.settings_classes().values():
        undocumented = [name for name, info in cls.model_fields.items() if not (info.description or "").strip()]
        assert undocumented == [], f"{cls.__name__}: add a docstring under {undocumented}"


def test_every_service_has_its_settings_documented() -> None:
    documented = catalog.settings_classes()
    assert set(catalog.SERVICES) <= set(documented), "every service's settings class gets a section"
