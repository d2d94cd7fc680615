"""A GRPO trainer for SmolLM2-135M on the CPU that learns from the ledger: Rollout Ledger is its rollout system.

Each iteration:

1. submits a batch through the REST API (``--num-tasks`` single-digit additions with explicit operands, each
   sampled ``--group-size`` times: one GRPO group per task);
2. waits for it and reads exactly that batch's new complete groups through the consumer cursor (the Python
   ``TrajectoryReader``, a named consumer: each trajectory is delivered once), with GRPO advantages computed by the
   exporter (``rollout_ledger/client/advantages.py``);

   With ``--max-staleness K`` (pipelined) it instead submits ONE batch for the whole run, bounded at admission
   (``max_staleness`` K, ``episodes_per_version`` one iteration's episodes): the scheduler starts the next
   iteration's episodes while the trainer trains, at most K versions ahead of it, and each iteration reads the
   next ``--num-tasks`` complete groups through the cursor. The truncated importance weight of step 4 corrects
   for the tokens sampled by older weights;
3. recomputes every sampled token's logprob with the trainer's current weights (transformers, float32; only the
   sampled positions go through the vocabulary projection) and records the trainer-vs-inference gap of the
   trajectories sampled by those very weights in ``logprob_audits`` (``source = 'trainer'``);
4. takes clipped policy-gradient steps on the loss-mask-1 tokens, each token weighted by the truncated importance
   ratio ``min(exp(trainer_old_logprob - inference_logprob), C)`` (the trainer-inference mismatch correction);
5. saves a safetensors checkpoint (float32, the tokenizer and config of the served model beside it) outside the
   source tree, announces it as the next policy version (``POST /v1/policy/versions``, mode drain) and waits until
   every inference worker serves it (``GET /v1/policy``) before the next iteration.

It prints one line per iteration: the version that generated the batch, episodes, mean reward, staleness (the
trainer's version minus the oldest token version), the trainer-vs-inference logprob gap, the version pushed and
how long it took to serve. Run it against a running stack (``rollout up``), or let ``rollout demo --rl``
(``make demo-rl``) start one::

    python examples/grpo/train.py --scheduler-url http://127.0.0.1:8000 --database-url "$DATABASE_URL"

README.md beside this file says what it learns and why it is not TRL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before torch loads: OpenMP threads that spin while waiting make every step ~10x slower whenever another process
# (the inference worker's engine, another job) wants the same cores, as on a 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import psycopg
import torch
from transformers import AutoModelForCausalLM

from rollout_ledger.client import Batch, LedgerClient, SchedulerError, Selection, TrajectoryReader
from rollout_ledger.client.audits import AuditRow, stats, write_rows
from rollout_ledger.client.source import libpq_url
from rollout_ledger.shared.kit.settings import default_model_dir

ENV = "arithmetic"
"""The task: ``rollout_ledger/services/envs/arithmetic.py`` with explicit operands (``{"a", "b", "op"}``)."""
TIED_HEAD = "lm_head.weight"
"""Not saved when the model ties it to the embedding (the checkpoint has the embedding only, as the original)."""


@dataclass
class Config:
    """What one training run does (the command-line options)."""

    scheduler_url: str = "http://127.0.0.1:8000"
    database_url: str = ""
    model: str = ""
    """The weights the inference workers started with (version 0); default ROLLOUT_MODEL or the cached model."""
    out: str = ""
    """Where checkpoints go; default a new temporary directory (never the source tree)."""
    iterations: int = 6
    num_tasks: int = 8
    group_size: int = 4
    max_tokens: int = 16
    temperature: float = 1.0
    lr: float = 2e-5
    minibatches: int = 2
    """Optimizer steps per iteration (the iteration's trajectories split into this many parts)."""
    micro_batch: int = 8
    """Trajectories per forward pass."""
    clip_eps: float = 0.2
    """PPO clip of the ratio new/old (old: the trainer's weights before this iteration's first step)."""
    is_cap: float = 2.0
    """C: the truncated importance weight min(exp(trainer_old - inference), C)."""
    max_grad_norm: float = 1.0
    max_staleness: int | None = None
    """Set: the pipelined mode. ONE batch for the whole run, bounded at admission with ``max_staleness`` k and
    ``episodes_per_version`` = ``num_tasks`` x ``group_size``: the scheduler lets generation run at most k versions
    ahead of the trainer (k = 0: each step's episodes start once the workers serve the version the trainer just
    pushed), and each iteration reads the next ``num_tasks`` complete groups through the cursor. Unset: one batch
    per iteration, submitted once every worker serves the trainer's weights (always on-policy)."""
    mode: str = "drain"
    consumer: str = ""
    """The cursor's consumer name; default grpo-<run id>."""
    keep_checkpoints: int = 2
    """Older checkpoints are deleted once a newer version serves (the one being served is always kept)."""
    seed: int = 0
    token: str | None = None
    timeout_s: float = 900.0
    """Longest wait for a batch, for the feed, or for the workers to serve a version."""
    metrics_out: str = ""
    """Append one JSON object per iteration to this file."""
    threads: int = 0
    """torch threads (0: every CPU)."""


@dataclass
class Trajectory:
    """What the trainer keeps of one delivered trajectory."""

    episode_id: str
    attempt: int
    batch_id: str
    group_id: str
    reward: float
    advantage: float
    token_ids: np.ndarray
    segments: list[list[int]]
    positions: np.ndarray
    """Loss-mask-1 positions (sampled tokens)."""
    inference_logprobs: np.ndarray
    """The engine's logprobs of the sampled tokens, stored with the trajectory."""
    versions: np.ndarray
    """The weight version of each sampled token."""


@dataclass
class IterationResult:
    """One iteration, as printed and written to ``--metrics-out``."""

    iteration: int
    batch_id: str
    version: int
    """The trainer's weights (and the workers') when the batch was submitted."""
    episodes: int
    trajectories: int
    mean_reward: float
    token_versions: list[int]
    staleness: int
    """The trainer's version minus the oldest version of a sampled token it read."""
    on_policy: int
    """Trajectories whose every token came from the trainer's current weights (the gap is measured on them, and
    each gets a ``logprob_audits`` row)."""
    trained_trajectories: int
    """Trajectories with a non-zero advantage (the others' groups had equal rewards)."""
    gap_mean: float | None
    gap_max: float | None
    audit_rows: int
    trained_tokens: int
    loss: float
    clip_fraction: float
    is_weight_mean: float
    grad_norm: float
    pushed_version: int
    checkpoint: str
    generate_s: float
    train_s: float
    save_s: float
    serve_s: float
    """From the announcement to every inference worker serving the new version."""
    iteration_s: float

    def line(self) -> str:
        gap = ("gap n/a (no trajectory of the trainer's weights)" if self.gap_mean is None else
               f"gap mean {self.gap_mean:.1e} max {self.gap_max:.1e} ({self.on_policy} on v{self.version})")
        return (f"iter {self.iteration:>2}  v{self.version}  episodes {self.episodes:>3}  reward {self.mean_reward:.3f}"
                f"  staleness {self.staleness}  {gap}  -> v{self.pushed_version} serving in {self.serve_s:.1f}s"
                f"  [generate {self.generate_s:.1f}s, train {self.train_s:.1f}s, save {self.save_s:.1f}s]")


class TrainerError(RuntimeError):
    """The run cannot go on (the scheduler refused, the workers did not serve a version, nothing to read)."""


def addition_tasks(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` single-digit additions with explicit operands (SmolLM2-135M-Instruct solves 1 in 6 to 1 in 3 at
    temperature 1, in 16 tokens)."""
    return [{"a": rng.randint(0, 9), "b": rng.randint(0, 9), "op": "+"} for _ in range(n)]


def token_logprobs(model: Any, trajectories: Sequence[Trajectory], pad_id: int = 0) -> list[torch.Tensor]:
    """For each trajectory, log p(token_ids[t] | its segment up to t) for each t in its ``positions`` (each segment
    its own context, as it was sampled), float32, differentiable when grad is on.

    One forward pass for all of them: every segment is a row, padded on the right (under a causal mask no real
    token sees a padding token, so no attention mask is needed and each row's values are its own). Only the hidden
    states before the sampled positions go through the vocabulary projection."""
    rows: list[np.ndarray] = []
    row_of: list[int] = []
    column: list[int] = []
    target: list[int] = []
    owner: list[tuple[int, int]] = []
    """(trajectory, index into its positions) of each gathered value."""
    for k, t in enumerate(trajectories):
        placed = 0
        for start, end in t.segments:
            inside = [j for j, pos in enumerate(t.positions.tolist()) if start < pos < end]
            if not inside:
                continue
            for j in inside:
                row_of.append(len(rows))
                column.append(int(t.positions[j]) - start - 1)
                target.append(int(t.token_ids[t.positions[j]]))
                owner.append((k, j))
            rows.append(t.token_ids[start:end])
            placed += len(inside)
        if placed != t.positions.size:
            raise TrainerError(f"episode {t.episode_id}: {t.positions.size - placed} sampled positions lie outside "
                               "every segment")
    if not rows:
        return [torch.zeros(0) for _ in trajectories]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.from_numpy(r.astype(np.int64))
    hidden = model.model(input_ids=ids).last_hidden_state
    picked = hidden[torch.tensor(row_of), torch.tensor(column)]
    logprobs = torch.log_softmax(model.lm_head(picked).float(), dim=-1)
    values = logprobs.gather(1, torch.tensor(target)[:, None])[:, 0]
    out: list[list[int]] = [[0] * t.positions.size for t in trajectories]
    for flat, (k, j) in enumerate(owner):
        out[k][j] = flat
    return [values[torch.tensor(idx, dtype=torch.long)] for idx in out]


def chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def grpo_loss(new: torch.Tensor, old: torch.Tensor, inference: torch.Tensor, advantage: float, clip_eps: float,
              is_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped policy-gradient loss (summed, not averaged), weighted by the truncated importance ratio
    between the trainer's old logprobs and the engine's."""
    ratio = torch.exp(new - old)
    adv = torch.full_like(new, advantage)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    weight = torch.clamp(torch.exp(old - inference), max=is_cap)
    loss = -(weight * torch.minimum(unclipped, clipped)).sum()
    info = {"clipped": float((clipped < unclipped).sum()), "weight_sum": float(weight.sum())}
    return loss, info


class Trainer:
    """The loop (see the module docstring). ``echo`` prints its lines."""

    def __init__(self, config: Config, echo: Callable[[str], None] = print) -> None:
        self.cfg = config
        self.echo = echo
        self.run_id = uuid.uuid4().hex[:8]
        self.rng = random.Random(config.seed)
        torch.manual_seed(config.seed)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.ledger = LedgerClient(config.scheduler_url, config.token, timeout=60.0)
        self.base = Path(config.model or os.environ.get("ROLLOUT_MODEL") or default_model_dir())
        self.out = Path(config.out) if config.out else Path(tempfile.mkdtemp(prefix="rollout-grpo-"))
        self.out.mkdir(parents=True, exist_ok=True)
        current = self._policy().get("current")
        self.version = int(current["version"]) if current else 0
        self.checkpoint = str(current["checkpoint"]) if current else str(self.base)
        """The weights of ``self.version``: what the trainer starts from and what the workers serve."""
        self.echo(f"trainer {self.run_id}: starting from policy version {self.version} ({self.checkpoint}); "
                  f"checkpoints in {self.out}")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.float32).eval()
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                                           weight_decay=0.0)
        self.selection = Selection(complete_groups=True)
        self.reader = TrajectoryReader(config.database_url, consumer=config.consumer or f"grpo-{self.run_id}",
                                       selection=self.selection, fmt="full", start="latest")
        self.saved: list[Path] = []
        self.stream: str | None = None
        """The pipelined mode's one batch (``max_staleness`` set)."""

    def close(self) -> None:
        self.reader.close()
        self.ledger.close()

    # --- the scheduler -------------------------------------------------------------------------------------------

    def _policy(self) -> dict[str, Any]:
        try:
            return self.ledger.policy()
        except SchedulerError as exc:
            raise TrainerError(str(exc)) from exc

    def submit(self, iteration: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "env": ENV, "tasks": addition_tasks(self.rng, self.cfg.num_tasks), "group_size": self.cfg.group_size,
            "max_turns": 1, "batch_id": f"grpo-{self.run_id}-{iteration}",
            "sampling": {"temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens},
            "metadata": {"trainer": f"grpo-{self.run_id}", "iteration": iteration, "policy_version": self.version},
        }
        return self._submit(body)

    def _submit(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.ledger.submit(**body)
        except SchedulerError as exc:
            raise TrainerError(str(exc)) from exc

    def submit_stream(self) -> dict[str, Any]:
        """The pipelined mode's one batch: every iteration's tasks, admitted ``num_tasks`` groups per version."""
        k = self.cfg.max_staleness
        body: dict[str, Any] = {
            "env": ENV, "tasks": addition_tasks(self.rng, self.cfg.num_tasks * self.cfg.iterations),
            "group_size": self.cfg.group_size, "max_turns": 1, "batch_id": f"grpo-{self.run_id}",
            "sampling": {"temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens},
            "max_staleness": k, "episodes_per_version": self.cfg.num_tasks * self.cfg.group_size,
            "metadata": {"trainer": f"grpo-{self.run_id}", "policy_version": self.version},
        }
        created = self._submit(body)
        self.echo(f"batch {created['batch_id']}: {created['num_episodes']} episodes, max_staleness {k}: "
                  f"{created['num_published']} admitted now, {created['num_waiting']} waiting for the trainer")
        return created

    def wait_batch(self, batch_id: str) -> dict[str, Any]:
        try:
            return self.ledger.wait_batch(batch_id, timeout_s=self.cfg.timeout_s)
        except SchedulerError as exc:
            raise TrainerError(str(exc)) from exc

    def push(self, version: int, checkpoint: Path, notes: dict[str, Any]) -> float:
        """Announce ``checkpoint`` as ``version`` and wait until every inference worker serves it (seconds)."""
        try:
            return self.ledger.publish_version(version, checkpoint, mode=self.cfg.mode, notes=json.dumps(notes),
                                               timeout_s=self.cfg.timeout_s)
        except SchedulerError as exc:
            raise TrainerError(str(exc)) from exc

    def wait_serving(self, version: int) -> None:
        """Until every inference worker reporting in ``GET /v1/policy`` (at least one) serves ``version``."""
        try:
            self.ledger.wait_served(version, timeout_s=self.cfg.timeout_s)
        except SchedulerError as exc:
            raise TrainerError(str(exc)) from exc

    # --- the ledger ----------------------------------------------------------------------------------------------

    def read(self, batch_id: str, expected: int, groups: int | None = None) -> list[Trajectory]:
        """The batch's complete groups through the consumer cursor (acknowledged as read): ``expected``
        trajectories, or with ``groups`` exactly that many groups (``TrajectoryReader.read_groups``)."""
        self.reader.sel = dataclasses.replace(self.selection, batch_ids=(batch_id,))
        out: list[Trajectory] = []
        if groups is not None:
            batch = self.reader.read_groups(groups, timeout_s=self.cfg.timeout_s)
            if batch is None:
                raise TrainerError(f"{groups} complete groups of batch {batch_id} not readable after "
                                   f"{self.cfg.timeout_s}s")
            out += self._trajectories(batch)
            return out
        delivered = 0
        deadline = time.monotonic() + self.cfg.timeout_s
        while delivered < expected:
            got = self.reader.next_batch()
            if got is None:
                if time.monotonic() > deadline:
                    if delivered:
                        break
                    raise TrainerError(f"nothing of batch {batch_id} readable after {self.cfg.timeout_s}s")
                time.sleep(0.2)
                continue
            delivered += len(got)
            out += self._trajectories(got)
        return out

    @staticmethod
    def _trajectories(batch: Batch) -> list[Trajectory]:
        """The trainable trajectories of a delivery (acknowledged: the cursor moves past it)."""
        cols = batch.numpy()
        out: list[Trajectory] = []
        for i in range(len(batch)):
            mask = np.asarray(cols["loss_mask"][i])
            positions = np.flatnonzero(mask == 1)
            if positions.size == 0 or cols["advantage"][i] is None or np.isnan(cols["advantage"][i]):
                continue
            out.append(Trajectory(
                episode_id=str(cols["episode_id"][i]), attempt=int(cols["attempt"][i]),
                batch_id=str(cols["batch_id"][i]), group_id=str(cols["group_id"][i]),
                reward=float(cols["reward"][i]), advantage=float(cols["advantage"][i]),
                token_ids=np.asarray(cols["token_ids"][i], dtype=np.int64),
                segments=[list(s) for s in cols["segments"][i]], positions=positions,
                inference_logprobs=np.asarray(cols["logprobs"][i], dtype=np.float32)[positions],
                versions=np.asarray(cols["weight_versions"][i])[positions]))
        batch.ack()
        return out

    def engines(self, trajectories: list[Trajectory]) -> dict[str, str]:
        """Episode id -> the engine(s) that generated its kept turns."""
        sql = ("SELECT episode_id, string_agg(DISTINCT engine, ',') FROM turns WHERE episode_id = ANY(%s) "
               "AND NOT superseded GROUP BY episode_id")
        with psycopg.connect(libpq_url(self.cfg.database_url)) as conn:
            rows = conn.execute(sql, ([t.episode_id for t in trajectories],)).fetchall()
        return {str(r[0]): str(r[1] or "") for r in rows}

    # --- the step ------------------------------------------------------------------------------------------------

    def train(self, trajectories: list[Trajectory]) -> dict[str, Any]:
        """Recompute, audit (every trajectory), and take the clipped policy-gradient steps on the trajectories with
        a non-zero advantage (a group whose rewards are all equal teaches GRPO nothing); what it measured.

        The "old" logprobs (the trainer's weights before this iteration's first step, which are the weights that
        sampled the batch) of the first part are its own forward pass, detached; the other parts' are computed
        without grad before the first step."""
        model = self.model
        model.eval()  # no dropout in SmolLM2 anyway; gradients flow in eval mode
        trainable = [t for t in trajectories if t.advantage != 0.0]
        others = [t for t in trajectories if t.advantage == 0.0]
        self.rng.shuffle(trainable)
        parts = [list(p) for p in np.array_split(np.arange(len(trainable)), self.cfg.minibatches) if p.size]
        old: dict[int, torch.Tensor] = {}
        untrained: list[tuple[Trajectory, torch.Tensor]] = []
        micro = self.cfg.micro_batch
        with torch.no_grad():
            for part in parts[1:]:
                for chunk in chunks(part, micro):
                    old.update(zip(chunk, token_logprobs(model, [trainable[i] for i in chunk]), strict=True))
            for chunk in chunks(list(range(len(others))), micro):  # for the audit only
                batch = [others[i] for i in chunk]
                untrained.extend(zip(batch, token_logprobs(model, batch), strict=True))
        losses: list[float] = []
        norms: list[float] = []
        clipped = weight_sum = 0.0
        tokens = 0
        for part in parts:
            self.optimizer.zero_grad(set_to_none=True)
            part_tokens = sum(int(trainable[i].positions.size) for i in part)
            total = 0.0
            for chunk in chunks(part, micro):
                news = token_logprobs(model, [trainable[i] for i in chunk])
                loss = torch.zeros(())
                for i, new in zip(chunk, news, strict=True):
                    t = trainable[i]
                    if i not in old:
                        old[i] = new.detach()
                    inference = torch.from_numpy(t.inference_logprobs.astype(np.float32))
                    one, info = grpo_loss(new, old[i], inference, t.advantage, self.cfg.clip_eps, self.cfg.is_cap)
                    loss = loss + one
                    clipped += info["clipped"]
                    weight_sum += info["weight_sum"]
                (loss / part_tokens).backward()
                total += loss.item() / part_tokens
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)))
            self.optimizer.step()
            losses.append(total)
            tokens += part_tokens
        audit, gap = self.audit([(trainable[i], old[i]) for i in sorted(old)] + untrained)
        return {
            "on_policy": len(audit), "audit_rows": len(audit), "trained_trajectories": len(trainable),
            "trained_tokens": tokens,
            "gap_mean": float(gap.mean()) if gap is not None else None,
            "gap_max": float(gap.max()) if gap is not None else None,
            "loss": float(np.mean(losses)) if losses else 0.0,
            "clip_fraction": clipped / tokens if tokens else 0.0,
            "is_weight_mean": weight_sum / tokens if tokens else 0.0,
            "grad_norm": float(np.mean(norms)) if norms else 0.0,
        }

    def audit(self, recomputed: list[tuple[Trajectory, torch.Tensor]]) -> tuple[list[AuditRow], np.ndarray | None]:
        """Rows of ``logprob_audits`` (source 'trainer') for the trajectories whose every token was sampled by the
        trainer's weights before the step (``self.version``), written; the |Δ| of all their tokens."""
        own = [(t, lp) for t, lp in recomputed if bool((t.versions == self.version).all())]
        if not own:
            return [], None
        engines = self.engines([t for t, _ in own])
        rows: list[AuditRow] = []
        deltas: list[np.ndarray] = []
        for t, lp in own:
            mine = lp.double().numpy()
            deltas.append(np.abs(mine - t.inference_logprobs.astype(np.float64)))
            mean, p99, worst = stats(mine, t.inference_logprobs)
            rows.append(AuditRow(t.episode_id, t.attempt, t.batch_id, "trainer", self.checkpoint,
                                 engines.get(t.episode_id, ""), self.version, self.version, int(t.positions.size),
                                 mean, p99, worst, mine.astype(np.float32).tolist()))
        write_rows(self.cfg.database_url, rows)
        return rows, np.concatenate(deltas)

    def save(self, version: int) -> Path:
        """The current weights as a Hugging Face directory: float32 safetensors (without the tied head, like the
        original) and every other file of the served model (config, tokenizer), written then renamed."""
        from safetensors.torch import save_file

        final = self.out / f"v{version}"
        partial = self.out / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for path in self.base.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
                shutil.copy(path, partial / path.name)
        tensors = {name: tensor.detach().contiguous() for name, tensor in self.model.state_dict().items()
                   if not (self.tied and name == TIED_HEAD)}
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    def prune(self) -> None:
        """Delete checkpoints beyond the newest ``keep_checkpoints`` (every worker serves the newest)."""
        keep = max(1, self.cfg.keep_checkpoints)
        while len(self.saved) > keep:
            shutil.rmtree(self.saved.pop(0), ignore_errors=True)

    # --- the loop ------------------------------------------------------------------------------------------------

    def iteration(self, n: int) -> IterationResult:
        began = time.monotonic()
        if self.stream is not None:  # pipelined: the next groups of the one batch, admitted by the scheduler
            batch_id = self.stream
            episodes = self.cfg.num_tasks * self.cfg.group_size
            trajectories = self.read(batch_id, episodes, groups=self.cfg.num_tasks)
        else:
            created = self.submit(n)
            batch_id = created["batch_id"]
            episodes = int(created["num_episodes"])
            info = self.wait_batch(batch_id)
            trajectories = self.read(batch_id, int(info["num_trajectories"]))
        generated = time.monotonic()
        if not trajectories:
            raise TrainerError(f"batch {batch_id} gave no trajectory to train on: {info['counts']}")
        measured = self.train(trajectories)
        trained = time.monotonic()
        versions = sorted({int(v) for t in trajectories for v in t.versions.tolist()})
        rewards = [t.reward for t in trajectories]
        result = IterationResult(
            iteration=n, batch_id=batch_id, version=self.version, episodes=episodes,
            trajectories=len(trajectories), mean_reward=float(np.mean(rewards)), token_versions=versions,
            staleness=self.version - min(versions), pushed_version=self.version + 1, checkpoint="",
            generate_s=generated - began, train_s=trained - generated, save_s=0.0, serve_s=0.0, iteration_s=0.0,
            **measured)
        path = self.save(self.version + 1)
        saved = time.monotonic()
        notes = {"trainer": f"grpo-{self.run_id}", "iteration": n, "batch_id": batch_id,
                 "mean_reward": result.mean_reward, "loss": result.loss}
        result.serve_s = self.push(self.version + 1, path, notes)
        self.version += 1
        self.checkpoint = str(path)
        self.saved.append(path)
        self.prune()
        result.checkpoint = str(path)
        result.save_s = saved - trained
        result.iteration_s = time.monotonic() - began
        return result

    def run(self, on_iteration: Callable[[IterationResult], None] | None = None) -> list[IterationResult]:
        self.wait_serving(self.version)
        if self.cfg.max_staleness is not None:
            self.stream = str(self.submit_stream()["batch_id"])
        results: list[IterationResult] = []
        for n in range(1, self.cfg.iterations + 1):
            result = self.iteration(n)
            results.append(result)
            self.echo(result.line())
            if self.cfg.metrics_out:
                with open(self.cfg.metrics_out, "a") as fh:
                    fh.write(json.dumps(dataclasses.asdict(result)) + "\n")
            if on_iteration is not None:
                on_iteration(result)
        return results


def summary(results: list[IterationResult], wall_s: float) -> str:
    if not results:
        return "no iteration ran"
    rewards = " ".join(f"{r.mean_reward:.2f}" for r in results)
    gaps = [r.gap_max for r in results if r.gap_max is not None]
    gap = f"trainer-vs-inference max |Δlogprob| {max(gaps):.1e}; " if gaps else ""
    return (f"{len(results)} iterations, policy v{results[0].version} -> v{results[-1].pushed_version}; "
            f"mean reward per iteration: {rewards}; train {np.mean([r.train_s for r in results]):.1f}s and "
            f"push-to-serving {np.mean([r.serve_s for r in results]):.1f}s per iteration on average; {gap}"
            f"{wall_s:.0f}s in all")


def parse_args(argv: Sequence[str] | None = None) -> Config:
    defaults = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--scheduler-url", default=os.environ.get("ROLLOUT_SCHEDULER_URL", defaults.scheduler_url))
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""),
                   help="Postgres of the ledger (the consumer cursor and logprob_audits); default DATABASE_URL")
    p.add_argument("--model", default="", help="the weights the workers started with (default ROLLOUT_MODEL or "
                                               "the cached SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="", help="checkpoint directory (default: a new temporary directory)")
    p.add_argument("--token", default=os.environ.get("ROLLOUT_API_TOKEN"))
    for name in ("iterations", "num_tasks", "group_size", "max_tokens", "minibatches", "micro_batch",
                 "keep_checkpoints", "seed", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("temperature", "lr", "clip_eps", "is_cap", "max_grad_norm", "timeout_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    p.add_argument("--max-staleness", type=int, default=None,
                   help="pipelined: one batch bounded at admission, generation at most K versions ahead of the "
                        "trainer (unset: a batch per iteration, on-policy)")
    p.add_argument("--mode", default=defaults.mode, choices=("drain", "abort"))
    p.add_argument("--consumer", default="", help="consumer cursor name (default grpo-<run id>)")
    p.add_argument("--metrics-out", default="", help="append one JSON line per iteration to this file")
    args = p.parse_args(argv)
    if not args.database_url:
        p.error("set DATABASE_URL or pass --database-url")
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    began = time.monotonic()
    trainer = Trainer(config, echo=lambda line: print(line, flush=True))
    try:
        results = trainer.run()
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        trainer.close()
    print(summary(results, time.monotonic() - began), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
