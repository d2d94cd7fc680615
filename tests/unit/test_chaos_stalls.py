"""The chaos benchmark's stall figures (bench/chaos.py): intervals without progress while work was outstanding, and
which fault each belongs to; and what a failing chaos test prints of the services' logs (bench/chaos_logs.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos import stalls_by_fault, stalls_of
from bench.chaos_logs import episode_report, stall_report


def test_a_stall_runs_from_the_last_progress_to_the_next() -> None:
    samples = [(0.0, 0, 5), (0.1, 1, 5), (0.2, 1, 5), (3.0, 1, 5), (3.1, 2, 5), (3.2, 3, 0), (9.0, 3, 0)]
    assert stalls_of(samples)[0] == (0.1, 3.1)  # the longest first; idle time with nothing outstanding is no stall
    assert all(end - start <= 3.0 for start, end in stalls_of(samples))


def test_a_stall_that_never_ends_lasts_to_the_last_sample() -> None:
    assert stalls_of([(0.0, 4, 2), (1.0, 5, 2), (60.0, 5, 2)])[0] == (1.0, 60.0)
    assert stalls_of([]) == []


def test_each_stall_belongs_to_the_fault_that_began_during_it() -> None:
    faults, starts = ["kill a", "kill b", "restart c"], [10.0, 20.0, 30.0]
    stalls = [(9.5, 15.0), (19.0, 70.0), (31.0, 31.5), (2.0, 3.0)]
    per_fault = stalls_by_fault(stalls, faults, starts)
    # (19, 70) saw both "kill b" and "restart c" begin: the first one caused it; (31, 31.5) began in c's time
    assert per_fault == {"kill a": 5.5, "kill b": 51.0, "restart c": 0.5}


def _kept_run(tmp_path: Path) -> Path:
    """A folder as a chaos run keeps it: faults, progress samples (a stall from 1.0 s to 4.0 s) and two logs."""
    t0 = 1_800_000_000.0
    (tmp_path / "faults.json").write_text(json.dumps({"wall_clock_t0": t0, "faults": ["kill n0"], "starts_s": [1.2]}))
    rows = [(0.0, 0, 3), (1.0, 1, 3), (2.0, 1, 3), (4.0, 2, 3), (5.0, 3, 0)]
    (tmp_path / "progress.csv").write_text("t_s,progress,outstanding\n"
                                           + "".join(f"{t},{p},{o}\n" for t, p, o in rows))

    def line(t_s: float, event: str, **fields: object) -> str:
        stamp = datetime.fromtimestamp(t0 + t_s, tz=UTC).isoformat().replace("+00:00", "Z")
        return json.dumps({"event": event, "timestamp": stamp, "level": "info", "service": "x", **fields}) + "\n"

    (tmp_path / "env-worker-0.log").write_text(
        line(0.5, "episode.end", episode_id="e1")
        + "".join(line(1.5 + i / 10, "episode.lease_unavailable", episode_id="e2") for i in range(5))
        + line(2.5, "episode.end", episode_id="e2") + line(9.0, "inference.try_failed", episode_id="e2")
        + "not json\n")
    (tmp_path / "inference-worker-0.log").write_text(line(3.0, "nats.error", error="permissions violation"))
    return tmp_path


def test_a_stall_report_says_what_was_logged_during_the_longest_stall(tmp_path: Path) -> None:
    report = stall_report(_kept_run(tmp_path))
    assert report.splitlines()[0] == "longest stall 3.00 s, from 1.00 s to 4.00 s after the run's start"
    assert "1.20 s: kill n0" in report
    assert "permissions violation" in report
    assert report.count("episode.lease_unavailable") == 4  # three lines, then the count of the rest
    assert "... 2 more episode.lease_unavailable from env-worker-0" in report
    assert "episode.end" not in report, "work going on as usual is what a stall lacks"
    assert "try_failed" not in report, "after the stall's window"


def test_an_episode_report_has_every_line_about_the_episode(tmp_path: Path) -> None:
    report = episode_report(_kept_run(tmp_path), "e2")
    assert report.startswith("episode e2:")
    assert "episode.end" in report and "inference.try_failed" in report and "e1" not in report
