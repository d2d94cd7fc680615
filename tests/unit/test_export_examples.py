"""docs/export.md shows exactly what the record functions produce (its examples are generated, never edited)."""

from __future__ import annotations

from pathlib import Path

from rollout_ledger.services.exporter.examples import BEGIN, END, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def test_docs_examples_are_generated_by_the_code() -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render(), (
        "docs/export.md is out of date: replace its examples block with "
        "`python -m rollout_ledger.services.exporter.examples`")
