"""The vLLM engine with the real SmolLM2 model: answers, token/logprob exactness, batching, limits, abort, cache."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from rollout_ledger.services.inference_worker.engine import Engine, Generation
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import (
    FinishReason,
    InferenceRequested,
    SamplingParams,
    TurnGenerated,
    decode,
    decode_as,
    encode,
)
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from rollout_ledger.shared.subjects import EVENTS_STREAM, event_subject, infer_worker_subject
from tests.helpers import until

if TYPE_CHECKING:
    from tests.e2e.conftest import EngineHost, InProcessWorker

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
STORY = "Write a long story about a dragon who learns to bake bread. Use many details."


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


def chat(tok: ChatTokenizer, *messages: tuple[str, str]) -> np.ndarray:
    return tok.encode(tok.render([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True))


def rid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def check_shape(gen: Generation) -> None:
    n = gen.token_ids.shape[0]
    assert gen.token_ids.dtype == np.int32 and gen.logprobs.dtype == np.float32
    assert gen.logprobs.shape == (n,), "one logprob per sampled id"
    assert np.all(np.isfinite(gen.logprobs)) and np.all(gen.logprobs <= 0.0)


async def test_greedy_answer_mentions_paris(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    prompt = chat(tok, ("user", "What is the capital of France?"))
    gen = await vllm_engine.generate(rid(), prompt, GREEDY, GREEDY.max_tokens)
    check_shape(gen)
    text = tok.decode(gen.token_ids, skip_special_tokens=True)
    assert "Paris" in text, text
    assert gen.finish_reason == FinishReason.STOP
    assert int(gen.token_ids[-1]) == tok.eos_token_id, "a turn ending on eos keeps the eos id, as vLLM returns it"
    assert gen.top_logprobs is None


async def test_many_seeded_requests_with_long_prompts_keep_the_engine_alive(vllm_host: EngineHost,
                                                                             vllm_engine: Engine,
                                                                             tok: ChatTokenizer) -> None:
    """32 requests with their own seeds and prompts too long to prefill in one step together: on CPU vLLM would
    chunk them and kill its engine core ("CPU Generator does not use offset"); ours keeps chunked prefill off
    there, so every request is answered and the engine stays healthy."""
    prompts = [chat(tok, ("user", f"Story {i}: " + "word " * 250)) for i in range(32)]
    sampling = SamplingParams(temperature=1.0, seed=0, max_tokens=8)
    gens = await asyncio.gather(*(vllm_engine.generate(rid("seeded"), p, sampling, 8) for p in prompts))
    assert all(len(g.token_ids) == 8 or g.finish_reason == FinishReason.STOP for g in gens)
    assert vllm_host.engine.healthy


async def test_sampled_ids_and_logprobs_are_vllms_own(vllm_host: EngineHost, tok: ChatTokenizer) -> None:
    """Our Generation equals vLLM's raw output: same ids, text, and each sampled id's logprob read by id."""
    from vllm.inputs import TokensPrompt

    from rollout_ledger.services.inference_worker.vllm_engine import generation_from_output, sampling_params

    engine = vllm_host.engine
    sampling = SamplingParams(temperature=1.3, top_p=0.95, seed=11, logprobs=3, stop=["\n\n\n"])
    prompt = chat(tok, ("user", "Tell me three facts about the moon."))
    max_tokens = 40

    async def raw() -> Any:
        final = None
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt.tolist()),
                                             sampling_params(sampling, max_tokens), rid("raw")):
            final = out
        return final

    final = await vllm_host.call(raw())
    completion = final.outputs[0]
    ids = list(completion.token_ids)
    assert len(completion.logprobs) == len(ids) > 0
    # the sampled ids decode to vLLM's own text
    assert tok.decode(ids, skip_special_tokens=True) == completion.text
    gen = generation_from_output(ids, completion.logprobs, completion.finish_reason, top_k=sampling.logprobs,
                                 cached_tokens=final.num_cached_tokens, request_id="raw")
    check_shape(gen)
    assert gen.token_ids.tolist() == ids
    ranks = []
    for i, tid in enumerate(ids):
        entry = completion.logprobs[i][tid]
        assert gen.logprobs[i] == np.float32(entry.logprob), f"position {i}: sampled id's logprob, by id"
        ranks.append(entry.rank)
        assert gen.top_logprobs is not None and gen.top_logprobs[i][tid] == pytest.approx(entry.logprob)
        assert len(gen.top_logprobs[i]) >= sampling.logprobs
    assert any(r > 1 for r in ranks), f"temperature 1.3 should sample some id below rank 1 in {len(ids)} ids"
    # the engine's own path (same seed) gives the same turn
    again = await vllm_host.call(engine.generate(rid(), prompt, sampling, max_tokens))
    assert again.token_ids.tolist() == ids
    np.testing.assert_allclose(again.logprobs, gen.logprobs, atol=1e-3)


async def test_logprobs_one_per_sampled_id(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    prompt = chat(tok, ("user", "Name a colour."))
    for logprobs in (0, 5):
        sampling = SamplingParams(temperature=1.0, seed=3, logprobs=logprobs)
        gen = await vllm_engine.generate(rid(), prompt, sampling, 24)
        check_shape(gen)
        if logprobs == 0:
            assert gen.top_logprobs is None
        else:
            assert gen.top_logprobs is not None and len(gen.top_logprobs) == gen.token_ids.shape[0]
            for tid, lp, alts in zip(gen.token_ids.tolist(), gen.logprobs.tolist(), gen.top_logprobs, strict=True):
                assert alts[tid] == pytest.approx(lp) and len(alts) >= logprobs
                assert all(v <= 0.0 for v in alts.values())


async def test_max_tokens_finishes_with_length(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    gen = await vllm_engine.generate(rid(), chat(tok, ("user", STORY)), GREEDY, 5)
    assert gen.token_ids.shape[0] == 5 and gen.finish_reason == FinishReason.LENGTH
    check_shape(gen)


async def test_stop_string_finishes_with_stop(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    full = await vllm_engine.generate(rid(), chat(tok, ("user", "What is the capital of France?")), GREEDY, 48)
    text = tok.decode(full.token_ids, skip_special_tokens=True)
    stop = "Paris"
    cut = await vllm_engine.generate(rid(), chat(tok, ("user", "What is the capital of France?")),
                                     GREEDY.model_copy(update={"stop": [stop]}), 48)
    assert cut.finish_reason == FinishReason.STOP
    assert stop not in tok.decode(cut.token_ids[:-1], skip_special_tokens=True)
    assert cut.token_ids.shape[0] < full.token_ids.shape[0], (text, cut.token_ids)


async def test_concurrent_requests_are_batched(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    """16 requests in flight at once finish much faster than 16 one after another.

    The sequential side runs the first ``SEQUENTIAL`` of them and is scaled to 16 (a request's time does not
    depend on how many ran before it; greedy turns of the same length, the prompt prefix cached for all).
    """
    prompts = [chat(tok, ("user", f"{STORY} The dragon's name is {name}."))
               for name in ("Ann", "Bob", "Cid", "Dan", "Eve", "Fay", "Gus", "Hal",
                            "Ida", "Jon", "Kim", "Lou", "Max", "Ned", "Oli", "Pam")]
    sequential_n, n_tokens = 6, 16
    await vllm_engine.generate(rid("seq"), prompts[0], GREEDY, n_tokens)  # caches the shared prefix for both sides
    began = time.perf_counter()
    sequential = [await vllm_engine.generate(rid("seq"), p, GREEDY, n_tokens) for p in prompts[:sequential_n]]
    sequential_16_s = (time.perf_counter() - began) * len(prompts) / sequential_n
    began = time.perf_counter()
    concurrent = await asyncio.gather(*(vllm_engine.generate(rid("con"), p, GREEDY, n_tokens) for p in prompts))
    concurrent_s = time.perf_counter() - began
    assert all(g.token_ids.shape[0] == n_tokens for g in [*sequential, *concurrent])
    print(f"16 x {n_tokens} tokens: sequential ~{sequential_16_s:.2f}s, concurrent {concurrent_s:.2f}s")
    assert concurrent_s < sequential_16_s / 2.5, (sequential_16_s, concurrent_s)


async def test_abort_ends_a_running_request(vllm_host: EngineHost, vllm_engine: Engine, tok: ChatTokenizer) -> None:
    engine = vllm_host.engine
    request_id = rid("abort")
    long = SamplingParams(temperature=1.0, seed=5, max_tokens=3000)
    task = asyncio.create_task(vllm_engine.generate(request_id, chat(tok, ("user", STORY)), long, 3000))
    await until(lambda: request_id in engine.inflight and engine.llm.get_num_unfinished_requests() > 0, 30,
                "the request to be running in vLLM", interval_s=0.01)
    began = time.perf_counter()
    await vllm_engine.abort(request_id)
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason == FinishReason.ABORT
    assert gen.token_ids.shape[0] < 3000 and gen.logprobs.shape == gen.token_ids.shape
    assert time.perf_counter() - began < 5
    assert request_id not in engine.inflight
    await vllm_engine.abort(request_id)  # unknown or finished: a no-op
    await vllm_engine.abort("never-seen")


async def test_request_timeout_aborts_and_is_retryable(vllm_host: EngineHost, tok: ChatTokenizer) -> None:
    engine = vllm_host.engine
    saved = engine.request_timeout_s
    engine.request_timeout_s = 0.3
    try:
        with pytest.raises(InferenceError) as info:
            await vllm_host.call(engine.generate(rid("slow"), chat(tok, ("user", STORY)),
                                                 SamplingParams(temperature=1.0, seed=1), 3000))
    finally:
        engine.request_timeout_s = saved
    assert info.value.retryable
    await until(lambda: vllm_host.engine.llm.get_num_unfinished_requests() == 0, 10, "vLLM to drop the request")


async def test_rejected_request_is_not_retryable(vllm_engine: Engine) -> None:
    too_long = np.full(5000, 100, dtype=np.int32)  # longer than the e2e engine's 4096-token context
    with pytest.raises(InferenceError) as info:
        await vllm_engine.generate(rid(), too_long, GREEDY, 8)
    assert not info.value.retryable


async def test_prefix_cache_serves_a_shared_long_prefix(vllm_engine: Engine, tok: ChatTokenizer) -> None:
    """A second turn extending the first one's context is served mostly from the prefix cache."""
    facts = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))
    first_prompt = chat(tok, ("system", f"Remember these facts. {facts}"), ("user", "What is 7 squared?"))
    assert first_prompt.shape[0] > 600
    first = await vllm_engine.generate(rid(), first_prompt, GREEDY, 16, session_key="ep")
    second_prompt = np.concatenate(
        [first_prompt, first.token_ids, tok.encode("\n<|im_start|>user\nAnd 8 squared?<|im_end|>\n"
                                                   "<|im_start|>assistant\n")]).astype(np.int32)
    second = await vllm_engine.generate(rid(), second_prompt, GREEDY, 16, session_key="ep")
    assert second.cached_tokens is not None and second.cached_tokens > 0
    assert second.cached_tokens >= (first_prompt.shape[0] // 2), (second.cached_tokens, first_prompt.shape[0])


async def test_in_process_worker_serves_turns_over_nats(vllm_worker: InProcessWorker, nc: bus.NATS,
                                                        tok: ChatTokenizer) -> None:
    """The real inference-worker server on the vLLM engine: reply and stored event carry vLLM's ids and logprobs."""
    reply, event = await ask_worker(nc, infer_worker_subject(vllm_worker.worker_id), tok)
    assert reply.engine == "vllm" and reply.worker_id == vllm_worker.worker_id
    assert "Paris" in tok.decode(reply.token_ids, skip_special_tokens=True)
    assert event.token_ids.tolist() == reply.token_ids.tolist()
    np.testing.assert_array_equal(event.logprobs, reply.logprobs)


async def ask_worker(nc: bus.NATS, subject: str, tok: ChatTokenizer) -> tuple[TurnGenerated, TurnGenerated]:
    episode = f"e2e{uuid.uuid4().hex[:6]}.0.0"
    request_id = f"{episode}:a1:t0:r1"
    request = InferenceRequested(
        event_id=request_id, episode_id=episode, batch_id=episode.split(".")[0], attempt=1, seq=1,
        produced_by="tests/e2e", request_id=request_id, turn_index=0,
        prompt_token_ids=chat(tok, ("user", "What is the capital of France?")), sampling=GREEDY,
        max_tokens=GREEDY.max_tokens, reply_seq=1,
    )
    msg = await nc.request(subject, encode(request), timeout=120)
    assert not (msg.headers or {}).get("Rollout-Error"), (msg.headers, msg.data)
    reply = decode_as(msg.data, TurnGenerated)
    assert reply.event_id == request_id
    check_shape(Generation(reply.token_ids, reply.logprobs, reply.finish_reason))
    js = nc.jetstream()
    stored = await js.get_last_msg(EVENTS_STREAM, event_subject(reply.type))
    event = decode(stored.data)
    assert isinstance(event, TurnGenerated) and event.event_id == request_id
    return reply, event


INTEL_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC_NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse4_2 avx2 fma\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_auto_dtype_is_float32_on_a_cpu_without_native_bf16() -> None:
    from rollout_ledger.services.inference_worker.settings import InferenceSettings
    from rollout_ledger.services.inference_worker.vllm_engine import engine_kwargs, resolve_dtype

    assert resolve_dtype("auto", True, EPYC_NO_BF16) == "float32"
    assert resolve_dtype("auto", True, INTEL_AMX) == "auto"
    assert resolve_dtype("auto", True, ARM_BF16) == "auto"
    assert resolve_dtype("auto", False, EPYC_NO_BF16) == "auto"  # a GPU decides for itself
    assert resolve_dtype("bfloat16", True, EPYC_NO_BF16) == "bfloat16"  # asked for explicitly
    assert resolve_dtype("auto", True, None) == "auto" and resolve_dtype("auto", True, "") == "auto"
    settings = InferenceSettings(engine="vllm", model="m")
    assert engine_kwargs(settings, True, EPYC_NO_BF16)["dtype"] == "float32"
    assert engine_kwargs(settings, True, INTEL_AMX)["dtype"] == "auto"
