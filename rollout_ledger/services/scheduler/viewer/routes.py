"""Routes of /v1/viewer: the JSON the viewer pages read (read scope), shaped for drawing, never for writing."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, status

from rollout_ledger.services.scheduler import batch_store
from rollout_ledger.services.scheduler.api.deps import ReadDep, ResourcesDep, StateDep
from rollout_ledger.services.scheduler.api.error_responses import READ_RESPONSES
from rollout_ledger.services.scheduler.schemas import BATCH_ID_PATTERN, EPISODE_ID_PATTERN, ErrorPublic
from rollout_ledger.services.scheduler.viewer import queries
from rollout_ledger.services.scheduler.viewer.models import (
    AuditPublic,
    BatchListPublic,
    BatchRowPublic,
    BatchSummaryPublic,
    EpisodeListPublic,
    EpisodeRowPublic,
    FoldPublic,
    GroupPublic,
    HistogramPublic,
    ResumePublic,
    SegmentViewPublic,
    SiblingPublic,
    TokenViewPublic,
    TurnViewPublic,
)
from rollout_ledger.services.scheduler.viewer.tokens import (
    Origin,
    first_divergence,
    special_ids,
    token_origins,
    token_pieces,
    tool_call_folds,
)
from rollout_ledger.shared.events import FailureClass
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.lifecycle import EpisodeStatus

router = APIRouter(prefix="/v1/viewer", tags=["viewer"], dependencies=[ReadDep])

BatchIdPath = Annotated[str, Path(pattern=BATCH_ID_PATTERN, description="The batch id")]
EpisodeIdPath = Annotated[str, Path(pattern=EPISODE_ID_PATTERN,
                                    description="``{batch_id}.{task_index}.{group_index}``")]
NOT_FOUND = {**READ_RESPONSES, 404: {"model": ErrorPublic}}
SIBLING_TOKENS = 2000
"""Tokens of each sibling sent from a little before the group's divergence (the rest: open the trajectory)."""
SIBLING_LEAD = 24
"""Shared tokens shown before the divergence, for context."""


def _batch_missing(batch_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"unknown batch {batch_id!r}")


@router.get("/batches", responses=READ_RESPONSES)
async def list_batches(
    res: ResourcesDep,
    limit: Annotated[int, Query(ge=1, le=200, description="Batches per page")] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000, description="Batches to skip, newest first")] = 0,
) -> BatchListPublic:
    """The newest batches, each with its episodes per status and mean reward."""
    with batch_store.store_errors("list batches"):
        async with res.engine.connect() as conn:
            total, rows = await queries.list_batches(conn, limit, offset)
    return BatchListPublic(
        total=total, offset=offset,
        batches=[BatchRowPublic(batch_id=r["id"], **{k: v for k, v in r.items() if k != "id"}) for r in rows])


@router.get("/batches/{batch_id}", responses=NOT_FOUND)
async def batch_summary(batch_id: BatchIdPath, res: ResourcesDep) -> BatchSummaryPublic:
    """Progress, reward histograms per env and weight version, failures by class, and the filter choices."""
    with batch_store.store_errors("read batch summary"):
        async with res.engine.connect() as conn:
            batch = await batch_store.get_batch(conn, batch_id)
            if batch is None:
                raise _batch_missing(batch_id)
            summary = await queries.batch_summary(conn, batch_id)
    counts = {str(s): 0 for s in EpisodeStatus} | summary.statuses  # the same pass as the histograms: consistent
    return BatchSummaryPublic(
        batch_id=batch_id, env=batch["env"], group_size=batch["group_size"], num_tasks=batch["num_tasks"],
        num_episodes=batch["num_episodes"], counts=counts, done=batch_store.is_done(counts),
        created_at=batch["created_at"], cancelled_at=batch["cancelled_at"], edges=summary.edges,
        histograms=[HistogramPublic(env=h.env, version=h.version, counts=h.counts, n=h.n, mean=h.mean)
                    for h in summary.histograms],
        failures=summary.failures, attempt_failures=summary.attempt_failures, envs=summary.envs,
        versions=summary.versions, statuses=[s.value for s in EpisodeStatus],
        failure_classes=[c.value for c in FailureClass],
    )


@router.get("/batches/{batch_id}/episodes", responses={
    **NOT_FOUND, 400: {"model": ErrorPublic, "description": "reward_min is above reward_max"}})
async def batch_episodes(
    batch_id: BatchIdPath,
    res: ResourcesDep,
    env: Annotated[str | None, Query(max_length=128, description="Only this env")] = None,
    episode_status: Annotated[EpisodeStatus | None, Query(alias="status", description="Only this status")] = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False, description="Reward at least this")] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False, description="Reward at most this")] = None,
    version: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="Sampled (in part) by this version")] = None,
    failure_class: Annotated[FailureClass | None, Query(description="Only this failure class")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> EpisodeListPublic:
    """The batch's episodes that match every given filter, in task and group order."""
    if reward_min is not None and reward_max is not None and reward_min > reward_max:
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"reward_min ({reward_min}) is above reward_max ({reward_max}): no reward is in that range")
    f = queries.EpisodeFilter(env=env, status=episode_status.value if episode_status else None,
                              reward_min=reward_min, reward_max=reward_max, version=version,
                              failure_class=failure_class.value if failure_class else None)
    with batch_store.store_errors("list episodes"):
        async with res.engine.connect() as conn:
            if await batch_store.get_batch(conn, batch_id) is None:
                raise _batch_missing(batch_id)
            total, rows = await queries.list_episodes(conn, batch_id, f, limit, offset)
    return EpisodeListPublic(total=total, offset=offset, episodes=[
        EpisodeRowPublic(episode_id=r["id"], versions=queries.version_label(r["weight_versions"]),
                         **{k: v for k, v in r.items() if k not in ("id", "weight_versions")})
        for r in rows])


async def _tokenizer(state: StateDep) -> tuple[ChatTokenizer | None, frozenset[int], str | None]:
    tokenizer, note = await state.tokenizers.get()
    return tokenizer, (special_ids(tokenizer) if tokenizer is not None else frozenset()), note


def _view(tokenizer: ChatTokenizer | None, specials: frozenset[int], ids: list[int],
          mask: list[int]) -> tuple[list[str] | None, list[int]]:
    """Pieces and origins (origins without a tokenizer: sampled or environment only)."""
    if tokenizer is None:
        return None, [int(Origin.SAMPLED) if m else int(Origin.ENVIRONMENT) for m in mask]
    pieces = token_pieces(tokenizer, ids, specials)
    return pieces, token_origins(pieces, ids, mask, specials, tokenizer.template_texts())


@router.get("/batches/{batch_id}/groups/{task_index}", responses=NOT_FOUND)
async def group(batch_id: BatchIdPath, task_index: Annotated[int, Path(ge=0, le=2**31 - 1)], state: StateDep,
                res: ResourcesDep) -> GroupPublic:
    """A group's siblings side by side from a little before their first divergence."""
    with batch_store.store_errors("read group"):
        async with res.engine.connect() as conn:
            rows = await queries.group_siblings(conn, batch_id, task_index)
    if not rows:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"batch {batch_id!r} has no task {task_index}")
    tokenizer, specials, note = await _tokenizer(state)
    seqs = [[int(t) for t in r["token_ids"]] for r in rows if r["token_ids"] is not None]
    common = first_divergence(seqs)
    head = seqs[0] if seqs else []
    start = max(0, common - SIBLING_LEAD)

    def sibling(r: dict[str, Any]) -> SiblingPublic:
        ids = [int(t) for t in r["token_ids"]] if r["token_ids"] is not None else []
        mask = [int(m) for m in r["loss_mask"]] if r["loss_mask"] is not None else []
        window = slice(start, start + SIBLING_TOKENS)
        pieces, origins = _view(tokenizer, specials, ids, mask) if ids else ([], [])
        return SiblingPublic(
            episode_id=r["id"], group_index=r["group_index"], status=r["status"], reward=r["reward"],
            failure_class=r["failure_class"], versions=queries.version_label(r["weight_versions"]),
            num_tokens=len(ids) if r["token_ids"] is not None else None,
            divergence=first_divergence([head, ids]) if r["token_ids"] is not None and head else None,
            start=start, pieces=(pieces or [])[window], origins=origins[window],
            truncated=len(ids) > start + SIBLING_TOKENS)

    siblings = await asyncio.to_thread(lambda: [sibling(r) for r in rows])
    prompt_lens = {int(r["prompt_len"]) for r in rows if r["prompt_len"] is not None}
    return GroupPublic(batch_id=batch_id, task_index=task_index, group_id=rows[0]["group_id"],
                       common_prefix=common, prompt_len=min(prompt_lens) if prompt_lens else None,
                       siblings=siblings, note=note)


def _segments(detail: dict[str, Any]) -> list[SegmentViewPublic]:
    starters = [s for s in detail["steps"] if s["new_segment"]]
    out = []
    for i, (start, end) in enumerate(detail["segments"]):
        step = starters[i - 1] if 0 < i <= len(starters) else None
        out.append(SegmentViewPublic(start=int(start), end=int(end), drift=step["drift"] if step else None,
                                     turn_index=step["turn_index"] if step else None))
    return out


def _turns(detail: dict[str, Any]) -> list[TurnViewPublic]:
    """The kept turns with their spans: a turn owns one action range per run of one weight version (two when a swap
    in mode ``keep`` carried it across versions; none when it sampled no id)."""
    by_turn = {t["turn_index"]: t for t in detail["turns"]}
    steps = {s["turn_index"]: s for s in detail["steps"]}
    ranges = [(int(a), int(b)) for a, b in detail["action_ranges"]]
    versions = list(detail["action_versions"] or ())
    out = []
    at = 0  # the next action range
    pos = int(detail["prompt_len"])
    for i in range(int(detail["num_turns"])):
        turn, step = by_turn.get(i, {}), steps.get(i)
        n_ranges = _ranges_of(turn)
        mine = ranges[at:at + n_ranges]
        mine_versions = versions[at:at + n_ranges]
        at += n_ranges
        start, end = (mine[0][0], mine[-1][1]) if mine else (pos, pos)
        pos = end
        changes = [[a, int(v)] for (a, _), v in zip(mine[1:], mine_versions[1:], strict=True)]
        version = mine_versions[0] if mine_versions else turn.get("weight_version")
        out.append(TurnViewPublic(
            turn_index=i, start=start, end=end, weight_version=version,
            finish_reason=turn.get("finish_reason"), engine=turn.get("engine"),
            generate_ms=turn.get("generate_ms"), cached_tokens=turn.get("cached_tokens"),
            observation=step["observation"] if step else None, reward=step["reward"] if step else None,
            terminated=step["terminated"] if step else None, truncated=step["truncated"] if step else None,
            drift=step["drift"] if step else None, new_segment=bool(step and step["new_segment"]),
            step_info=step["info"] if step and isinstance(step["info"], dict) else {},
            version_changes=changes, reused_from=step.get("reused_from") if step else None,
            attempt=turn.get("attempt")))
    return out


def _ranges_of(turn: dict[str, Any]) -> int:
    """Action ranges a kept turn owns: one per non-empty run of one weight version (one without runs; none for a
    turn that sampled no id; one when the turn row is not readable)."""
    n = turn.get("num_ids")
    if n is None:
        return 1
    runs = turn.get("version_runs") or []
    if not runs:
        return 1 if n else 0
    ends = [r[0] for r in runs[1:]] + [n]
    return sum(1 for (start, _), end in zip(runs, ends, strict=True) if end > start)


def _resume(detail: dict[str, Any]) -> ResumePublic | None:
    row = detail.get("resume")
    if row is None:
        return None
    return ResumePublic(**row, turns_reused=sum(1 for s in detail["steps"] if s.get("reused_from")))


@router.get("/episodes/{episode_id}", responses=NOT_FOUND)
async def episode_tokens(episode_id: EpisodeIdPath, state: StateDep, res: ResourcesDep) -> TokenViewPublic:
    """The trajectory token by token: text, origin, loss mask, logprob and weight version of every token; turns
    with their steps, segments with their drift class, tool-call folds, and the logprob audits."""
    with batch_store.store_errors("read trajectory"):
        async with res.engine.connect() as conn:
            detail = await queries.episode_detail(conn, episode_id)
            if detail is None:
                episode = await batch_store.get_episode(conn, episode_id)
                if episode is None:
                    raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown episode {episode_id!r}")
                raise HTTPException(status.HTTP_404_NOT_FOUND,
                                    f"episode {episode_id!r} has no trajectory yet (status {episode['status']})")
    tokenizer, specials, note = await _tokenizer(state)
    ids = [int(t) for t in detail["token_ids"]]
    mask = [int(m) for m in detail["loss_mask"]]
    ranges = [[int(a), int(b)] for a, b in detail["action_ranges"]]
    pieces, origins = await asyncio.to_thread(_view, tokenizer, specials, ids, mask)
    folds = tool_call_folds(pieces, ranges) if pieces is not None else []
    return TokenViewPublic(
        episode_id=episode_id, batch_id=detail["batch_id"], group_id=detail["group_id"],
        task_index=detail["task_index"], group_index=detail["group_index"], env=detail["env"],
        attempt=detail["attempt"], status=detail["status"], failure_class=detail["failure_class"],
        failure_reason=detail["failure_reason"], stop_reason=detail["stop_reason"], reward=detail["reward"],
        num_tokens=len(ids), prompt_len=int(detail["prompt_len"]),
        num_sampled_tokens=int(detail["num_sampled_tokens"]), token_check=detail["token_check"], token_ids=ids,
        pieces=pieces, origins=origins, origin_names=[o.name.lower() for o in Origin], loss_mask=mask,
        logprobs=[float(x) for x in detail["logprobs"]], weight_versions=[int(v) for v in detail["weight_versions"]],
        turns=_turns(detail), resume=_resume(detail), segments=_segments(detail),
        folds=[FoldPublic(start=f.start, end=f.end, turn_index=f.turn_index, label=f.label) for f in folds],
        audits=[_audit(a, sum(mask)) for a in detail["audits"]], note=note)


def _audit(row: dict[str, Any], num_sampled: int) -> AuditPublic:
    """An audit row as the viewer shows it: the per-token logprobs only where one lines up with each sampled
    token (NaN, not recomputed, becomes null)."""
    values = row.pop("token_logprobs")
    if values is None:
        return AuditPublic(**row)
    if len(values) != num_sampled:
        return AuditPublic(**row, token_note=f"{len(values)} recomputed logprobs for {num_sampled} sampled tokens: "
                                               "not shown per token")
    return AuditPublic(**row, token_logprobs=[None if math.isnan(x) else float(x) for x in values])
