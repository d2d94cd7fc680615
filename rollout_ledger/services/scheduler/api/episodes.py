"""Routes of /v1/episodes: an episode with every turn and step recorded, and its decoded trajectory."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status

from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep, StateDep
from rollout_ledger.services.scheduler.api.error_responses import READ_RESPONSES
from rollout_ledger.services.scheduler.schemas import (
    EPISODE_ID_PATTERN,
    EpisodePublic,
    ErrorPublic,
    SpanPublic,
    StepPublic,
    TrajectoryPublic,
    TurnPublic,
)
from rollout_ledger.services.scheduler.trajectory_view import decode_spans, trajectory_spans

router = APIRouter(prefix="/v1/episodes", tags=["episodes"], dependencies=[ReadDep])

EpisodeIdPath = Annotated[str, Path(pattern=EPISODE_ID_PATTERN,
                                    description="``{batch_id}.{task_index}.{group_index}``")]


def _not_found(episode_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"unknown episode {episode_id!r}")


def _ids(value: Any) -> list[int] | None:
    return None if value is None else [int(v) for v in value]


@router.get("/{episode_id}", responses={**READ_RESPONSES, 404: {"model": ErrorPublic}})
async def get_episode(episode_id: EpisodeIdPath, res: ResourcesDep) -> EpisodePublic:
    """The episode row with all its turns and steps, superseded tries and attempts included (flagged)."""
    with batch_store.store_errors("read episode"):
        async with res.engine.connect() as conn:
            row = await batch_store.get_episode(conn, episode_id)
            if row is None:
                raise _not_found(episode_id)
            turn_rows = await batch_store.episode_turns(conn, episode_id)
            step_rows = await batch_store.episode_steps(conn, episode_id)
    return EpisodePublic.model_validate(
        {
            **row,
            "weight_versions": _ids(row["weight_versions"]),
            "prompt_token_ids": _ids(row["prompt_token_ids"]),
            "turns": [TurnPublic.model_validate(t) for t in turn_rows],
            "steps": [StepPublic.model_validate(s) for s in step_rows],
        }
    )


@router.get("/{episode_id}/trajectory", responses={**READ_RESPONSES, 404: {"model": ErrorPublic}})
async def get_trajectory(episode_id: EpisodeIdPath, state: StateDep, res: ResourcesDep) -> TrajectoryPublic:
    """The token-exact trajectory, with the text of the whole sequence and of each prompt/sampled/observation span."""
    with batch_store.store_errors("read trajectory"):
        async with res.engine.connect() as conn:
            traj = await batch_store.get_trajectory(conn, episode_id)
            if traj is None:
                episode = await batch_store.get_episode(conn, episode_id)
                if episode is None:
                    raise _not_found(episode_id)
                raise HTTPException(
                    status.HTTP_404_NOT_FOUND,
                    f"episode {episode_id!r} has no trajectory yet (status {episode['status']}); "
                    "the recorder assembles it when the episode ends",
                )
    token_ids = [int(t) for t in traj["token_ids"]]
    spans = trajectory_spans(len(token_ids), int(traj["prompt_len"]), traj["action_ranges"], traj["segments"])
    tokenizer, note = await state.tokenizers.get()
    text: str | None = None
    span_texts: list[str | None] = [None] * len(spans)
    if tokenizer is not None:
        text = tokenizer.decode(token_ids)
        span_texts = list(decode_spans(tokenizer, token_ids, spans))
    versions = sorted({int(v) for v in traj["action_versions"] if v is not None})
    return TrajectoryPublic.model_validate(
        {
            **traj,
            "min_weight_version": versions[0] if versions else None,
            "max_weight_version": versions[-1] if versions else None,
            "mixed_versions": len(versions) > 1,
            "token_ids": token_ids,
            "action_ranges": [[int(a), int(b)] for a, b in traj["action_ranges"]],
            "segments": [[int(a), int(b)] for a, b in traj["segments"]],
            "text": text,
            "spans": [
                SpanPublic(kind=s.kind, start=s.start, end=s.end, turn_index=s.turn_index, text=t)
                for s, t in zip(spans, span_texts, strict=True)
            ],
            "note": note,
        }
    )
