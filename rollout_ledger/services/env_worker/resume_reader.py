"""Reads an episode's recorded turns from the recorders for an attempt after the first (``shared/resume.py``).

The env worker has no database: the recorders answer from Postgres. An unanswered or malformed query is not a
failure of the episode: the attempt starts at turn 0, as before resume existed, and says why
(``ResumeUnavailable``).
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NATS

from rollout_ledger.shared import resume as contract
from rollout_ledger.shared.errors import BusError, SchemaError
from rollout_ledger.shared.kit.bus import bus_errors
from rollout_ledger.shared.resume import RecordedTurn, ResumeQuery, ResumeRecord
from rollout_ledger.shared.subjects import ERROR_HEADER, RESUME_SUBJECT

_MAX_PAGES = 10_000


class ResumeUnavailable(Exception):
    """No recorder answered the resume query usably; the message says why (recorded as the fallback's reason)."""


@dataclass(frozen=True)
class Recorded:
    """What an attempt may carry over: the source attempt, its prompt and its recorded turns in order."""

    source_attempt: int
    prompt_token_ids: object
    turns: list[RecordedTurn]
    unstepped_turns: int


class ResumeReader:
    """Asks the recorders (``RESUME_SUBJECT``) for an episode's recorded turns, page by page."""

    def __init__(self, nc: NATS, timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    async def read(self, episode_id: str, attempt: int) -> Recorded | None:
        """The recorded turns attempt ``attempt`` may carry over; None when nothing was recorded (the reason is in
        the log). Raises ``ResumeUnavailable`` when no recorder answered usably."""
        turns: list[RecordedTurn] = []
        first: ResumeRecord | None = None
        unstepped = 0
        query = ResumeQuery(episode_id=episode_id, attempt=attempt)
        for _ in range(_MAX_PAGES):
            page = await self._ask(query)
            if first is None:
                first = page
                if page.source_attempt == 0:
                    return None
            elif page.source_attempt != first.source_attempt:
                raise ResumeUnavailable(f"the recorded attempt changed between pages ({first.source_attempt} -> "
                                        f"{page.source_attempt})")
            expected = len(turns)
            for turn in page.turns:
                if turn.turn_index != expected:
                    raise ResumeUnavailable(f"recorded turns out of order: turn {turn.turn_index} where {expected} "
                                            "was expected")
                turns.append(turn)
                expected += 1
            unstepped = page.unstepped_turns
            if not page.more or not page.turns:
                break
            query = ResumeQuery(episode_id=episode_id, attempt=attempt, from_turn=len(turns),
                                from_attempt=first.source_attempt)
        assert first is not None
        return Recorded(first.source_attempt, first.prompt_token_ids, turns, unstepped)

    async def _ask(self, query: ResumeQuery) -> ResumeRecord:
        try:
            with bus_errors("the resume query"):
                msg = await self.nc.request(RESUME_SUBJECT, contract.encode(query), timeout=self.timeout_s)
        except BusError as exc:  # no responders, a timeout, a closed connection
            raise ResumeUnavailable(f"no recorder answered the resume query ({exc})") from exc
        if msg.headers and msg.headers.get(ERROR_HEADER):
            raise ResumeUnavailable(f"the recorder could not answer: {msg.data[:300].decode(errors='replace')}")
        try:
            return contract.decode_record(msg.data)
        except SchemaError as exc:
            raise ResumeUnavailable(f"malformed resume answer: {exc}") from exc
