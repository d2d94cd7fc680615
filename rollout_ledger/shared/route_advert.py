"""The routing part of an env's advert in ``rl_envs``: the one definition of its format, written by env workers and
read by the scheduler.

An env's own advert carries its ``route``; the members of a family (``rg:<dataset>``) are advertised as ONE entry
``<family>:*`` whose ``route`` is the family and whose ``members`` list them. Every other key of an advert (its
description, example task, ...) is the env's public description, not routing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

FAMILY_SUFFIX = ":*"
"""A family's one advert is the entry ``<family>:*`` (``rg:*``)."""


@dataclass(frozen=True)
class RouteAdvert:
    """What routing reads from an ``rl_envs`` entry."""

    name: str
    """The entry: an env's name, or ``<family>:*`` for a family's advert."""
    route: str | None
    """The route of the env's work items; None when the advert names none (one registered by hand, by a previous
    release or by an agent): the reader routes by name."""
    members: tuple[str, ...] = ()
    """A family advert's members; empty for an env's own advert."""
    family: str | None = None
    """The family a family advert stands for; None for an env's own advert."""

    @classmethod
    def for_env(cls, name: str, route: str) -> RouteAdvert:
        return cls(name, route)

    @classmethod
    def for_family(cls, family: str, members: Iterable[str]) -> RouteAdvert:
        """The one advert of a family's members, routed by the family."""
        return cls(f"{family}{FAMILY_SUFFIX}", family, tuple(members), family)

    @staticmethod
    def family_entry(env: str) -> str | None:
        """The entry that would list ``env`` as a family member (``rg:*`` for ``rg:leg_counting``), None for a name
        without a family prefix (or a family entry itself)."""
        family, sep, member = env.partition(":")
        entry = f"{family}{FAMILY_SUFFIX}"
        return entry if sep and family and member and env != entry else None

    @classmethod
    def parse(cls, name: str, value: bytes) -> RouteAdvert:
        """The advert stored under ``name``; a value that is not a JSON object (an env registered by hand) is an
        advert without a route, and keys of the wrong type are ignored."""
        try:
            data = orjson.loads(value or b"{}")
        except orjson.JSONDecodeError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        route = data.get("route")
        members = data.get("members")
        family = data.get("family")
        return cls(name, route if isinstance(route, str) and route else None,
                   tuple(m for m in members if isinstance(m, str)) if isinstance(members, list) else (),
                   family if isinstance(family, str) and family else None)

    def format(self) -> dict[str, Any]:
        """The advert's routing keys, to merge into the JSON object an env worker writes."""
        out: dict[str, Any] = {"route": self.route}
        if self.family is not None:
            out["family"] = self.family
            out["members"] = list(self.members)
        return out
