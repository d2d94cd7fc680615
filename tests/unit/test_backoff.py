"""The retry pause shared by the remote env adapter and the inference client: exponential, capped, jittered."""

from __future__ import annotations

import random

import pytest

from rollout_ledger.shared.kit.backoff import backoff_delay


def test_without_jitter_the_pause_doubles_up_to_the_cap() -> None:
    assert [backoff_delay(a, 0.2, 2.0, jitter=0.0) for a in range(6)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0])


def test_without_jitter_it_matches_the_doubling_loop_it_replaced() -> None:
    """The inference client's old loop: ``delay = initial``, then ``delay = min(delay * 2, max)`` after each pause."""
    for initial, cap in ((0.2, 2.0), (0.01, 0.05), (0.0, 2.0), (0.3, 0.3), (0.15, 100.0)):
        delay, old = initial, []
        for _ in range(12):
            old.append(delay)
            delay = min(delay * 2, cap)
        assert [backoff_delay(a, initial, cap, jitter=0.0) for a in range(12)] == old


def test_without_jitter_the_rng_is_not_drawn() -> None:
    rng = random.Random(3)
    state = rng.getstate()
    backoff_delay(2, 0.1, 1.0, jitter=0.0, rng=rng)
    assert rng.getstate() == state


def test_jitter_scales_the_capped_pause_by_one_minus_jitter_to_one() -> None:
    rng = random.Random(1)
    for attempt, capped in ((0, 0.2), (1, 0.4), (2, 0.8), (3, 1.0), (9, 1.0)):
        pauses = [backoff_delay(attempt, 0.2, 1.0, jitter=0.5, rng=rng) for _ in range(300)]
        assert all(capped * 0.5 <= p <= capped for p in pauses)
        assert max(pauses) - min(pauses) > capped * 0.3  # spread over the range, not one value
    full = [backoff_delay(0, 1.0, 1.0, jitter=1.0, rng=rng) for _ in range(300)]
    assert all(0.0 <= p <= 1.0 for p in full) and min(full) < 0.1


def test_the_same_seed_gives_the_same_pauses_and_no_rng_still_jitters() -> None:
    def run(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [backoff_delay(a, 0.2, 5.0, 0.5, rng) for a in range(8)]
    assert run(7) == run(7) and run(7) != run(8)
    assert all(0.1 <= backoff_delay(0, 0.2, 5.0, 0.5) <= 0.2 for _ in range(50))


def test_it_matches_the_remote_env_formula_it_replaced() -> None:
    """RemoteConfig.backoff's old body: ``min(max, backoff * 2 ** retry) * (0.5 + 0.5 * rng.random())``."""
    a, b = random.Random(5), random.Random(5)
    for retry in range(10):
        old = min(5.0, 0.2 * (2 ** retry)) * (0.5 + 0.5 * a.random())
        assert backoff_delay(retry, 0.2, 5.0, 0.5, b) == old


def test_huge_attempts_stay_at_the_cap_and_zero_base_or_cap_is_no_pause() -> None:
    assert backoff_delay(10_000, 0.2, 3.0, jitter=0.0) == 3.0
    assert backoff_delay(4, 0.0, 3.0, jitter=0.5) == 0.0
    assert backoff_delay(4, 0.2, 0.0, jitter=0.5) == 0.0


@pytest.mark.parametrize(("attempt", "jitter"), [(-1, 0.0), (0, -0.1), (0, 1.5)])
def test_a_negative_attempt_or_a_jitter_outside_zero_one_is_refused(attempt: int, jitter: float) -> None:
    with pytest.raises(ValueError):
        backoff_delay(attempt, 0.2, 1.0, jitter)


def test_backoff_walks_the_formula_retry_by_retry() -> None:
    from rollout_ledger.shared.kit.backoff import Backoff

    walk = Backoff(0.5, 5.0)
    assert [walk.delay() for _ in range(6)] == pytest.approx([0.5, 1.0, 2.0, 4.0, 5.0, 5.0])
    assert walk.retries == 6
