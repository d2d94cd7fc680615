"""Regenerates tests/contract/schemas/*.json from shared/events.py (a deliberate, reviewed contract change)."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_ledger.shared.events import event_schemas

if __name__ == "__main__":
    out = Path(__file__).parent / "schemas"
    out.mkdir(exist_ok=True)
    for name, schema in event_schemas().items():
        (out / f"{name}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(event_schemas())} schemas to {out}")
