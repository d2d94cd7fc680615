"""Which live inference worker gets a turn request: the episode's sticky worker while it can take it, else the
least loaded by load per capacity; draining and excluded workers get none."""

from __future__ import annotations

from collections.abc import Mapping

from rollout_ledger.services.env_worker.inference_workers import WorkerState


def choose(workers: Mapping[str, WorkerState], prefer: str | None = None,
           exclude: frozenset[str] | set[str] = frozenset()) -> WorkerState | None:
    """The sticky worker when it is live, not draining and has room; else the least loaded; else None."""
    if prefer is not None and prefer not in exclude:
        state = workers.get(prefer)
        if state is not None and not state.draining and state.has_room:
            return state
    best: WorkerState | None = None
    best_score = 0.0
    for state in workers.values():
        if state.draining or state.worker_id in exclude:
            continue
        score = state.load / state.capacity if state.capacity > 0 else float(state.load)
        if best is None or score < best_score:
            best, best_score = state, score
    return best
