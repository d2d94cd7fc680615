"""TRL's ``GRPOTrainer`` learning from the ledger through TRL's own extension points (TRL 1.16, pinned by the
``trl`` extra): the ledger generates (multi-turn episodes on its inference workers, the env's rewards), TRL trains.

    from trl import GRPOConfig, GRPOTrainer
    from rollout_ledger.client.adapters.trl import LedgerRollout, task_dataset

    ledger = LedgerRollout(scheduler_url, database_url, env="arithmetic", checkpoint_dir="ckpt",
                           sampling={"temperature": 1.0, "max_tokens": 16}, max_staleness=0)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=task_dataset(tasks),
                          args=GRPOConfig(..., use_vllm=False), reward_funcs=ledger.reward,
                          rollout_func=ledger.rollout_func, callbacks=[ledger.callback()])
    ledger.correct_importance_sampling(trainer)     # optional: TRL's IS correction on the ledger's logprobs
    trainer.train()

What maps to what:

- **Tasks.** ``task_dataset(tasks)`` makes the dataset TRL samples from: its ``prompt`` is each task as JSON text
  (the env renders the real prompt). TRL's sampler repeats each prompt ``num_generations`` times in a row; each
  block is one ledger group (``group_size = num_generations``).
- **rollout_func.** ``max_staleness`` 0 (on-policy): each call submits one batch of the call's tasks, waits for it
  and returns its trajectories in TRL's row order (task, then member). ``max_staleness`` k > 0: the first call
  submits one batch for the whole run, bounded at admission (``max_staleness`` k, ``episodes_per_version`` one
  step's episodes), so the ledger generates the next steps' groups while TRL trains, at most k versions ahead; each
  call returns the next ``len(prompts) / num_generations`` complete groups (``TrajectoryReader.read_groups``): the
  ones that finished first, not necessarily the prompts TRL drew (TRL logs its own prompt list; what trained is in
  the ``ledger_task`` column the reward functions get).
- **Rows.** ``prompt_ids`` (the segment's context before the first sampled id), ``completion_ids`` (everything
  after: sampled ids and, in a multi-turn episode, the environment's observation ids), ``env_mask`` (the ledger's
  loss mask: 1 on sampled ids, 0 on observation ids; TRL trains on ``completion_mask * env_mask``), ``logprobs``
  (the engine's logprob of each sampled id, stored at generation; 0.0 on observation ids). Extra columns reach the
  reward functions: ``ledger_reward``, ``ledger_task``, ``ledger_task_index`` and ``ledger_episode_id`` (the
  weight version of every sampled id is in the ledger: ``turns.weight_version``, ``version_runs``).
- **Rewards.** ``reward`` returns ``ledger_reward`` (the env's). A member that ended without a trajectory (it
  failed) gets a placeholder row (one eos id, ``env_mask`` 0) and reward None: TRL leaves it out of its group's
  mean and gives it no advantage, so the group keeps its layout and nothing is learned from the gap.
- **Versions.** ``callback()`` saves the weights after every optimizer step (safetensors, with the tokenizer and
  config) as version ``base + global_step`` and announces it (``POST /v1/policy/versions``), returning once every
  inference worker serves it: with ``max_staleness`` 0, step n+1 is sampled by step n's weights.
- **The starting weights.** Step 1 must be sampled by the weights TRL starts from. Version 0 is the model the
  workers started with, the one the trainer is expected to load. Once a trainer has published a version, the
  workers serve that trainer's weights instead. So when the ledger serves a published version, the first
  ``rollout_func`` call first saves TRL's model and announces it as the next version (``sync_start``, the note
  says ``"sync": "start"``), and ``base`` is that version. This is TRL's own rule for its vLLM server (weights are
  synced before the first generation), and it is what lets a run start on a ledger another run trained on.
  ``sync_start=True`` always syncs, ``False`` never.
- **Importance sampling.** TRL applies its mismatch correction only with ``use_vllm=True``, which on its own needs
  TRL's vLLM server and CUDA. ``correct_importance_sampling(trainer)`` switches TRL's correction on against the
  ledger instead: it sets ``use_vllm`` after construction and puts a backend whose ``sync_weights`` does nothing
  (the callback publishes versions) in place of TRL's vLLM client; TRL then computes the old policy's logprobs and
  weights each token by ``exp(old - ledger logprob)``, truncated or masked at its clip bounds, exactly as for its
  own vLLM (``vllm_importance_sampling_mode``: token or sequence level).

Limits: one sequence per sample (TRL's layout): an episode whose context policy re-renders the context has several
segments and is refused with the reason (use the full-history context, or ``unit=turn`` readers elsewhere); a
group whose every member failed has no trajectory and, with ``max_staleness`` > 0, is not delivered (the run waits
for ``timeout_s`` and stops with the cause).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_ledger.client.reader import Batch, Selection, TrajectoryReader
from rollout_ledger.client.rest import LedgerClient, SchedulerError

PREFIX = "ledger_"
"""The extra columns the reward functions get start with it."""


class TrlAdapterError(RuntimeError):
    """The ledger could not feed TRL this step (a batch refused or not done in time, a multi-segment episode)."""


def task_text(task: Any) -> str:
    """A task as the ``prompt`` TRL samples (canonical JSON: sorted keys)."""
    return json.dumps(task, sort_keys=True, separators=(",", ":"))


def task_dataset(tasks: Sequence[Any]) -> Any:
    """A ``datasets.Dataset`` TRL samples from: one ``prompt`` per task, the task as JSON text."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [task_text(t) for t in tasks]})


@dataclass
class Rows:
    """What a ``rollout_func`` returns, row by row (TRL's layout: groups contiguous, ``num_generations`` each)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    env_mask: list[list[int]] = field(default_factory=list)
    reward: list[float | None] = field(default_factory=list)
    task: list[Any] = field(default_factory=list)
    task_index: list[int] = field(default_factory=list)
    episode_id: list[str] = field(default_factory=list)

    def add(self, rec: dict[str, Any], task: Any, task_index: int) -> None:
        self.prompt_ids.append([int(x) for x in rec["prompt_ids"]])
        self.completion_ids.append([int(x) for x in rec["completion_ids"]])
        self.logprobs.append([float(x) for x in rec["logprobs"]])
        self.env_mask.append([int(x) for x in rec["tool_mask"]])
        reward = rec["reward"]
        self.reward.append(None if reward is None or np.isnan(reward) else float(reward))
        self.task.append(task)
        self.task_index.append(task_index)
        self.episode_id.append(str(rec["episode_id"]))

    def add_missing(self, prompt_ids: list[int], eos_id: int, task: Any, task_index: int, episode_id: str) -> None:
        """A member without a trajectory: one eos id, nothing trained, reward None (left out of the group)."""
        self.prompt_ids.append(list(prompt_ids))
        self.completion_ids.append([eos_id])
        self.logprobs.append([0.0])
        self.env_mask.append([0])
        self.reward.append(None)
        self.task.append(task)
        self.task_index.append(task_index)
        self.episode_id.append(episode_id)

    def output(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "logprobs": self.logprobs,
                "env_mask": self.env_mask, f"{PREFIX}reward": self.reward, f"{PREFIX}task": self.task,
                f"{PREFIX}task_index": self.task_index, f"{PREFIX}episode_id": self.episode_id}


def member_of(episode_id: str) -> int:
    """The member (group index) of an episode id ``<batch>.<task>.<member>`` (shared/ids.py)."""
    return int(episode_id.rsplit(".", 1)[1])


def records_of(batch: Batch) -> list[dict[str, Any]]:
    """The ``trl`` records of a delivery, one dict each (arrays as numpy)."""
    cols = batch.numpy()
    n = len(batch)
    out = [{name: cols[name][i] for name in cols} for i in range(n)]
    for rec in out:
        if int(rec["num_samples"]) != 1:
            raise TrlAdapterError(
                f"episode {rec['episode_id']} has {rec['num_samples']} segments (its context was re-rendered): TRL "
                "takes one sequence per sample; run the env with the full-history context policy")
    return out


def arrange(records: Sequence[dict[str, Any]], order: Sequence[tuple[str, Any, int]], group_size: int,
            eos_id: int) -> Rows:
    """TRL's rows: for each ``(group_id, task, task_index)`` of ``order``, its members in order (a missing member
    gets a placeholder row, see the module docstring)."""
    by_group: dict[str, dict[int, dict[str, Any]]] = {}
    for rec in records:
        by_group.setdefault(str(rec["group_id"]), {})[member_of(str(rec["episode_id"]))] = rec
    rows = Rows()
    for group_id, task, task_index in order:
        members = by_group.get(group_id, {})
        if not members:
            raise TrlAdapterError(f"group {group_id} has no trajectory (every member failed)")
        prompt = [int(x) for x in next(iter(members.values()))["prompt_ids"]]
        for m in range(group_size):
            member = members.get(m)
            if member is None:
                rows.add_missing(prompt, eos_id, task, task_index, f"{group_id}.{m}")
            else:
                rows.add(member, task, task_index)
    return rows


class _LedgerBackend:
    """Stands where TRL keeps its vLLM client, for the rollout_func path: the ledger generates, the first call
    syncs the starting weights and the callback publishes the rest, so there is nothing left to sync here."""

    def sync_weights(self) -> None:
        return None


class LedgerRollout:
    """The ``rollout_func``, reward function and callback that make a ``GRPOTrainer`` learn from the ledger (see the
    module docstring)."""

    def __init__(self, scheduler_url: str, database_url: str, env: str, *, checkpoint_dir: str | Path,
                 sampling: dict[str, Any] | None = None, max_turns: int = 1, max_staleness: int = 0,
                 consumer: str | None = None, token: str | None = None, mode: str = "drain",
                 timeout_s: float = 900.0, keep_checkpoints: int = 2, run_id: str | None = None,
                 batch_options: dict[str, Any] | None = None, sync_start: bool | None = None) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.run_id = run_id or uuid.uuid4().hex[:10]
        self.client = LedgerClient(scheduler_url, token, timeout=60.0)
        self.database_url = database_url
        self.env = env
        self.sampling = dict(sampling or {})
        self.max_turns = max_turns
        self.max_staleness = max_staleness
        self.mode = mode
        self.timeout_s = timeout_s
        self.keep_checkpoints = keep_checkpoints
        self.batch_options = dict(batch_options or {})
        self.checkpoint_dir = Path(checkpoint_dir)
        self.consumer = consumer or f"trl-{self.run_id}"
        self.reader = TrajectoryReader(database_url, self.consumer, Selection(complete_groups=True), fmt="trl")
        current = (self.client.policy().get("current") or {}).get("version")
        self.base_version = int(current or 0)
        """The version the run starts from (the synced one, once synced); step s publishes ``base_version + s``."""
        self.version = self.base_version
        self.sync_start = current is not None if sync_start is None else sync_start
        """Whether the first call publishes the trainer's starting weights first (see the module docstring)."""
        self.synced: int | None = None
        """The version the starting weights were published as (None: not synced)."""
        self.calls = 0
        self.stream_batch: str | None = None
        self.steps: list[dict[str, Any]] = []
        """One entry per rollout_func call: batch, groups, mean reward, versions, seconds waited (for logs)."""

    def close(self) -> None:
        self.reader.close()
        self.client.close()

    # --- TRL's rollout_func ----------------------------------------------------------------------------------------

    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: ``len(prompts)`` rows, groups of ``num_generations``."""
        group_size = int(trainer.num_generations)
        if len(prompts) % group_size:
            raise TrlAdapterError(f"{len(prompts)} prompts are not whole groups of {group_size}")
        groups = len(prompts) // group_size
        tasks = [json.loads(str(p)) if isinstance(p, str) else p for p in prompts[::group_size]]
        eos = trainer.processing_class.eos_token_id if hasattr(trainer.processing_class, "eos_token_id") else None
        eos_id = int(eos if eos is not None else 0)
        began = time.monotonic()
        if self.calls == 0 and self.sync_start:
            self._sync_start(trainer)
        self.calls += 1
        if self.max_staleness == 0:
            rows, batch_id = self._on_policy(tasks, group_size, eos_id)
        else:
            rows, batch_id = self._streamed(trainer, tasks, groups, group_size, eos_id)
        rewards = [r for r in rows.reward if r is not None]
        self.steps.append({"call": self.calls, "batch_id": batch_id, "groups": groups, "rows": len(rows.reward),
                           "mean_reward": float(np.mean(rewards)) if rewards else None,
                           "sampled_tokens": int(sum(sum(m) for m in rows.env_mask)),
                           "episodes": list(rows.episode_id),
                           "wait_s": round(time.monotonic() - began, 3)})
        return rows.output()

    def _submit(self, tasks: list[Any], group_size: int, batch_id: str, **extra: Any) -> dict[str, Any]:
        body = {"env": self.env, "tasks": tasks, "group_size": group_size, "max_turns": self.max_turns,
                "batch_id": batch_id, "sampling": self.sampling or None,
                "metadata": {"trainer": "trl", "run": self.run_id, "policy_version": self.version},
                **self.batch_options, **extra}
        try:
            return self.client.submit(**body)
        except SchedulerError as exc:
            raise TrlAdapterError(f"the scheduler refused the batch: {exc}") from exc

    def _on_policy(self, tasks: list[Any], group_size: int, eos_id: int) -> tuple[Rows, str]:
        batch_id = f"trl-{self.run_id}-{self.calls}"
        self._submit(tasks, group_size, batch_id)
        try:
            self.client.wait_batch(batch_id, timeout_s=self.timeout_s)
        except SchedulerError as exc:
            raise TrlAdapterError(str(exc)) from exc
        self.reader.sel = Selection(complete_groups=True, batch_ids=(batch_id,))
        self.reader.batch_size = 1 << 16
        records: list[dict[str, Any]] = []
        for batch in self.reader.batches():  # the whole batch is terminal: everything of it is readable
            records += records_of(batch)
            batch.ack()
        order = [(f"{batch_id}.{i}", task, i) for i, task in enumerate(tasks)]
        return arrange(records, order, group_size, eos_id), batch_id

    def _streamed(self, trainer: Any, tasks: list[Any], groups: int, group_size: int,
                  eos_id: int) -> tuple[Rows, str]:
        if self.stream_batch is None:
            self.stream_batch = f"trl-{self.run_id}"
            every = [json.loads(str(p)) for p in trainer.train_dataset["prompt"]]
            steps = int(trainer.args.max_steps) if int(trainer.args.max_steps) > 0 else max(
                1, int(len(every) * float(trainer.args.num_train_epochs)) // groups)
            run_tasks = [every[i % len(every)] for i in range(steps * groups)]
            self._submit(run_tasks, group_size, self.stream_batch, max_staleness=self.max_staleness,
                         episodes_per_version=groups * group_size)
            self.reader.sel = Selection(complete_groups=True, batch_ids=(self.stream_batch,))
        batch = self.reader.read_groups(groups, timeout_s=self.timeout_s)
        if batch is None:
            raise TrlAdapterError(f"{groups} complete groups of batch {self.stream_batch} not readable after "
                                  f"{self.timeout_s}s")
        records = records_of(batch)
        batch.ack()
        seen: dict[str, tuple[str, Any, int]] = {}
        for rec in records:
            gid = str(rec["group_id"])
            seen.setdefault(gid, (gid, json.loads(str(rec["task"])), int(rec["task_index"])))
        return arrange(records, list(seen.values()), group_size, eos_id), self.stream_batch

    # --- the reward function ---------------------------------------------------------------------------------------

    def reward(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        """The env's reward of each row (None for a member without a trajectory)."""
        rewards: list[float | None] = kwargs[f"{PREFIX}reward"]
        return list(rewards)

    reward.__name__ = "ledger_reward"  # what TRL logs it as

    # --- versions --------------------------------------------------------------------------------------------------

    def publish(self, model: Any, processing_class: Any, step: int) -> float:
        """Save the weights as version ``base_version + step`` and announce it; the seconds until it was served."""
        return self._announce(model, processing_class, self.base_version + step, {"step": step})

    def _sync_start(self, trainer: Any) -> None:
        """Publish the weights TRL starts from as the next version, before anything is sampled for this run."""
        accelerator = getattr(trainer, "accelerator", None)
        model = accelerator.unwrap_model(trainer.model) if accelerator is not None else trainer.model
        version = self.base_version + 1
        self._announce(model, getattr(trainer, "processing_class", None), version, {"step": 0, "sync": "start"})
        self.base_version = self.synced = version

    def _announce(self, model: Any, processing_class: Any, version: int, notes: dict[str, Any]) -> float:
        final = self.checkpoint_dir / f"v{version}"
        partial = self.checkpoint_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        model.save_pretrained(str(partial), safe_serialization=True)
        if processing_class is not None:
            processing_class.save_pretrained(str(partial))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        try:
            took = self.client.publish_version(version, final, mode=self.mode, timeout_s=self.timeout_s,
                                               notes=json.dumps({"trainer": "trl", "run": self.run_id, **notes}))
        except SchedulerError as exc:
            raise TrlAdapterError(f"version {version}: {exc}") from exc
        self.version = version
        self._prune()
        return took

    def _prune(self) -> None:
        kept = sorted((p for p in self.checkpoint_dir.glob("v*") if p.name[1:].isdigit()),
                      key=lambda p: int(p.name[1:]))
        for old in kept[:-self.keep_checkpoints] if self.keep_checkpoints > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def callback(self) -> Any:
        """A ``transformers.TrainerCallback`` that publishes a version after every optimizer step."""
        from transformers import TrainerCallback

        ledger = self

        class LedgerVersions(TrainerCallback):
            """Saves and announces each optimizer step's weights, returning once every worker serves them."""

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                            processing_class: Any = None, **kwargs: Any) -> None:
                if model is not None and state.is_world_process_zero:
                    took = ledger.publish(model, processing_class, int(state.global_step))
                    if ledger.steps:
                        ledger.steps[-1]["published"] = ledger.version
                        ledger.steps[-1]["serve_s"] = round(took, 3)

        return LedgerVersions()

    # --- importance sampling ---------------------------------------------------------------------------------------

    def correct_importance_sampling(self, trainer: Any, mode: str = "token_truncate", clip_max: float = 3.0,
                                    clip_min: float | None = None) -> None:
        """Switch on TRL's importance-sampling (mismatch) correction against the ledger's stored logprobs (see
        the module docstring): ``mode`` is TRL's ``vllm_importance_sampling_mode``."""
        trainer.use_vllm = True
        trainer.vllm_generation = _LedgerBackend()
        trainer._last_loaded_step = -1
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = mode
        trainer.vllm_importance_sampling_clip_max = clip_max
        trainer.vllm_importance_sampling_clip_min = clip_min
