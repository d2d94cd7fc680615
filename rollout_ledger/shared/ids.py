"""The deterministic id scheme of batches, groups, episodes and events: the one place every id is spelled.

An event id is also the message's ``Nats-Msg-Id``, and the recorder's primary key: a producer that publishes the
same logical event again (a retry, a resumed attempt re-publishing after a crash) produces the same id, so
JetStream's dedupe window and the recorder's ``ON CONFLICT DO NOTHING`` keep one copy.

- group ``{batch}.{task_index}``, episode ``{batch}.{task_index}.{group_index}``;
- the work item ``{ep}:requested``; the work item of a retried attempt n ``{ep}:requested:a{n}``;
- in attempt n: started ``{ep}:a{n}:started`` (seq 0), the try r of turn t ``{ep}:a{n}:t{t}:r{r}`` (seq 2t+1,
  published by the inference worker), the step of turn t ``{ep}:a{n}:s{t}`` (seq 2t+2), the terminal event
  ``{ep}:a{n}:end`` (seq 2T+1, T the turns of the attempt's trajectory, resumed ones included).
"""

from __future__ import annotations


def group_id(batch_id: str, task_index: int) -> str:
    return f"{batch_id}.{task_index}"


def episode_id(batch_id: str, task_index: int, group_index: int) -> str:
    return f"{batch_id}.{task_index}.{group_index}"


def requested_id(episode_id: str) -> str:
    """The first work item's event id (and ``Nats-Msg-Id``), the same on every republish."""
    return f"{episode_id}:requested"


def retry_requested_id(episode_id: str, attempt: int) -> str:
    """The work item that starts ``attempt`` (>= 2) of a retried episode."""
    return f"{episode_id}:requested:a{attempt}"


def started_id(episode_id: str, attempt: int) -> str:
    return f"{episode_id}:a{attempt}:started"


def turn_request_id(episode_id: str, attempt: int, turn: int, try_no: int) -> str:
    """The inference request of try ``try_no`` of turn ``turn`` (also the ``turn.generated`` event's id)."""
    return f"{episode_id}:a{attempt}:t{turn}:r{try_no}"


def step_id(episode_id: str, attempt: int, turn: int) -> str:
    return f"{episode_id}:a{attempt}:s{turn}"


def end_id(episode_id: str, attempt: int) -> str:
    """The attempt's terminal event (finished, failed or cancelled: one per attempt)."""
    return f"{episode_id}:a{attempt}:end"


def turn_seq(turn: int) -> int:
    return 2 * turn + 1


def step_seq(turn: int) -> int:
    return 2 * turn + 2


def end_seq(turns: int) -> int:
    return 2 * turns + 1
