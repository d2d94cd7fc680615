"""`make test` runs every test: its two pytest processes together cover pyproject's testpaths, each once."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make_list(name: str) -> list[str]:
    match = re.search(rf"^{name} := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"no {name} in the Makefile"
    return match.group(1).split()


def test_the_two_processes_partition_the_testpaths() -> None:
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    slow, rest = _make_list("SLOW_SUITES"), _make_list("REST_SUITES")
    assert sorted(slow + rest) == sorted(testpaths) and not set(slow) & set(rest)
    assert {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))} == {
        Path(p).name for p in testpaths}
