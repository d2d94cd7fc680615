"""verl's side of tests/integration/test_verl_adapter.py: runs in ``.venv-verl`` (``make verl``: verl 0.9.1 on CPU
torch) as ``python -m tests.verl_driver``, against a ledger the test started, and writes what verl made to a JSON
file for the test to check against the ledger's store.

Everything that touches the adapter is verl's own code: its generated trainer config, ``RLHFDataset`` and
``collate_fn`` over a Parquet file, the trainer's uid, ``_get_gen_batch`` and interleaved repeat
(``RayPPOTrainer``), ``AgentLoopManager.generate_sequences`` (the ``priority`` numbering, the split among workers,
the concat) over three real ``AgentLoopWorker`` objects (the agent-loop registry from ``agent_loop_config_path``,
hydra instantiation per sample, ``_agent_loop_postprocess`` padding, ``_postprocess`` into the ``DataProto``), and,
for the weights, ``omega_conf_to_dataclass`` of the checkpoint-engine config, ``import_external_libs`` and
``CheckpointEngineRegistry.new`` as the actor worker builds its engine, and the manager class loaded from
``checkpoint_manager_class`` as the trainer loads it. Only two things stand in for GPU-only parts: the agent-loop
workers are called in this process instead of as Ray actors, and the actor worker group's ``update_weights`` sends
the model's safetensors from disk where an FSDP actor would send ``get_per_tensor_param()``.
"""

from __future__ import annotations

import argparse
import json
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import verl
from omegaconf import OmegaConf
from safetensors import safe_open
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.utils.import_utils import import_external_libs, load_class_from_fqn

N = 3
"""rollout.n: rows per prompt (a GRPO group)."""
WORKERS = 3
"""Agent-loop workers: 2 prompts x 3 rows in 3 chunks of 2 split the first group across two workers."""
SEEDS = (3, 11)
REFUSED = {"target": 500, "low": 1, "high": 100}
"""A task guess-number refuses at reset: its episodes fail before their first turn."""
PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256

REGISTRY = """- name: rollout_ledger
  _target_: rollout_ledger.client.adapters.verl.LedgerAgentLoop
  rollout_ledger:
    env: guess-number
    batch: {max_turns: 3, max_staleness: 0, sampling: {max_tokens: 12}}
"""
"""The agent loop's registry entry (``agent_loop_config_path``), with part of its settings; the URL comes from
``rollout.custom``."""


def config(url: str, model: str, work: Path) -> Any:
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    (work / "agent_loops.yaml").write_text(REGISTRY)
    cfg.actor_rollout_ref.model.path = model
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name = "vllm"
    rollout.n = N
    rollout.prompt_length, rollout.response_length = PROMPT_LENGTH, RESPONSE_LENGTH
    rollout.agent.num_workers = WORKERS
    rollout.agent.agent_loop_config_path = str(work / "agent_loops.yaml")
    rollout.custom = {"rollout_ledger": {"url": url}}
    rollout.checkpoint_engine.backend = "rollout_ledger"
    rollout.checkpoint_engine.custom_backend_module = "rollout_ledger.client.adapters.verl"
    rollout.checkpoint_engine.engine_kwargs = {"rollout_ledger": {
        "url": url, "checkpoint_dir": str(work / "ckpt"), "model_path": model, "shard_mb": 64}}
    rollout.checkpoint_manager_class = "rollout_ledger.client.adapters.verl.LedgerCheckpointManager"
    cfg.data.prompt_key = "prompt"
    return cfg


def dataset(cfg: Any, tokenizer: Any, work: Path, tasks: list[dict[str, Any]], name: str) -> RLHFDataset:
    """Prompts as a verl user writes them: the ledger task as JSON text in ``extra_info``."""
    rows = [{"prompt": [{"role": "user", "content": f"guess a number ({i})"}], "data_source": "ledger",
             "agent_name": "rollout_ledger", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i, "ledger_task": json.dumps(task)}}
            for i, task in enumerate(tasks)]
    path = work / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=cfg.data, processor=None)


def step_batch(data: RLHFDataset, step: int) -> DataProto:
    """What ``RayPPOTrainer.fit`` hands ``generate_sequences`` for one step (ray_trainer.py 1480-1491)."""
    batch = DataProto.from_single_dict(collate_fn([data[i] for i in range(len(data))]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch.batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # uses no trainer state
    gen_batch.meta_info["global_steps"] = step
    return gen_batch.repeat(repeat_times=N, interleave=True)


def manager(cfg: Any, workers: list[AgentLoopWorker]) -> AgentLoopManager:
    """verl's AgentLoopManager over AgentLoopWorker objects of this process (Ray actors in a real run)."""
    mgr = AgentLoopManager(cfg, llm_client=None)
    mgr.agent_loop_workers = [types.SimpleNamespace(generate_sequences=types.SimpleNamespace(
        remote=w.generate_sequences)) for w in workers]
    return mgr


def model_tensors(model: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118  # safe_open is not a mapping
            yield name, f.get_tensor(name)


class ActorGroup:
    """The actor worker group's ``update_weights`` (engine_workers.py 754-766, mode != naive): its checkpoint engine
    sends the actor's per-tensor parameters; here the model's tensors from disk."""

    def __init__(self, engine: Any, model: str) -> None:
        self.engine, self.model, self.modes = engine, model, []

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        self.modes.append(mode)
        return self.engine.send_weights(model_tensors(self.model), global_steps=global_steps)


def rows_of(out: DataProto) -> list[dict[str, Any]]:
    tensors = {k: out.batch[k].tolist() for k in ("prompts", "responses", "response_mask", "input_ids",
                                                  "attention_mask", "position_ids", "rollout_log_probs",
                                                  "rm_scores")}
    keep = [k for k in out.non_tensor_batch if k.startswith("ledger_") or k in ("uid", "__num_turns__", "priority")]
    return [{**{k: v[i] for k, v in tensors.items()},
             **{k: _plain(out.non_tensor_batch[k][i]) for k in keep}} for i in range(len(out))]


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def same_weights(model: str, directory: Path) -> dict[str, Any]:
    written: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            written.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    source = dict(model_tensors(model))
    return {"names_equal": sorted(written) == sorted(source),
            "tensors_equal": all(torch.equal(written[k], v) and written[k].dtype == v.dtype
                                 for k, v in source.items() if k in written),
            "files": sorted(p.name for p in directory.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True, type=Path)
    args = parser.parse_args()
    cfg = config(args.url, args.model, args.work)

    # weights, as RayPPOTrainer.init_workers (ray_trainer.py 967-978) and the actor worker (engine_workers.py 679-688)
    ce_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    import_external_libs(ce_config.custom_backend_module)
    engine = CheckpointEngineRegistry.new(ce_config.backend, is_master=True,
                                          bucket_size=ce_config.update_weights_bucket_megabytes << 20,
                                          **ce_config.engine_kwargs.get(ce_config.backend, {}))
    actors = ActorGroup(engine, args.model)
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "CheckpointEngineManager")
    weights = manager_cls(config=ce_config, actor_wg=actors, replicas=[])

    workers = [AgentLoopWorker(cfg, llm_client=None) for _ in range(WORKERS)]
    agents = manager(cfg, workers)
    data = dataset(cfg, workers[0].tokenizer, args.work, [{"seed": seed} for seed in SEEDS], "train")
    refused = dataset(cfg, workers[0].tokenizer, args.work, [REFUSED], "refused")
    result: dict[str, Any] = {"engine": type(engine).__name__, "manager": type(weights).__name__,
                              "steps": [], "updates": []}
    result["updates"].append(weights.update_weights(0))  # fit() before the first step: the base model
    for step in (1, 2):
        out = agents.generate_sequences(step_batch(data, step))
        result["steps"].append({"step": step, "rows": rows_of(out),
                                "meta": {k: v for k, v in out.meta_info.items() if k != "timing"}})
        result["updates"].append(weights.update_weights(step))
    out = agents.generate_sequences(step_batch(refused, 3))
    text = workers[0].tokenizer.apply_chat_template(list(refused[0]["raw_prompt"]), add_generation_prompt=True,
                                                    tokenize=False)
    result["refused"] = {"rows": rows_of(out), "meta": {k: v for k, v in out.meta_info.items() if k != "timing"},
                         "verl_prompt": workers[0].tokenizer.encode(text, add_special_tokens=False)}
    result["actor_modes"] = actors.modes
    result["checkpoints"] = sorted(p.name for p in (args.work / "ckpt").iterdir())
    result["weights"] = {d: same_weights(args.model, args.work / "ckpt" / d) for d in result["checkpoints"]}
    (args.work / "verl.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
