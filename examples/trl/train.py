"""TRL's ``GRPOTrainer`` trains SmolLM2-135M-Instruct on the CPU from the ledger: the real trl package (the pinned
``trl`` extra), fed by ``rollout_ledger.client.adapters.trl`` — no generation in TRL, no glue in this script.

The same task as examples/grpo (single-digit additions, env ``arithmetic``, rewards from the env), so the reward
curves compare. Each optimizer step: the ledger generates ``--num-tasks`` groups of ``--group-size`` (on its
inference workers, vLLM under ``make demo-trl``), TRL takes one step (its GRPO loss, with its importance-sampling
correction against the ledger's stored logprobs unless ``--no-importance-sampling``), and the adapter's callback
saves the weights, announces them as the next policy version and returns once every worker serves them. On a
ledger that another run already trained (it serves a published version), the adapter first publishes the weights
this script starts from (``--model``) as the next version, so step 1 is sampled by them.

It prints one line per step (the batch, mean reward, sampled tokens, the version that sampled it, seconds) and
writes them to ``--metrics-out`` (JSON lines). Against a running stack (``rollout up`` prints both URLs)::

    python examples/trl/train.py --scheduler-url http://127.0.0.1:8000 --database-url "$DATABASE_URL" --steps 6

or let ``make demo-trl`` (``rollout demo --trl``) start one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
# TRL checks the vLLM beside it, which it does not use here (the ledger's workers generate)
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollout_ledger.client.adapters.trl import LedgerRollout, task_dataset  # noqa: E402

ENV = "arithmetic"


def addition_tasks(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` single-digit additions with explicit operands (as examples/grpo draws them)."""
    return [{"a": rng.randint(0, 9), "b": rng.randint(0, 9), "op": "+"} for _ in range(n)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scheduler-url", default=os.environ.get("ROLLOUT_SCHEDULER_URL", "http://127.0.0.1:8000"))
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL"))
    p.add_argument("--model", default=os.environ.get("ROLLOUT_MODEL"), help="the served model's HF directory")
    p.add_argument("--out", default=None, help="checkpoints and TRL's output (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (policy versions published)")
    p.add_argument("--num-tasks", type=int, default=8, help="groups per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per task (TRL's num_generations)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=0, help="no end of turn before this many ids (benchmarks: = "
                                                              "--max-tokens for completions of one length)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--max-staleness", type=int, default=0,
                   help="0: on-policy (each step sampled by the previous step's weights); k: the ledger generates "
                        "up to k versions ahead while TRL trains")
    p.add_argument("--no-importance-sampling", action="store_true",
                   help="leave TRL's importance-sampling correction off")
    p.add_argument("--mode", default="drain", choices=("drain", "abort", "keep"), help="how workers swap versions")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if not args.database_url:
        p.error("--database-url (or DATABASE_URL) is required: the trainer reads trajectories from Postgres")
    if not args.model:
        from rollout_ledger.shared.kit.settings import default_model_dir

        args.model = str(default_model_dir())
    return args


class PrintSteps(TrainerCallback):  # type: ignore[misc]
    """One line per optimizer step: the adapter's record of the step and TRL's own log of it (loss, reward, and the
    importance-sampling figures: TRL's recomputed logprobs against the ledger's stored ones)."""

    TRL_KEYS = ("loss", "reward", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                "sampling/importance_sampling_ratio/mean")

    def __init__(self, ledger: LedgerRollout, metrics_out: Path | None) -> None:
        self.ledger = ledger
        self.metrics_out = metrics_out
        self.began = time.monotonic()
        self.pending: dict[str, Any] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = self.ledger.steps[-1] if self.ledger.steps else {}
        self.pending = {
            "step": int(state.global_step), "batch_id": step.get("batch_id"), "groups": step.get("groups"),
            "mean_reward": step.get("mean_reward"), "sampled_tokens": step.get("sampled_tokens"),
            "sampled_by": self.ledger.version - 1 if self.ledger.max_staleness == 0 else None,
            "published": step.get("published"), "wait_s": step.get("wait_s"), "serve_s": step.get("serve_s"),
            "step_s": round(time.monotonic() - self.began, 3), "episodes": step.get("episodes", []),
            "base_version": self.ledger.base_version, "synced": self.ledger.synced}
        self.began = time.monotonic()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if self.pending is None or not logs or "loss" not in logs:
            return
        line, self.pending = self.pending, None
        line["trl"] = {k: logs[k] for k in self.TRL_KEYS if k in logs}
        reward = "-" if line["mean_reward"] is None else f"{line['mean_reward']:.3f}"
        gap = line["trl"].get("sampling/sampling_logp_difference/mean")
        print(f"step {line['step']}: batch {line['batch_id']}, {line['groups']} groups, mean reward {reward}, "
              f"{line['sampled_tokens']} sampled tokens, waited {line['wait_s']}s for the ledger"
              + (f", |trainer - ledger logprob| {gap:.1e}" if gap is not None else "")
              + f"; version {line['published']} served after {line['serve_s']}s; step took {line['step_s']}s",
              flush=True)
        if self.metrics_out is not None:
            with self.metrics_out.open("a") as f:
                f.write(json.dumps(line) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"trl-ledger-{os.getpid()}"
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tasks = addition_tasks(rng, args.steps * args.num_tasks)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ledger = LedgerRollout(args.scheduler_url, args.database_url, ENV, checkpoint_dir=out / "checkpoints",
                           sampling={"temperature": args.temperature, "max_tokens": args.max_tokens,
                                     **({"min_tokens": args.min_tokens} if args.min_tokens else {})},
                           max_staleness=args.max_staleness, mode=args.mode, timeout_s=args.timeout_s)
    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=args.num_tasks * args.group_size,
        num_generations=args.group_size, max_steps=args.steps, learning_rate=args.learning_rate,
        max_completion_length=args.max_tokens, temperature=args.temperature, beta=0.0, seed=args.seed,
        lr_scheduler_type="constant",  # as examples/grpo (TRL's default decays to 0 over max_steps)
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, use_vllm=False,
        dataloader_num_workers=0, disable_tqdm=True)
    metrics = Path(args.metrics_out) if args.metrics_out else None
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=ledger.reward,
                          train_dataset=task_dataset(tasks), args=config, rollout_func=ledger.rollout_func,
                          callbacks=[ledger.callback(), PrintSteps(ledger, metrics)])
    trainer.remove_callback(PrinterCallback)  # TRL's log dicts: the step lines above say what matters
    if not args.no_importance_sampling:
        ledger.correct_importance_sampling(trainer)
    print(f"TRL GRPOTrainer on the ledger: {args.steps} steps of {args.num_tasks} tasks x {args.group_size}, "
          f"max_staleness {args.max_staleness}, starting from version {ledger.base_version}"
          + (f" (the ledger serves another run's weights: TRL's own are published as version "
             f"{ledger.base_version + 1} before step 1)" if ledger.sync_start else ""), flush=True)
    try:
        trainer.train()
    finally:
        ledger.close()
    rewards = [s["mean_reward"] for s in ledger.steps if s["mean_reward"] is not None]
    print("reward per step: " + " ".join(f"{r:.3f}" for r in rewards), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
