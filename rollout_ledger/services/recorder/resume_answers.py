"""Answers resume queries (``shared/resume.py``): the recorded turns an episode's next attempt may carry over, read
from Postgres, page by page.

The source is the episode's latest started attempt (``episodes.attempt``, whose prompt is stored) below the asking
one; of it, the steps of turns 0, 1, ... in a row, each joined with the turn it names (possibly a turn of an
earlier attempt the source itself carried over), stopping at the first turn without both. What the recorder has
not stored yet is not offered: the asking attempt generates it again. A query for an episode that ended, or that a
later attempt already started, offers nothing (``reason`` says why).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.shared import resume as contract
from rollout_ledger.shared.errors import SchemaError, StoreError
from rollout_ledger.shared.kit.bus import best_effort
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.resume import PAGE_BYTES, RecordedTurn, ResumeQuery, ResumeRecord
from rollout_ledger.shared.subjects import RESUME_QUEUE, RESUME_SUBJECT, error_headers

from .store import TERMINAL_STATUSES, Store

log = get_logger(__name__)

_ROWS = (
    "SELECT s.turn_index, s.event_id, s.turn_event_id, s.action, s.observation, s.observation_token_ids, s.reward, "
    "s.terminated, s.truncated, s.info, s.drift, s.new_segment, s.env_state, t.token_ids, t.logprobs, "
    "t.finish_reason, t.weight_version, t.worker_id, t.prompt_len, t.version_runs "
    "FROM steps s LEFT JOIN turns t ON t.event_id = s.turn_event_id AND t.episode_id = s.episode_id "
    "WHERE s.episode_id = %s AND s.attempt = %s AND s.turn_index >= %s ORDER BY s.turn_index"
)


class ResumeResponder:
    """Serves ``RESUME_SUBJECT`` (queue group ``RESUME_QUEUE``: any recorder answers)."""

    def __init__(self, store: Store, nc: NATS) -> None:
        self.store = store
        self.nc = nc
        self.sub: Subscription | None = None

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(RESUME_SUBJECT, queue=RESUME_QUEUE, cb=self._on_query)

    async def stop(self) -> None:
        if self.sub is not None:
            with best_effort("unsubscribe the resume queries"):
                await self.sub.unsubscribe()

    async def _on_query(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            query = contract.decode_query(msg.data)
        except SchemaError as exc:
            await self._respond(msg, str(exc).encode(), error_headers("schema", False))
            return
        try:
            record = await self.answer(query)
        except StoreError as exc:
            log.warning("recorder.resume_unanswered", episode_id=query.episode_id, error=str(exc))
            await self._respond(msg, b"the database is unavailable", error_headers("store", exc.retryable))
            return
        log.info("recorder.resume_answered", episode_id=query.episode_id, attempt=query.attempt,
                 source_attempt=record.source_attempt, turns=len(record.turns), from_turn=query.from_turn,
                 reason=record.reason)
        await self._respond(msg, contract.encode(record), None)

    async def _respond(self, msg: Msg, data: bytes, headers: dict[str, str] | None) -> None:
        with best_effort("answer a resume query"):  # the asker gave up or the connection is gone: it starts at turn 0
            await self.nc.publish(msg.reply, data, headers=headers)

    async def answer(self, query: ResumeQuery) -> ResumeRecord:
        """One page of the recorded turns ``query.attempt`` may carry over."""
        async with self.store.transaction() as tx, tx.pg.cursor() as cur:
            await cur.execute("SELECT attempt, status, prompt_token_ids FROM episodes WHERE id = %s",
                              (query.episode_id,))
            ep = await cur.fetchone()
            if ep is None:
                return ResumeRecord(episode_id=query.episode_id, reason="no such episode")
            attempt, status, prompt = int(ep[0]), str(ep[1]), ep[2]
            source = query.from_attempt or attempt
            if status in TERMINAL_STATUSES:
                return ResumeRecord(episode_id=query.episode_id, reason=f"the episode ended ({status})")
            if source >= query.attempt:
                return ResumeRecord(episode_id=query.episode_id,
                                    reason=f"attempt {attempt} started already (asked by attempt {query.attempt})")
            if prompt is None or source != attempt:
                return ResumeRecord(episode_id=query.episode_id, reason="no started attempt recorded")
            await cur.execute(_ROWS, (query.episode_id, source, query.from_turn))
            rows = await cur.fetchall()
            turns, more = _page(rows, query.from_turn)
            unstepped = 0
            if not more:  # the last page says how many generated turns come after the kept ones
                await cur.execute("SELECT count(*) FROM turns WHERE episode_id = %s AND attempt = %s AND "
                                  "turn_index >= %s", (query.episode_id, source, query.from_turn + len(turns)))
                unstepped = int((await cur.fetchone() or (0,))[0])
        return ResumeRecord(episode_id=query.episode_id, source_attempt=source,
                            prompt_token_ids=np.asarray(prompt, dtype=np.int32), turns=turns, more=more,
                            unstepped_turns=unstepped)


def _page(rows: list[Any], from_turn: int) -> tuple[list[RecordedTurn], bool]:
    """The rows as recorded turns, in a row from ``from_turn`` up to the first gap (a step without its turn, a
    missing index), cut at ``PAGE_BYTES`` of token arrays; whether more follow."""
    turns: list[RecordedTurn] = []
    size = 0
    expected = from_turn
    for r in rows:
        if int(r[0]) != expected or r[13] is None:
            return turns, False
        ids = np.asarray(r[13], dtype=np.int32)
        obs = np.asarray(r[5], dtype=np.int32)
        size += 8 * len(ids) + 4 * len(obs) + len(r[3]) + len(r[4])
        if turns and size > PAGE_BYTES:
            return turns, True
        turns.append(RecordedTurn(
            turn_index=int(r[0]), step_event_id=r[1], turn_event_id=r[2], action=r[3], observation=r[4],
            observation_token_ids=obs, reward=float(r[6]), terminated=bool(r[7]), truncated=bool(r[8]),
            info=r[9] or {}, drift=r[10], new_segment=bool(r[11]), env_state=r[12], token_ids=ids,
            logprobs=np.asarray(r[14], dtype=np.float32), finish_reason=str(r[15]), weight_version=int(r[16]),
            worker_id=str(r[17]), prompt_len=int(r[18]),
            version_runs=[(int(a), int(b)) for a, b in r[19]] if r[19] else None))
        expected += 1
    return turns, False
