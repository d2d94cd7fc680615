"""The chaos benchmark's stall figures (bench/chaos.py): intervals without progress while work was outstanding, and
which fault each belongs to."""

from __future__ import annotations

from bench.chaos import stalls_by_fault, stalls_of


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
