"""The ATIF mapping (``rollout export --format atif``): one stored trajectory, its row and its kept turns
(``kept_turns.py``), as one trajectory of the Agent Trajectory Interchange Format v1.8, validated with the models of
the ``atif`` package before anything is written.

Design note. ATIF is a conversation: a root ``Trajectory`` (an ``agent``, numbered ``steps``, ``final_metrics``,
``extra``) whose steps are a system, user or agent message. The ledger's record is a token sequence, so:

- step 1 (``source: user``) is the rendered prompt, ``prompt_text`` (the chat template's rendering of the env's
  initial messages: the ledger keeps the rendering, not the messages);
- every kept turn is one agent step (step ``turn_index + 2``): ``message`` is the action text (the text outside its
  hermes ``<tool_call>`` blocks when every block parses, which become ``tool_calls``), ``observation`` the
  environment's answer. ``metrics`` carries the turn token-exactly: ``completion_token_ids`` the sampled ids
  verbatim, ``logprobs`` their inference logprobs (aligned), ``prompt_token_ids`` the context the engine generated
  the turn from (the trajectory's ids from the start of the turn's segment: the whole context of every turn, so a
  document grows with turns x context); the weight version (and a ``keep`` swap's ``version_runs``), the finish
  reason and the engine are in ``metrics.extra``; the observation's ids (what the template appended after the
  sampled ids) in the observation result's ``extra.token_ids``;
- ATIF has no reward nor ids of ours: the ledger's ids (episode, batch, group, attempt), the reward, the group
  advantage, status, task, segments and token check are in the root ``extra``; each step's ids, segment, position,
  step reward and env info in the step's ``extra``.

The sampled ids, logprobs and observation ids of the turn records are checked against the trajectory row, position
by position (they are what it was assembled from); a trajectory whose records disagree or are missing, or whose
document does not validate, raises ``SchemaError`` naming it: an export never skips one silently.
"""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from atif import Trajectory
from pydantic import ValidationError

from rollout_ledger.services.envs.tools import ToolCallError, parse_block, scan_blocks
from rollout_ledger.services.exporter.kept_turns import KeptTurn
from rollout_ledger.shared.errors import SchemaError

SCHEMA_VERSION = "ATIF-v1.8"
"""The ATIF compatibility tag of every document (the ``atif`` package 1.8.x implements it)."""
RECORD = "rollout_ledger.atif/1"
"""The layout of the ledger's fields inside ATIF's ``extra`` objects (root ``extra.record``)."""
AGENT = "rollout-ledger"
ROW_FIELDS = ("episode_id", "batch_id", "group_id", "group_index", "env", "attempt", "status", "failure_class",
              "rollout_reward", "task", "task_index", "prompt_text", "prompt_len", "num_turns", "num_segments",
              "num_sampled_tokens", "token_check", "drifts", "created_at")
"""The stored row fields the mapping reads (besides the arrays and spans every read takes)."""
NOTES = ("Exported by Rollout Ledger. Step 1 is the rendered prompt (the chat template applied to the env's initial "
         "messages); each agent step is one sampled turn: metrics.completion_token_ids are the sampled ids verbatim, "
         "metrics.logprobs their inference logprobs, metrics.prompt_token_ids the context the engine saw. The "
         "ledger's ids, reward and advantage are in extra.")


@functools.cache
def producer_version() -> str:
    """The installed rollout-ledger's version (the agent's ``version``)."""
    try:
        return importlib.metadata.version("rollout-ledger")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tool_call_id(turn_event_id: str, index: int) -> str:
    """A tool call's id in the document: its turn's event id and its place in the turn."""
    return f"{turn_event_id}:c{index}"


def tool_calls(action: str, turn_event_id: str) -> tuple[str, list[dict[str, Any]]]:
    """(message, ATIF tool calls) of a turn's action text: every hermes ``<tool_call>`` block parsed (the scanner and
    parser of the env library), the message being the text outside them; the whole text and no call when there is
    no block or any block is malformed (as the session endpoint answers it)."""
    blocks, outside = scan_blocks(action)
    calls = []
    for i, block in enumerate(blocks):
        try:
            call = parse_block(block)
        except ToolCallError:
            return action, []
        calls.append({"tool_call_id": tool_call_id(turn_event_id, i), "function_name": call.name,
                      "arguments": call.arguments})
    if not calls:
        return action, []
    return " ".join(p.strip() for p in outside if p.strip()), calls


def _floats(values: np.ndarray, name: str, what: str) -> list[float]:
    """float32 values as exact Python floats; ``SchemaError`` on a value JSON cannot hold."""
    out = values.astype(np.float64).tolist()
    if not all(map(math.isfinite, out)):
        raise SchemaError(f"{name}: {what} holds a value that is not finite (JSON has no NaN or infinity)")
    return out


def _complete(name: str, num_turns: int, turns: Sequence[KeptTurn]) -> list[KeptTurn]:
    """The turns ``0..num_turns-1`` in order, each with its turn record, or ``SchemaError`` naming the first gap."""
    by_index = {t.turn_index: t for t in turns}
    out = []
    for i in range(num_turns):
        t = by_index.get(i)
        if t is None:
            raise SchemaError(f"{name}: the step of turn {i} is not stored (of {num_turns} turns)")
        if t.turn_event_id is None:
            raise SchemaError(f"{name}: the turn named by step {t.step_event_id} is not stored")
        out.append(t)
    return out


def _agent_step(step_id: int, t: KeptTurn, context: np.ndarray, segment: int, at: int, name: str) -> dict[str, Any]:
    """The agent step of one kept turn whose sampled ids start at trajectory position ``at``, generated from
    ``context`` (its segment's ids before it)."""
    assert t.turn_event_id is not None
    n, m = len(t.token_ids), len(t.observation_token_ids)
    message, calls = tool_calls(t.action, t.turn_event_id)
    seen = t.prompt_len if t.prompt_len is not None else len(context)
    same_context = seen == len(context)
    metrics: dict[str, Any] = {
        "prompt_tokens": seen, "completion_tokens": n, "cached_tokens": t.cached_tokens,
        "prompt_token_ids": context.tolist() if same_context else None,
        "completion_token_ids": t.token_ids.tolist(),
        "logprobs": _floats(t.logprobs, name, f"the logprobs of turn {t.turn_index}"),
        "extra": {"weight_version": t.weight_version, "version_runs": t.version_runs,
                  "finish_reason": t.finish_reason, "engine": t.engine,
                  **({} if same_context else {"context_mismatch": True})},
    }
    step: dict[str, Any] = {
        "step_id": step_id, "source": "agent", "message": message, "tool_calls": calls or None, "metrics": metrics,
        "llm_call_count": 1,
        "timestamp": t.produced_at.isoformat() if t.produced_at is not None else None,
        "extra": {"turn_index": t.turn_index, "turn_event_id": t.turn_event_id, "step_event_id": t.step_event_id,
                  "segment": segment, "sampled_range": [at, at + n], "reward": t.reward, "terminated": t.terminated,
                  "truncated": t.truncated, "drift": t.drift, "new_segment": t.new_segment,
                  "reused_from": t.reused_from, "info": t.info},
    }
    if t.observation or m:
        result: dict[str, Any] = {"content": t.observation,
                                  "extra": {"token_ids": t.observation_token_ids.tolist(),
                                            "token_range": [at + n, at + n + m]}}
        if len(calls) == 1:  # the environment's answer is the one call's result
            result["source_call_id"] = calls[0]["tool_call_id"]
        step["observation"] = {"results": [result]}
    return step


def document(row: Mapping[str, Any], turns: Sequence[KeptTurn]) -> dict[str, Any]:
    """The ATIF trajectory of a stored trajectory (a ``Chunk`` row with ``ROW_FIELDS``, the selection's reward and
    advantage) and its kept turns, validated, as a JSON-ready dict (unset fields left out)."""
    eid, attempt = row["episode_id"], int(row["attempt"])
    name = f"trajectory {eid} attempt {attempt}"
    kept = _complete(name, int(row["num_turns"] or 0), turns)
    ids = np.asarray(row["token_ids"], np.int32)
    lps = np.asarray(row["logprobs"], np.float32)
    segments = [list(map(int, s)) for s in row["segments"]] or [[0, len(ids)]]
    starts = [s for s, _ in segments]
    prompt_len = int(row["prompt_len"])
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "user", "message": row.get("prompt_text") or "",
                                    "extra": {"rendered_prompt": True, "token_range": [0, prompt_len]}}]
    pos = prompt_len
    for t in kept:
        end, obs_end = pos + len(t.token_ids), pos + len(t.token_ids) + len(t.observation_token_ids)
        if not np.array_equal(ids[pos:end], t.token_ids):
            raise SchemaError(f"{name}: the sampled ids of turn {t.turn_index} ({t.turn_event_id}) differ from the "
                              f"trajectory's ids at [{pos}, {end})")
        if not np.array_equal(lps[pos:end], t.logprobs):
            raise SchemaError(f"{name}: the logprobs of turn {t.turn_index} ({t.turn_event_id}) differ from the "
                              f"trajectory's at [{pos}, {end})")
        if not np.array_equal(ids[end:obs_end], t.observation_token_ids):
            raise SchemaError(f"{name}: the observation ids of step {t.step_event_id} differ from the trajectory's "
                              f"ids at [{end}, {obs_end})")
        segment = max(bisect.bisect_right(starts, pos) - 1, 0)
        steps.append(_agent_step(len(steps) + 1, t, ids[starts[segment]:pos], segment, pos, name))
        pos = obs_end
    if pos != len(ids):
        raise SchemaError(f"{name}: its prompt and {len(kept)} turns cover {pos} of its {len(ids)} ids")
    agent_steps = steps[1:]
    cached = [s["metrics"]["cached_tokens"] for s in agent_steps]
    created = row.get("created_at")
    doc = {
        "schema_version": SCHEMA_VERSION,
        "session_id": eid,
        "trajectory_id": f"{eid}:a{attempt}",
        "agent": {"name": AGENT, "version": producer_version(), "extra": {"env": row["env"]}},
        "steps": steps,
        "notes": NOTES,
        "final_metrics": {
            "total_prompt_tokens": sum(s["metrics"]["prompt_tokens"] for s in agent_steps),
            "total_completion_tokens": sum(s["metrics"]["completion_tokens"] for s in agent_steps),
            "total_cached_tokens": sum(cached) if agent_steps and None not in cached else None,
            "total_steps": len(steps),
            "extra": {"num_tokens": len(ids), "num_turns": len(kept), "num_segments": len(segments)},
        },
        "extra": {
            "record": RECORD, "episode_id": eid, "batch_id": row["batch_id"], "group_id": row["group_id"],
            "group_index": row.get("group_index"), "task_index": row.get("task_index"), "env": row["env"],
            "attempt": attempt, "status": row["status"], "failure_class": row.get("failure_class"),
            "reward": row.get("reward"), "reward_source": row.get("reward_source") or "rollout",
            "rollout_reward": row.get("rollout_reward"), "advantage": row.get("advantage"),
            "group_size": row.get("group_size"), "task": row.get("task"), "token_check": row.get("token_check"),
            "drifts": row.get("drifts"), "segments": segments, "prompt_len": prompt_len,
            "created_at": created.isoformat() if created is not None else None,
        },
    }
    return validated(doc, name)


def validated(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``doc`` checked by the ``atif`` package's models (``atif.Trajectory``) and dumped back as JSON-ready values
    without unset fields; ``SchemaError`` naming the trajectory when it does not validate."""
    try:
        return Trajectory.model_validate(doc).to_json_dict()
    except ValidationError as exc:
        raise SchemaError(f"{name} is not a valid ATIF trajectory: {exc}") from exc
