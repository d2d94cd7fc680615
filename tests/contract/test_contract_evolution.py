"""Contract evolution: what producers of this and older versions put on the bus stays readable, a newer producer's
extra fields are ignored, and an event of a newer major is refused as such (parked by consumers, never garbage).

The example events in tests/contract/events/v<major>/ are bytes as producers of that version wrote them
(``python -m tests.contract.snapshot`` writes the current major's; older ones are never rewritten).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from rollout_ledger.shared.errors import NewerContractError, SchemaError
from rollout_ledger.shared.events import SCHEMA_VERSION, decode, decode_as, encode, to_json

from .snapshot import event_schemas, examples

EVENTS = Path(__file__).parent / "events"
SNAPSHOTS = sorted(EVENTS.glob("v*/*.msgpack"))


def _raw(path: Path) -> dict[str, Any]:
    raw: dict[str, Any] = msgpack.unpackb(path.read_bytes(), timestamp=3, strict_map_key=False)
    return raw


def _pack(raw: dict[str, Any]) -> bytes:
    return msgpack.packb(raw, datetime=True)


def _equal(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for name in type(a).model_fields:
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and np.array_equal(va, vb), name
        else:
            assert va == vb, name


def test_every_type_of_the_current_major_has_an_example_on_disk() -> None:
    current = sorted(p.stem for p in (EVENTS / f"v{SCHEMA_VERSION}").glob("*.msgpack"))
    assert current == sorted(event_schemas())


def test_the_pinned_examples_are_what_this_code_writes() -> None:
    """Encoding the examples today gives the pinned bytes: a field added or renamed shows up here too."""
    for event in examples():
        pinned = EVENTS / f"v{SCHEMA_VERSION}" / f"{event.type}.msgpack"  # type: ignore[attr-defined]
        assert encode(event) == pinned.read_bytes(), f"{pinned.name}: regenerate only for a reviewed change"


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_snapshot_events_of_every_major_so_far_decode(path: Path) -> None:
    event = decode(path.read_bytes())
    assert event.type == path.stem
    assert event.schema_version == int(path.parent.name[1:]) <= SCHEMA_VERSION


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_newer_producers_extra_fields_are_ignored(path: Path) -> None:
    """A newer producer (same major) adds optional fields at the top and inside nested models: older readers
    decode the event as if they were not there, through both the union and the typed decoder."""
    raw = _raw(path)
    plain = decode(_pack(raw))
    raw["policy_version"] = 7
    raw["routing"] = {"pool": "policy", "weights": [1, 2]}
    for nested in ("sampling", "context"):
        if isinstance(raw.get(nested), dict):
            raw[nested]["min_p"] = 0.05
    extended = _pack(raw)
    _equal(decode(extended), plain)
    _equal(decode_as(extended, type(plain)), plain)
    _equal(decode(to_json(plain).replace(b'{"type"', b'{"future_field":[1,2],"type"', 1)), plain)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_an_event_of_a_newer_major_is_refused_as_newer_not_as_garbage(path: Path) -> None:
    raw = _raw(path)
    raw["schema_version"] = SCHEMA_VERSION + 1
    raw["a_field_renamed_in_v2"] = raw.pop("episode_id")  # a breaking change: the old reader cannot validate it
    with pytest.raises(NewerContractError) as info:
        decode(_pack(raw))
    assert info.value.retryable and info.value.version == SCHEMA_VERSION + 1
    with pytest.raises(NewerContractError):
        decode_as(_pack(raw), type(decode(path.read_bytes())))


def test_a_new_event_type_of_a_newer_major_is_newer_and_of_this_major_garbage() -> None:
    newer = {"type": "policy.updated", "schema_version": SCHEMA_VERSION + 1, "event_id": "x"}
    with pytest.raises(NewerContractError):
        decode(_pack(newer))
    same = dict(newer, schema_version=SCHEMA_VERSION)
    with pytest.raises(SchemaError) as info:
        decode(_pack(same))
    assert not isinstance(info.value, NewerContractError) and not info.value.retryable


def test_a_version_that_is_not_an_integer_is_garbage() -> None:
    raw = _raw(EVENTS / f"v{SCHEMA_VERSION}" / "episode.cancelled.msgpack")
    raw["schema_version"] = "2"
    with pytest.raises(SchemaError) as info:
        decode(_pack(raw))
    assert not isinstance(info.value, NewerContractError)


def test_a_tool_call_constraint_is_on_the_wire_only_when_set() -> None:
    """``SamplingParams.tool_call`` is left out while None, nested in every event that carries sampling parameters:
    the previous release's readers refuse fields they do not know."""
    for event in examples():
        sampling = getattr(event, "sampling", None)
        if sampling is None:
            continue
        raw = msgpack.unpackb(encode(event), timestamp=3, strict_map_key=False)
        assert ("tool_call" in raw["sampling"]) == (sampling.tool_call is not None), type(event).__name__
        plain = event.model_copy(update={"sampling": sampling.model_copy(update={"tool_call": None})})
        raw = msgpack.unpackb(encode(plain), timestamp=3, strict_map_key=False)
        assert "tool_call" not in raw["sampling"] and "tool_call" not in to_json(plain).decode()
        _equal(decode(encode(event)), event)
