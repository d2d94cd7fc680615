"""What the services logged during a chaos run's longest stall, or about one episode, read from the folder a run kept
(``ChaosConfig.keep_logs``: the services' JSON logs, ``faults.json``, ``progress.csv``): a failing chaos test prints it,
so a CI log says what held the work instead of only how long.

``python -m bench.chaos_logs LOGS [--episode ID]``."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.chaos import stalls_of

QUIET = frozenset({"episode.end", "episode.start", "turn.generated", "batch.submitted"})
"""Events of work going on as usual: left out of a stall's excerpt (they are what a stall lacks)."""
REPEATS = 3
"""Lines kept of one service's one event in an excerpt; the rest are counted."""


def _events(logs: Path) -> list[tuple[float, str, dict[str, Any]]]:
    """(wall time, log file's stem, event) of every JSON line of the services' logs, in time order."""
    out: list[tuple[float, str, dict[str, Any]]] = []
    for path in sorted(logs.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
                wall = datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(event, dict):
                out.append((wall, path.stem, event))
    return sorted(out, key=lambda e: e[0])


def _line(t_s: float, source: str, event: dict[str, Any]) -> str:
    rest = {k: v for k, v in event.items() if k not in ("event", "timestamp", "service", "level")}
    return f"{t_s:8.2f} {source:20} {event.get('event', '?'):36} {json.dumps(rest)[:200]}"


def _excerpt(lines: list[tuple[str, str, str]], limit: int) -> list[str]:
    """At most ``REPEATS`` lines of one (source, event), at most ``limit`` in all, then what was left out."""
    seen: Counter[tuple[str, str]] = Counter()
    kept: list[str] = []
    left: Counter[tuple[str, str]] = Counter()
    for source, name, text in lines:
        seen[(source, name)] += 1
        if seen[(source, name)] > REPEATS or len(kept) >= limit:
            left[(source, name)] += 1
        else:
            kept.append(text)
    kept += [f"   ... {n} more {name} from {source}" for (source, name), n in left.most_common()]
    return kept


def longest_stall(logs: Path) -> tuple[float, float] | None:
    """(start, end) of the run's longest stall, in seconds since its start (``progress.csv``); None without one."""
    with (logs / "progress.csv").open() as f:
        samples = [(float(r["t_s"]), int(r["progress"]), int(r["outstanding"])) for r in csv.DictReader(f)]
    stalls = stalls_of(samples)
    return stalls[0] if stalls else None


def stall_report(logs: Path, limit: int = 80) -> str:
    """The longest stall of the run kept in ``logs``, the faults begun around it, and what the services logged from
    2 s before it to 1 s after it (work going on as usual left out)."""
    meta = json.loads((logs / "faults.json").read_text())
    t0 = float(meta["wall_clock_t0"])
    window = longest_stall(logs)
    if window is None:
        return "no stall"
    start, end = window
    faults = [f"{s:.2f} s: {f}" for f, s in zip(meta["faults"], meta["starts_s"], strict=False)]
    lines = [(source, str(e.get("event")), _line(wall - t0, source, e)) for wall, source, e in _events(logs)
             if start - 2.0 <= wall - t0 <= end + 1.0 and e.get("event") not in QUIET]
    head = [f"longest stall {end - start:.2f} s, from {start:.2f} s to {end:.2f} s after the run's start",
            "faults: " + "; ".join(faults)]
    return "\n".join(head + _excerpt(lines, limit))


def episode_report(logs: Path, episode_id: str, limit: int = 80) -> str:
    """Everything the services logged about one episode (e.g. one that ran a second attempt)."""
    t0 = float(json.loads((logs / "faults.json").read_text())["wall_clock_t0"])
    lines = [(source, str(e.get("event")), _line(wall - t0, source, e)) for wall, source, e in _events(logs)
             if e.get("episode_id") == episode_id]
    return "\n".join([f"episode {episode_id}:", *_excerpt(lines, limit)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("logs", type=Path, help="the folder a chaos run kept (--keep-logs)")
    parser.add_argument("--episode", default="", help="an episode's log instead of the longest stall's")
    args = parser.parse_args(argv)
    print(episode_report(args.logs, args.episode) if args.episode else stall_report(args.logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
