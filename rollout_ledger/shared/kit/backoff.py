"""Retry pauses: exponential backoff, capped, with optional jitter (one formula for every retry loop).

Our retry loops are not "call this function again" (which tenacity or stamina would wrap): each try goes to
another worker (inference client), handles a nak/ack of its own (recorder) or a remote env's 4xx/5xx split, so
they only need the pause. ``backoff_delay`` is that pause; ``Backoff`` walks it for a loop that counts for you.
"""

from __future__ import annotations

import random

_MAX_DOUBLINGS = 64
"""Doublings past this change nothing a cap can see (and ``2 ** attempt`` stays a small float)."""


def backoff_delay(attempt: int, base: float, cap: float, jitter: float, rng: random.Random | None = None) -> float:
    """Pause in seconds before retry number ``attempt`` (0-based: the first retry is 0).

    ``min(cap, base * 2 ** attempt)``, then scaled by a random factor in ``[1 - jitter, 1]``: ``jitter=0`` is
    no jitter, ``jitter=0.5`` a pause of 50-100 % of the capped one. ``rng`` draws the factor (the ``random``
    module's generator when None; not drawn at all when ``jitter`` is 0).
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if not 0.0 <= jitter <= 1.0:
        raise ValueError(f"jitter must be within [0, 1], got {jitter}")
    if base <= 0.0 or cap <= 0.0:
        return 0.0
    delay = min(cap, base * 2.0 ** min(attempt, _MAX_DOUBLINGS))
    if jitter == 0.0:
        return delay
    draw = rng.random() if rng is not None else random.random()
    return delay * (1.0 - jitter + jitter * draw)


class Backoff:
    """Successive pauses of one retry loop: ``backoff_delay`` for retry 0, 1, 2, ... (no jitter unless given)."""

    def __init__(self, base: float, cap: float, jitter: float = 0.0, rng: random.Random | None = None) -> None:
        self.base, self.cap, self.jitter, self.rng = base, cap, jitter, rng
        self.retries = 0
        """Pauses handed out so far."""

    def delay(self) -> float:
        """The next pause (and count it)."""
        pause = backoff_delay(self.retries, self.base, self.cap, self.jitter, self.rng)
        self.retries += 1
        return pause
