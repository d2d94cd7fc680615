"""TRL generating itself against TRL fed by the ledger (issue 26's benchmark): seconds per optimizer step and
sampled tokens per second, on the same model (SmolLM2-135M-Instruct, float32), batch (``--num-tasks`` groups of
``--group-size`` completions a step) and completion length (every completion exactly ``--tokens`` ids: min = max on
both sides, so both sample the same number of tokens).

- **self**: TRL's ``GRPOTrainer`` with ``use_vllm=False``: it generates with transformers ``generate`` on the CPU
  (TRL's path without a vLLM server), on the very prompts the ledger rendered for the same tasks, with a local
  reward (a stand-in: the benchmark times steps, not learning).
- **ledger**: the same TRL fed by the ledger (examples/trl/train.py, the client's TRL adapter), the stack on vLLM
  (CPU): generation on the ledger's inference worker, TRL's step, the checkpoint saved, announced and served before
  the next step (on-policy, ``max_staleness`` 0); ``--staleness 1`` adds a run where the ledger generates the next
  step while TRL trains.

Both run on this machine's CPU one after the other; the first step of each (warm-up: compilation, caches) is left
out and the median of the rest is reported. Target: steps at least 3x faster with the ledger.

    python -m bench.trl_steps                    # ~5 minutes
    python -m bench.trl_steps --steps 4 --tokens 128
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def ledger_run(steps: int, num_tasks: int, group_size: int, tokens: int, staleness: int) -> dict[str, Any]:
    """TRL fed by the ledger: per-step seconds and the prompts the env rendered (for the self-generating run)."""
    import psycopg
    from rich.console import Console

    from rollout_ledger.cli.demo import run_trl_demo
    from rollout_ledger.client.source import libpq_url

    seen: dict[str, Any] = {}

    def inspect(stack: Any, results: list[dict[str, Any]]) -> None:
        seen["results"] = results
        with psycopg.connect(libpq_url(stack.infra.database_url)) as conn:
            seen["prompts"] = [r[0] for r in conn.execute(
                "SELECT DISTINCT ON (batch_id, task_index) prompt_text FROM episodes ORDER BY batch_id, task_index")]
            seen["sampled"] = conn.execute(
                "SELECT avg(num_sampled_tokens) FROM trajectories").fetchone()[0]

    console = Console(width=200, quiet=True)
    code = run_trl_demo(steps=steps, num_tasks=num_tasks, group_size=group_size, console=console, inspect=inspect,
                        trainer_args=("--max-tokens", str(tokens), "--min-tokens", str(tokens),
                                      "--max-staleness", str(staleness)))
    if code != 0:
        raise SystemExit(f"the ledger-fed TRL run failed (exit {code}); run `rollout demo --trl` to see why")
    step_s = [float(r["step_s"]) for r in seen["results"]]
    return {"step_s": step_s, "prompts": seen["prompts"], "sampled_per_completion": float(seen["sampled"]),
            "detail": seen["results"]}


def self_run(steps: int, num_tasks: int, group_size: int, tokens: int, prompts: list[str]) -> dict[str, Any]:
    """TRL generating with transformers on the CPU: per-step seconds."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_ledger.shared.kit.settings import default_model_dir

    model_dir = os.environ.get("ROLLOUT_MODEL") or str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lengths: list[int] = []

    def reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        lengths.extend(len(c) for c in completion_ids)
        return [float("4" in str(c)) for c in completions]  # a stand-in reward (see the module docstring)

    marks: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append(time.monotonic())

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=num_tasks * group_size, num_generations=group_size,
            max_steps=steps, learning_rate=2e-5, max_completion_length=tokens, temperature=1.0, beta=0.0, seed=1,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, use_vllm=False,
            dataloader_num_workers=0, disable_tqdm=True,
            generation_kwargs={"min_new_tokens": tokens, "max_new_tokens": tokens})
        data = [prompts[i % len(prompts)] for i in range(steps * num_tasks)]
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward,
                              train_dataset=Dataset.from_dict({"prompt": data}), args=config, callbacks=[Clock()])
        began = time.monotonic()
        trainer.train()
    edges = [began, *marks]
    return {"step_s": [b - a for a, b in itertools.pairwise(edges)],
            "sampled_per_completion": float(statistics.mean(lengths)) if lengths else 0.0}


def summary(name: str, run: dict[str, Any], completions: int) -> dict[str, float]:
    timed = run["step_s"][1:] or run["step_s"]
    step = statistics.median(timed)
    tokens = run["sampled_per_completion"] * completions
    print(f"{name:<22} {step:8.2f} s/step   {tokens / step:8.1f} sampled tokens/s   "
          f"(steps: {', '.join(f'{s:.1f}' for s in run['step_s'])}; {run['sampled_per_completion']:.0f} ids each)")
    return {"step_s": step, "tokens_per_s": tokens / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--num-tasks", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--staleness", type=int, default=None, help="also a run with this max_staleness")
    a = p.parse_args()
    completions = a.num_tasks * a.group_size
    print(f"TRL GRPO steps: {a.num_tasks} tasks x {a.group_size} = {completions} completions of {a.tokens} ids, "
          f"SmolLM2-135M-Instruct float32, {os.cpu_count()} CPUs; median of steps 2..{a.steps}")
    ledger = ledger_run(a.steps, a.num_tasks, a.group_size, a.tokens, 0)
    self_gen = self_run(a.steps, a.num_tasks, a.group_size, a.tokens, ledger["prompts"])
    rows = {"TRL generating itself": summary("TRL generating itself", self_gen, completions),
            "TRL fed by the ledger": summary("TRL fed by the ledger", ledger, completions)}
    if a.staleness:
        ahead = ledger_run(a.steps, a.num_tasks, a.group_size, a.tokens, a.staleness)
        rows[f"ledger, staleness {a.staleness}"] = summary(f"ledger, staleness {a.staleness}", ahead, completions)
    base = rows["TRL generating itself"]["step_s"]
    for name, r in rows.items():
        if name != "TRL generating itself":
            print(f"{name}: steps {base / r['step_s']:.1f}x faster than TRL generating itself (target >= 3x)")


if __name__ == "__main__":
    main()
