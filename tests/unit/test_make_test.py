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
    slow_dirs = [p for p in slow if not p.endswith(".py")]
    slow_files = [p for p in slow if p.endswith(".py")]
    assert sorted(slow_dirs + rest) == sorted(testpaths) and not set(slow_dirs) & set(rest)
    # a slow file runs in the slow process only: it lies in a directory of the rest, which ignores it
    for path in slow_files:
        assert (ROOT / path).is_file() and str(Path(path).parent) in rest
    assert "$(addprefix --ignore=,$(filter %.py,$(SLOW_SUITES)))" in (ROOT / "Makefile").read_text()
    assert {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))} == {
        Path(p).name for p in testpaths}
