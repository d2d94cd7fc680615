"""Engine-alone baseline: the same conversations driven straight into one vLLM ``AsyncLLM`` in this process.

The system benchmark sends these requests through scheduler, env workers, NATS and the inference worker; this
one sends them to the engine with nothing around it, so ``system tokens/s / engine-alone tokens/s`` is what the
system costs. The engine is configured exactly as the inference worker configures it (``engine_kwargs`` and
the CPU environment defaults of ``vllm_engine``), warmed up the same way, and every conversation runs its turns
one after another while all conversations run at once (continuous batching), like episodes do.

    python -m bench.engine_direct                        # 16 conversations x 4 turns x 32 tokens, and 16 x 64
    python -m bench.engine_direct --conversations 8 --turns 2 --max-tokens 16

Prints one JSON object: engine start seconds, RSS of this process and its engine processes, and per workload
the generated tokens, wall time, tokens/s, turn latency percentiles and prefix-cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import vllm
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

from bench.engine_efficiency import TOPICS
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.services.inference_worker.vllm_engine import (
    WARMUP_PROMPT_LENS,
    cpu_env_defaults,
    engine_kwargs,
    sampling_params,
)
from rollout_ledger.shared.events import SamplingParams
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from rollout_ledger.shared.kit.settings import default_model_dir

FOLLOW_UPS = ("Tell me more.", "Why is that?", "Give another example.", "Summarise that in one sentence.",
              "What else?", "Continue.")


@dataclass
class Conversation:
    """The first prompt of a conversation and the user text appended after each of its sampled turns."""

    prompt: np.ndarray
    """Ids of the rendered first prompt (ends with the assistant header)."""
    follow_ups: list[np.ndarray] = field(default_factory=list)
    """Ids appended after turn t (a user message and the next assistant header); one per later turn."""


def engine_args_for(model: str, **settings: Any) -> dict[str, Any]:
    """The inference worker's ``AsyncEngineArgs`` keywords for ``model`` (``settings`` as InferenceSettings)."""
    return engine_kwargs(InferenceSettings(engine="vllm", model=model, **settings), current_platform.is_cpu())


def chat_workload(model: str, conversations: int, turns: int) -> tuple[list[Conversation], int | None]:
    """``conversations`` chats of ``turns`` turns with the model's chat template; also the eos id."""
    tok = load_chat_tokenizer(model)
    out = []
    for i in range(conversations):
        topic = TOPICS[i % len(TOPICS)]
        first = tok.encode(tok.render([{"role": "user", "content": f"Write about {topic}."}],
                                      add_generation_prompt=True))
        follow = [tok.encode(f"\n<|im_start|>user\n{FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)]}<|im_end|>\n"
                             "<|im_start|>assistant\n") for t in range(turns - 1)]
        out.append(Conversation(first, follow))
    return out, tok.eos_token_id


async def start_engine(engine_args: dict[str, Any]) -> tuple[Any, float]:
    """A started, warmed-up ``AsyncLLM`` (the CPU defaults applied first) and the seconds it took."""
    if current_platform.is_cpu():
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.update(cpu_env_defaults(InferenceSettings(engine="vllm"), cpus))
    began = time.perf_counter()
    llm = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**engine_args))
    warm = sampling_params(SamplingParams(temperature=0.0, max_tokens=4), 4)
    for n in WARMUP_PROMPT_LENS:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=list(range(100, 100 + n))), warm, f"warm-{n}"):
            pass
    await llm.reset_prefix_cache()
    return llm, time.perf_counter() - began


async def drive(llm: Any, conversations: Sequence[Conversation], sampling: SamplingParams,
                eos_id: int | None = None) -> dict[str, Any]:
    """All conversations at once, each turn after the previous one; returns throughput and latency figures."""
    latencies: list[float] = []
    totals = {"generated": 0, "prompt": 0, "cached": 0}

    async def converse(index: int, conv: Conversation) -> None:
        context = [int(t) for t in conv.prompt.tolist()]
        for turn in range(len(conv.follow_ups) + 1):
            seed = None if sampling.seed is None else sampling.seed + 1000 * index + turn
            params = sampling_params(sampling.model_copy(update={"seed": seed}), sampling.max_tokens)
            began = time.perf_counter()
            final = None
            async for out in llm.generate(TokensPrompt(prompt_token_ids=context), params, uuid.uuid4().hex):
                final = out
            latencies.append(time.perf_counter() - began)
            ids = list(final.outputs[0].token_ids) if final is not None else []
            totals["generated"] += len(ids)
            totals["prompt"] += len(context)
            totals["cached"] += (final.num_cached_tokens or 0) if final is not None else 0
            if turn < len(conv.follow_ups):
                context += ids
                if eos_id is not None and (not ids or ids[-1] != eos_id):
                    context.append(eos_id)
                context += [int(t) for t in conv.follow_ups[turn].tolist()]

    began = time.perf_counter()
    await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    wall = time.perf_counter() - began
    lat = np.asarray(latencies)
    return {
        "conversations": len(conversations),
        "turns_per_conversation": max((len(c.follow_ups) + 1 for c in conversations), default=0),
        "max_tokens": sampling.max_tokens,
        "generated_tokens": totals["generated"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(totals["generated"] / wall, 1) if wall > 0 else None,
        "turns_per_s": round(lat.size / wall, 2) if wall > 0 else None,
        "turn_latency_p50_s": round(float(np.percentile(lat, 50)), 3) if lat.size else None,
        "turn_latency_p95_s": round(float(np.percentile(lat, 95)), 3) if lat.size else None,
        "prompt_tokens": totals["prompt"],
        "cached_prompt_tokens": totals["cached"],
    }


def rss_mib() -> dict[str, float]:
    """RSS of this process and of its engine processes (MiB)."""
    me = psutil.Process()
    children = me.children(recursive=True)
    out = {"this_process": me.memory_info().rss / 2**20,
           "engine_processes": sum(c.memory_info().rss for c in children) / 2**20}
    out["total"] = out["this_process"] + out["engine_processes"]
    return {k: round(v, 1) for k, v in out.items()}


def run_direct(engine_args: dict[str, Any], prompts: Sequence[Conversation | np.ndarray],
               sampling: SamplingParams, eos_id: int | None = None) -> dict[str, Any]:
    """Start an engine with ``engine_args``, drive ``prompts`` (single prompts or conversations) at once, report.

    Call it under ``if __name__ == "__main__":``: vLLM spawns its engine processes.
    """
    conversations = [p if isinstance(p, Conversation) else Conversation(np.asarray(p)) for p in prompts]

    async def run() -> dict[str, Any]:
        llm, start_s = await start_engine(engine_args)
        try:
            result = await drive(llm, conversations, sampling, eos_id)
            result["engine_start_s"] = round(start_s, 2)
            result["rss_mib"] = rss_mib()
            return result
        finally:
            llm.shutdown()

    return asyncio.run(run())


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = engine_args_for(args.model, vllm_max_model_len=args.max_model_len)
    llm, start_s = await start_engine(engine_args)
    try:
        sampling = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
        chats, eos_id = chat_workload(args.model, args.conversations, args.turns)
        multi_turn = await drive(llm, chats, sampling, eos_id)
        await llm.reset_prefix_cache()
        single, _ = chat_workload(args.model, args.conversations, 1)
        single_turn = await drive(llm, single, sampling.model_copy(update={"max_tokens": args.single_max_tokens}),
                                  eos_id)
        return {
            "benchmark": "engine_direct",
            "engine": f"vllm {vllm.__version__} on {current_platform.device_type}",
            "model": args.model,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(),
            "engine_args": {k: v for k, v in engine_args.items() if k != "model"},
            "engine_start_s": round(start_s, 2),
            "rss_mib": rss_mib(),
            "multi_turn": multi_turn,
            "single_turn": single_turn,
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32, help="per turn of the multi-turn workload")
    parser.add_argument("--single-max-tokens", type=int, default=64, help="per request of the single-turn workload")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    print(json.dumps(asyncio.run(_main(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
