"""Pins the JSON schema of every event type: a change here is a contract change.

Adding an optional field (with a default) is compatible: readers ignore fields they do not know; regenerate the
snapshots with `python -m tests.contract.snapshot` and say so in the CHANGELOG. Removing or retyping a field,
making one required or adding an event type is a breaking change: raise ``SCHEMA_VERSION`` (older readers park
such events until they are upgraded) and keep the older major's example events (tests/contract/events/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_ledger.shared.events import SCHEMA_VERSION

from .snapshot import event_schemas

SNAPSHOTS = Path(__file__).parent / "schemas"
ENVELOPE = {"event_id", "type", "schema_version", "episode_id", "batch_id", "attempt", "seq", "produced_by", "time"}


def test_every_type_has_a_snapshot() -> None:
    assert sorted(p.stem for p in SNAPSHOTS.glob("*.json")) == sorted(event_schemas())


@pytest.mark.parametrize("event_type", sorted(event_schemas()))
def test_schema_is_pinned(event_type: str) -> None:
    current = event_schemas()[event_type]
    pinned = json.loads((SNAPSHOTS / f"{event_type}.json").read_text())
    assert current == pinned, f"{event_type} changed: compatible? regenerate; breaking? new event type"


@pytest.mark.parametrize("event_type", sorted(event_schemas()))
def test_envelope_fields(event_type: str) -> None:
    props = set(event_schemas()[event_type]["properties"])
    assert props >= ENVELOPE


def test_schema_version_is_one() -> None:
    assert SCHEMA_VERSION == 1
