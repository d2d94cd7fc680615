"""The recording rules: how one fetched batch of events becomes rows, trajectories and ack decisions.

Order inside the one transaction of a batch: dead letters for undecodable messages; ``episode.started``
updates; turns and steps (binary COPY; a duplicate falls back to ``ON CONFLICT DO NOTHING``); terminal events,
in rounds of distinct episodes, each round read and written with a handful of bulk statements; then
``superseded`` is reconciled for every episode whose state the batch changed and every episode whose new rows
are not plainly current (another attempt, a terminal episode). Every write is idempotent, so a redelivered or
replayed batch changes nothing.

Attempts. The kept attempt of an episode is the latest one the lifecycle let start (``episodes.attempt``).
A terminal event of an older attempt, or of any attempt once the episode is terminal, changes nothing (its
rows are stored and marked superseded): the prompt of such an attempt is not stored, so it could not be
assembled exactly, and a finished rollout is never replaced by a later attempt's failure. The trajectory
upsert itself only ever replaces a trajectory from a higher attempt.

Failures. Every ``EpisodeFailed`` becomes a row of ``attempt_failures`` (class, reason, whether another attempt
followed), written up front and idempotent on its event id; a failure the recorder decides itself (an episode
it cannot assemble) adds a row of class ``infra``. An ``EpisodeFailed`` with ``will_retry`` changes nothing
else: the episode stays running (or requested) until a later attempt ends it.

Rewards. A finished trajectory carries ``EpisodeFinished.reward``. A failed one carries NULL: the environment
never produced its final score, and a partial sum of step rewards would look like a real return to a trainer's
group normalisation. Step rewards stay in ``steps`` for whoever wants partial returns.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeAlias

from rollout_ledger.shared.errors import SchemaError
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    FailureClass,
    StepCompleted,
    TurnGenerated,
)
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.lifecycle import TERMINAL, EpisodeStatus
from rollout_ledger.shared.subjects import event_subject

from .assembly import Incomplete, StepRecord, TurnRecord, assemble, pair_records
from .store import AttemptFailure, DeadLetter, EpisodeRow, Finish, Store, TrajectoryWrite, Tx

log = get_logger(__name__)

SOURCE = "recorder"
"""``dead_letters.source`` of messages from the event stream."""
NEWER_CONTRACT = "newer_contract"
"""``Delivery.error_class`` of an event written at a newer major of the contract (parked, never dead-lettered)."""


class Action(enum.StrEnum):
    """What happens to a message once its batch committed."""

    ACK = "ack"
    NAK = "nak"
    """Redeliver later (terminal event whose records are not all stored yet)."""
    TERM = "term"
    """Never redeliver (dead-lettered)."""
    PARK = "park"
    """Redeliver after the park delay: written at a newer major of the contract, for an upgraded recorder."""


@dataclass
class Delivery:
    """One fetched message: where it sits in the stream, its bytes, and its decoded event or decode error."""

    stream_seq: int
    subject: str
    deliveries: int
    payload: bytes
    headers: dict[str, str] | None
    event: Event | None = None
    error: str | None = None
    error_class: str = ""


@dataclass
class BatchOutcome:
    """The decisions and counts of one committed batch (``actions`` aligned with the deliveries)."""

    actions: list[Action]
    processed: Counter[str] = field(default_factory=Counter)
    dead_letters: Counter[str] = field(default_factory=Counter)
    trajectories: int = 0
    naks: int = 0
    parked: int = 0
    """Messages of a newer contract major handed back (``Action.PARK``)."""
    newest_event_time: datetime | None = None
    failures: Counter[tuple[str, bool]] = field(default_factory=Counter)
    """Rows this batch added to ``attempt_failures``, by (failure class, retried) (a replay adds none)."""


def dead_letter_for(d: Delivery, reason: str) -> DeadLetter:
    return DeadLetter(SOURCE, d.subject, d.stream_seq, reason, d.payload, d.headers)


def _out_of_place(d: Delivery, ev: Event) -> tuple[str, str] | None:
    """Why a decoded event must not be recorded as it stands (reason, reason class), or None.

    An event travels on the subject of its type (``bus.publish_event``): one on another subject was not published by
    a service. A reward is a finite number (a NaN one would turn every mean over it into NaN)."""
    expected = event_subject(ev.type)
    if d.subject != expected:
        return f"out of place: a {ev.type} event on subject {d.subject} (expected {expected})", "out_of_place"
    reward = ev.reward if isinstance(ev, StepCompleted | EpisodeFinished) else None
    if reward is not None and not math.isfinite(reward):
        return f"non-finite reward {reward!r} in {ev.type} {ev.event_id}", "non_finite_reward"
    return None


RecordedEvent: TypeAlias = (EpisodeStarted | TurnGenerated | StepCompleted | EpisodeFinished | EpisodeFailed
                            | EpisodeCancelled)
"""The event types the recorder writes (every other one on the event stream is dead-lettered)."""


TerminalEvent: TypeAlias = EpisodeFinished | EpisodeFailed | EpisodeCancelled


async def record_batch(store: Store, batch: list[Delivery], assembly_max_deliveries: int) -> BatchOutcome:
    """Write one batch in one transaction of ``store``; return what to do with each message once it committed.

    ``assembly_max_deliveries``: deliveries of a terminal event whose records are still incomplete after which
    the episode is given up (failed, class infra)."""
    async with store.transaction() as tx:
        return await _record(tx, batch, assembly_max_deliveries)


async def _record(tx: Tx, batch: list[Delivery], assembly_max_deliveries: int) -> BatchOutcome:
    """``record_batch`` inside ``tx``."""
    out = BatchOutcome(actions=[Action.ACK] * len(batch))
    letters: list[DeadLetter] = []
    started: list[tuple[int, EpisodeStarted]] = []
    turns: dict[str, TurnGenerated] = {}
    steps: dict[str, StepCompleted] = {}
    terminals: list[tuple[int, TerminalEvent]] = []
    changed: set[str] = set()  # episodes whose state this batch may change (started, terminal): always reconciled

    def refuse(i: int, reason: str, reason_class: str) -> None:
        letters.append(dead_letter_for(batch[i], reason))
        out.dead_letters[reason_class] += 1
        out.actions[i] = Action.TERM

    candidates: list[tuple[int, RecordedEvent]] = []
    for i, d in enumerate(batch):
        ev = d.event
        if d.error_class == NEWER_CONTRACT:
            out.actions[i] = Action.PARK
            out.parked += 1
            continue
        if ev is None or not isinstance(ev, RecordedEvent):
            refuse(i, d.error or f"unexpected event type {getattr(ev, 'type', '?')} on the event stream",
                   d.error_class or "unexpected_type")
            continue
        refusal = _out_of_place(d, ev)
        if refusal is not None:
            refuse(i, *refusal)
            continue
        candidates.append((i, ev))

    # Every row belongs to an episode the scheduler stored (it inserts the row before publishing the work item):
    # an event for any other episode is hostile or corrupt, and leaves no row (the foreign keys say so too).
    owners = await tx.episode_owners([ev.episode_id for _, ev in candidates])
    for i, ev in candidates:
        owner = owners.get(ev.episode_id)
        if owner is None:
            refuse(i, f"unknown episode {ev.episode_id}: the scheduler stored no such episode", "unknown_episode")
            continue
        if owner.batch_id != ev.batch_id:
            refuse(i, f"episode {ev.episode_id} belongs to batch {owner.batch_id}, the event names batch "
                   f"{ev.batch_id}", "unknown_episode")
            continue
        if isinstance(ev, EpisodeCancelled) and not owner.batch_cancelled:
            # Only the scheduler cancels (it stamps batches.cancelled_at before telling the env workers).
            refuse(i, f"episode.cancelled for episode {ev.episode_id} of batch {ev.batch_id}, which the scheduler "
                   "did not cancel", "unauthorised_cancel")
            continue
        if isinstance(ev, EpisodeStarted):
            started.append((i, ev))
            changed.add(ev.episode_id)
        elif isinstance(ev, TurnGenerated):
            turns.setdefault(ev.event_id, ev)
        elif isinstance(ev, StepCompleted):
            steps.setdefault(ev.event_id, ev)
        else:
            terminals.append((i, ev))
            changed.add(ev.episode_id)

    # Every episode row this transaction will update, locked at once in id order: the started updates and the
    # terminal rounds below would otherwise lock them in two passes, and two recorders (or a recorder and a
    # scheduler stamping published_at) could each hold what the other waits for.
    await tx.lock_episodes(sorted(changed))
    await tx.add_dead_letters(letters)
    out.failures += await tx.add_attempt_failures(
        [_failure_row(ev) for _, ev in terminals if isinstance(ev, EpisodeFailed)])
    started.sort(key=lambda p: (p[1].episode_id, batch[p[0]].stream_seq))
    await tx.apply_started([e for _, e in started])
    await tx.insert_turns(list(turns.values()))
    await tx.insert_steps(list(steps.values()))

    terminals.sort(key=lambda p: (p[1].episode_id, batch[p[0]].stream_seq))
    for round_ in _rounds(terminals):
        # Episodes of a round are distinct, so chunking keeps the semantics and bounds memory: the records of at
        # most ASSEMBLY_CHUNK episodes are loaded at once, however bursty the terminal events are.
        for start in range(0, len(round_), ASSEMBLY_CHUNK):
            await _terminals(tx, batch, round_[start:start + ASSEMBLY_CHUNK], assembly_max_deliveries, out)

    # Rows of episodes whose state did not change here only need reconciling when they are not plainly current.
    written = {(e.episode_id, e.attempt) for e in turns.values()} | {(e.episode_id, e.attempt) for e in steps.values()}
    others = sorted(p for p in written if p[0] not in changed)
    await tx.reconcile_superseded(sorted(changed | await tx.unsettled(others)))

    for i, d in enumerate(batch):
        if out.actions[i] is Action.ACK and d.event is not None:
            out.processed[d.event.type] += 1
            t = d.event.time
            if out.newest_event_time is None or t > out.newest_event_time:
                out.newest_event_time = t
    return out


ASSEMBLY_CHUNK = 64
"""Episodes assembled per bulk read (their turns and steps are in memory together)."""


def _rounds(terminals: list[tuple[int, TerminalEvent]]) -> list[list[tuple[int, TerminalEvent]]]:
    """Split terminal events (sorted by episode, then stream order) into rounds holding each episode at most once.

    Round k holds the k-th terminal event of every episode, so handling the rounds in order, each as one batch,
    is the same as handling the events one by one in stream order (episodes are independent of each other).
    """
    rounds: list[list[tuple[int, TerminalEvent]]] = []
    seen: Counter[str] = Counter()
    for item in terminals:
        k = seen[item[1].episode_id]
        seen[item[1].episode_id] += 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(item)
    return rounds


def _failure_row(ev: EpisodeFailed) -> AttemptFailure:
    return AttemptFailure(ev.event_id, ev.episode_id, ev.batch_id, ev.attempt, str(ev.failure_class), ev.reason,
                          ev.will_retry, ev.time)


@dataclass
class _Writes:
    """The writes decided for one round of terminal events, issued together."""

    letters: list[DeadLetter] = field(default_factory=list)
    failures: list[AttemptFailure] = field(default_factory=list)
    """Failures the recorder decided (``infra``), besides the ``EpisodeFailed`` events written up front."""
    trajectories: list[TrajectoryWrite] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)


async def _terminals(tx: Tx, batch: list[Delivery], round_: list[tuple[int, TerminalEvent]],
                     assembly_max_deliveries: int, out: BatchOutcome) -> None:
    """Decide every terminal event of one round (distinct episodes), then write the decisions in bulk."""
    eps = await tx.lock_episodes([ev.episode_id for _, ev in round_])
    wanted = []
    for _, ev in round_:
        ep = eps.get(ev.episode_id)
        if (ep is not None and ep.status not in TERMINAL and ev.attempt >= ep.attempt
                and not isinstance(ev, EpisodeCancelled) and ep.attempt == ev.attempt
                and not (isinstance(ev, EpisodeFailed) and ev.will_retry)
                and ep.prompt_token_ids is not None):
            wanted.append((ev.episode_id, ev.attempt, ev.num_turns))
    records = await tx.attempt_records(wanted)
    w = _Writes()
    for i, ev in round_:
        out.actions[i] = _terminal(batch[i], ev, eps.get(ev.episode_id), records.get(ev.episode_id),
                                   assembly_max_deliveries, out, w)
    await tx.add_dead_letters(w.letters)
    out.failures += await tx.add_attempt_failures(w.failures)
    out.trajectories += await tx.upsert_trajectories(w.trajectories)
    await tx.finish_episodes(w.finishes)


def _fail_episode(d: Delivery, ev: TerminalEvent, reason: str, reason_class: str, out: BatchOutcome,
                  w: _Writes) -> Action:
    """Dead-letter a terminal event the recorder cannot turn into a trajectory; the episode fails (infra)."""
    w.letters.append(dead_letter_for(d, reason))
    out.dead_letters[reason_class] += 1
    w.finishes.append(Finish(ev.episode_id, EpisodeStatus.FAILED, ev.attempt, ev.time, num_turns=ev.num_turns,
                             failure_class=str(FailureClass.INFRA), failure_reason=reason))
    w.failures.append(AttemptFailure(f"{ev.event_id}:recorder", ev.episode_id, ev.batch_id, ev.attempt,
                                     str(FailureClass.INFRA), reason, False, ev.time))
    log.error("recorder.episode_failed_by_recorder", episode_id=ev.episode_id, attempt=ev.attempt, reason=reason)
    return Action.ACK


def _incomplete(d: Delivery, ev: EpisodeFinished | EpisodeFailed, missing: Incomplete, assembly_max_deliveries: int,
                out: BatchOutcome, w: _Writes) -> Action:
    """Hand the terminal event back for later, or give up after ``assembly_max_deliveries`` deliveries."""
    if d.deliveries >= assembly_max_deliveries:
        reason = (f"trajectory incomplete after {d.deliveries} deliveries of {ev.type}: {missing.reason} "
                  f"({missing.have} of {missing.need} turns)")
        return _fail_episode(d, ev, reason, "incomplete", out, w)
    out.naks += 1
    log.info("recorder.terminal_incomplete", episode_id=ev.episode_id, attempt=ev.attempt, reason=missing.reason,
             deliveries=d.deliveries)
    return Action.NAK


def _terminal(d: Delivery, ev: TerminalEvent, ep: EpisodeRow | None,
              records: tuple[list[StepRecord], dict[str, TurnRecord]] | None, assembly_max_deliveries: int,
              out: BatchOutcome, w: _Writes) -> Action:
    if ep is None:
        w.letters.append(dead_letter_for(d, f"unknown episode {ev.episode_id}"))
        out.dead_letters["unknown_episode"] += 1
        return Action.TERM
    if ep.status in TERMINAL or ev.attempt < ep.attempt:
        # Replay, a stale attempt, or an attempt that started after the episode ended: nothing to change.
        return Action.ACK

    if isinstance(ev, EpisodeFailed) and ev.will_retry:
        # Another attempt follows: the failure is in attempt_failures; the episode stays where it is (running,
        # or requested when the attempt failed before it started) until an attempt ends it.
        return Action.ACK

    if isinstance(ev, EpisodeCancelled):
        w.finishes.append(Finish(ev.episode_id, EpisodeStatus.CANCELLED, ev.attempt, ev.time, num_turns=ev.num_turns))
        return Action.ACK

    prompt = ep.prompt_token_ids if ep.attempt == ev.attempt else None
    if isinstance(ev, EpisodeFailed) and ev.num_turns == 0 and prompt is None:
        w.finishes.append(Finish(ev.episode_id, EpisodeStatus.FAILED, ev.attempt, ev.time, num_turns=0,
                                 failure_class=str(ev.failure_class), failure_reason=ev.reason))
        return Action.ACK

    if prompt is None or records is None:
        return _incomplete(d, ev, Incomplete(f"episode.started of attempt {ev.attempt} not stored yet",
                                             0, ev.num_turns), assembly_max_deliveries, out, w)
    steps, turns = records
    paired = pair_records(ev.num_turns, steps, turns)
    if isinstance(paired, Incomplete):
        return _incomplete(d, ev, paired, assembly_max_deliveries, out, w)

    try:
        traj = assemble(prompt, paired)
    except SchemaError as exc:
        return _fail_episode(d, ev, f"inconsistent records: {exc}", "inconsistent", out, w)
    if traj.context_mismatches:
        log.warning("recorder.context_mismatch", episode_id=ev.episode_id, attempt=ev.attempt,
                    turns=list(traj.context_mismatches))

    if isinstance(ev, EpisodeFinished):
        if traj.num_tokens != ev.num_tokens:
            reason = (f"token count mismatch: the env worker reported {ev.num_tokens} tokens, the stored turns "
                      f"assemble to {traj.num_tokens}")
            return _fail_episode(d, ev, reason, "token_mismatch", out, w)
        check = ev.info.get("token_check")
        drifts = ev.info.get("drifts")
        w.trajectories.append(TrajectoryWrite(
            ep, ev.attempt, str(ev.status), None, ev.reward, traj,
            token_check=check if check in ("ok", "mismatch") else None,
            drifts=drifts if isinstance(drifts, list) else []))
        w.finishes.append(Finish(ev.episode_id, EpisodeStatus(str(ev.status)), ev.attempt, ev.time, reward=ev.reward,
                                 num_turns=traj.num_turns, stop_reason=ev.stop_reason,
                                 weight_versions=traj.distinct_weight_versions))
    else:
        w.trajectories.append(TrajectoryWrite(ep, ev.attempt, str(EpisodeStatus.FAILED), str(ev.failure_class),
                                              None, traj))
        w.finishes.append(Finish(ev.episode_id, EpisodeStatus.FAILED, ev.attempt, ev.time, num_turns=traj.num_turns,
                                 failure_class=str(ev.failure_class), failure_reason=ev.reason,
                                 weight_versions=traj.distinct_weight_versions))
    return Action.ACK
