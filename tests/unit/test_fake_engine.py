"""FakeEngine: deterministic, real token ids, eos/length finish, logprob range, flat cost, prefix-cache model."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest

from rollout_ledger.services.inference_worker.engine import Engine, Generation
from rollout_ledger.services.inference_worker.engines import build_engine
from rollout_ledger.services.inference_worker.fake_engine import SENTENCES, FakeEngine, TailDecoder, respond
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.events import FinishReason, SamplingParams
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer


@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


@pytest.fixture
async def engine(model_dir: str) -> FakeEngine:
    eng = FakeEngine(model_dir)
    await eng.start()
    return eng


def chat(tok: ChatTokenizer, *messages: tuple[str, str]) -> np.ndarray:
    rendered = tok.render([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)
    return tok.encode(rendered)


def text_of(tok: ChatTokenizer, gen: Generation) -> str:
    return tok.decode(gen.token_ids, skip_special_tokens=True)


async def test_is_an_engine(engine: FakeEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name == "fake"


async def test_deterministic(engine: FakeEngine, tok: ChatTokenizer) -> None:
    prompt = chat(tok, ("user", "Tell me about the sea."))
    a = await engine.generate("r1", prompt, SamplingParams(seed=3), 64)
    b = await engine.generate("r2", prompt.copy(), SamplingParams(seed=3), 64)
    assert np.array_equal(a.token_ids, b.token_ids)
    assert np.array_equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason == FinishReason.STOP
    # Other seeds pick other sentences for some prompts.
    texts = {text_of(tok, await engine.generate("r", prompt, SamplingParams(seed=s), 64)) for s in range(20)}
    assert len(texts) > 1
    assert texts <= set(SENTENCES)


async def test_real_ids_decode_to_answer_and_end_with_eos(engine: FakeEngine, tok: ChatTokenizer) -> None:
    prompt = chat(tok, ("user", "What is 12 + 7?"))
    gen = await engine.generate("r", prompt, SamplingParams(), 64)
    assert gen.token_ids.dtype == np.int32
    assert gen.token_ids[-1] == tok.eos_token_id
    assert text_of(tok, gen) in {"The answer is 18.", "The answer is 19.", "The answer is 20."}
    assert np.array_equal(gen.token_ids[:-1], tok.encode(text_of(tok, gen)))


async def test_arithmetic_correct_for_about_60_percent(engine: FakeEngine, tok: ChatTokenizer) -> None:
    correct = 0
    total = 300
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for i in range(total):
        a, b, op = 3 + i % 17, 2 + i // 17, "+-*"[i % 3]
        gen = await engine.generate("r", chat(tok, ("user", f"What is {a} {op} {b}?")), SamplingParams(), 64)
        answer = int(text_of(tok, gen).removeprefix("The answer is ").rstrip("."))
        expected = ops[op](a, b)
        assert abs(answer - expected) <= 1
        correct += answer == expected
    assert 0.45 * total < correct < 0.75 * total


def test_guess_stays_in_range_and_follows_feedback() -> None:
    first = "<|im_start|>user\nI am thinking of a number between 1 and 100. Guess it!<|im_end|>\n"
    for h in range(50):
        n = int(respond(first, h).removeprefix("My guess is ").rstrip("."))
        assert 1 <= n <= 100
    later = (
        first
        + "<|im_start|>assistant\nMy guess is 50.<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n"
        + "<|im_start|>assistant\nMy guess is 80.<|im_end|>\n<|im_start|>user\nToo high, guess again.<|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    for h in range(50):
        n = int(respond(later, h).removeprefix("My guess is ").rstrip("."))
        assert 51 <= n <= 79


def test_arithmetic_operators_and_fallback() -> None:
    answers = {respond("What is 9 - 12?", h * 1_000_003) for h in range(60)}
    assert answers == {"The answer is -4.", "The answer is -3.", "The answer is -2."}
    products = {respond("What is 6 * 7?", h * 1_000_003) for h in range(60)}
    assert products == {f"The answer is {n}." for n in (41, 42, 43)}
    assert respond("hello there", 5) in SENTENCES


async def test_length_finish(engine: FakeEngine, tok: ChatTokenizer) -> None:
    prompt = chat(tok, ("user", "What is 12 + 7?"))
    full = await engine.generate("r", prompt, SamplingParams(), 64)
    cut = await engine.generate("r", prompt, SamplingParams(), 3)
    assert cut.finish_reason == FinishReason.LENGTH
    assert np.array_equal(cut.token_ids, full.token_ids[:3])
    assert np.array_equal(cut.logprobs, full.logprobs[:3])
    exact = await engine.generate("r", prompt, SamplingParams(), len(full.token_ids))
    assert exact.finish_reason == FinishReason.STOP  # the eos fits exactly


async def test_stop_string(engine: FakeEngine, tok: ChatTokenizer) -> None:
    """As vLLM: the ids run through the one completing the stop string (the one ending first), without eos."""
    prompt = chat(tok, ("user", "What is 2 + 2?"))
    gen = await engine.generate("r", prompt, SamplingParams(stop=["answer"]), 64)
    assert gen.finish_reason == FinishReason.STOP
    assert text_of(tok, gen) == "The answer"
    assert tok.eos_token_id not in gen.token_ids.tolist()
    assert "answer" not in tok.decode(gen.token_ids[:-1])
    two = await engine.generate("r", prompt, SamplingParams(stop=["is", "ans"]), 64)
    assert text_of(tok, two) == "The answer"  # "ans" ends first; its id carries "wer" after it
    full = await engine.generate("r", prompt, SamplingParams(), 64)
    assert np.array_equal(two.token_ids, full.token_ids[:len(two.token_ids)])


async def test_min_tokens_holds_the_end_of_turn_back(engine: FakeEngine, tok: ChatTokenizer) -> None:
    """As vLLM's ``min_tokens``: neither the eos id nor a stop string ends the turn before that many ids."""
    prompt = chat(tok, ("user", "What is 2 + 2?"))
    short = await engine.generate("r", prompt, SamplingParams(), 64)
    assert len(short.token_ids) < 40
    exact = await engine.generate("r", prompt, SamplingParams(max_tokens=40, min_tokens=40), 40)
    assert len(exact.token_ids) == 40 and exact.finish_reason == FinishReason.LENGTH
    assert tok.eos_token_id not in exact.token_ids.tolist()
    floor = await engine.generate("r", prompt, SamplingParams(min_tokens=30), 256)
    assert len(floor.token_ids) >= 30 and floor.finish_reason == FinishReason.STOP
    assert floor.token_ids.tolist()[-1] == tok.eos_token_id
    assert text_of(tok, floor).startswith(text_of(tok, short))
    stopped = await engine.generate("r", prompt, SamplingParams(min_tokens=10, stop=["answer"]), 256)
    assert len(stopped.token_ids) > 10 and text_of(tok, stopped).endswith("answer")
    assert text_of(tok, stopped).count("answer") == 3  # the first two were within the floor
    clamped = await engine.generate("r", prompt, SamplingParams(min_tokens=30), 12)
    assert len(clamped.token_ids) == 12 and clamped.finish_reason == FinishReason.LENGTH


async def test_logprobs_in_range(engine: FakeEngine, tok: ChatTokenizer) -> None:
    for i in range(30):
        gen = await engine.generate("r", chat(tok, ("user", f"Question {i}")), SamplingParams(seed=i), 64)
        assert gen.logprobs.dtype == np.float32
        assert gen.logprobs.shape == gen.token_ids.shape
        assert np.all(gen.logprobs >= -3.0) and np.all(gen.logprobs <= -0.001)
        assert gen.top_logprobs is None


async def test_top_logprobs(engine: FakeEngine, tok: ChatTokenizer) -> None:
    gen = await engine.generate("r", chat(tok, ("user", "Hi")), SamplingParams(logprobs=2), 64)
    assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.token_ids)
    for tid, lp, alts in zip(gen.token_ids.tolist(), gen.logprobs.tolist(), gen.top_logprobs, strict=True):
        assert alts[tid] == lp
        assert len(alts) == 3


async def test_cost_does_not_grow_with_context(engine: FakeEngine, tok: ChatTokenizer) -> None:
    short = chat(tok, ("user", "What is 1 + 2?"))
    filler = tok.encode("The quick brown fox jumps over the lazy dog. " * 12_000)
    long = np.concatenate((filler, short)).astype(np.int32)
    assert len(long) > 100_000
    sampling = SamplingParams()

    async def median_us(prompt: np.ndarray) -> float:
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            await engine.generate("r", prompt, sampling, 64)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    await median_us(long)
    short_us, long_us = await median_us(short), await median_us(long)
    assert long_us < 3 * short_us + 200, (short_us, long_us)
    # The tail is all the fake reads: the long prompt gets the same answer as the short one with that tail.
    gen = await engine.generate("r", long, sampling, 64)
    assert text_of(tok, gen).startswith("The answer is ")


async def test_prefix_cache_model(engine: FakeEngine, tok: ChatTokenizer) -> None:
    first = chat(tok, ("user", "What is 12 + 7?"))
    assert (await engine.generate("r1", first, SamplingParams(), 64)).cached_tokens is None
    gen1 = await engine.generate("r1", first, SamplingParams(), 64, session_key="ep")
    assert gen1.cached_tokens == 0
    second = np.concatenate((first, gen1.token_ids, tok.encode("\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n")))
    gen2 = await engine.generate("r2", second.astype(np.int32), SamplingParams(), 64, session_key="ep")
    seen = len(first) + len(gen1.token_ids)
    assert gen2.cached_tokens is not None
    assert gen2.cached_tokens % engine.block_size == 0
    assert seen - engine.block_size < gen2.cached_tokens <= seen
    other = await engine.generate("r3", second.astype(np.int32), SamplingParams(), 64, session_key="other")
    assert other.cached_tokens == 0


async def test_concurrent_requests_and_abort(model_dir: str, tok: ChatTokenizer) -> None:
    eng = FakeEngine(model_dir, delay_s=0.3)
    await eng.start()
    prompt = chat(tok, ("user", "Hello"))
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(eng.generate(f"r{i}", prompt, SamplingParams(), 64) for i in range(100)))
    assert time.perf_counter() - t0 < 3.0
    assert all(g.finish_reason == FinishReason.STOP for g in gens)

    slow = FakeEngine(model_dir, delay_s=30.0, tokenizer=tok)
    slow.eos_id = tok.eos_token_id
    task = asyncio.create_task(slow.generate("victim", prompt, SamplingParams(), 64))
    await asyncio.sleep(0)  # let the request start: it registers before its first await
    assert "victim" in slow._aborts
    await slow.abort("victim")
    gen = await asyncio.wait_for(task, timeout=2)
    assert gen.finish_reason == FinishReason.ABORT
    assert len(gen.token_ids) == 0


async def test_tokens_per_s_paces_generation(model_dir: str, tok: ChatTokenizer) -> None:
    eng = FakeEngine(model_dir, tokens_per_s=100.0, tokenizer=tok)
    await eng.start()
    t0 = time.perf_counter()
    gen = await eng.generate("r", chat(tok, ("user", "What is 1 + 1?")), SamplingParams(), 64)
    elapsed = time.perf_counter() - t0
    assert elapsed >= len(gen.token_ids) / 100.0 * 0.9


def test_tail_decoder_matches_tokenizers(tok: ChatTokenizer) -> None:
    fast = TailDecoder.build(tok)
    assert fast is not None
    text = tok.render([{"role": "user", "content": "Héllo wörld 日本語 😀 What is 3 + 4?"}], add_generation_prompt=True)
    ids = tok.encode(text)
    for start in range(len(ids)):  # every cut point, including cuts inside a multi-byte character
        tail = ids[start:].tolist()
        assert fast.decode(tail) == tok.tokenizer.decode(tail, skip_special_tokens=False)
    rng = np.random.default_rng(0)
    for _ in range(200):
        tail = rng.integers(0, tok.vocab_size, 40).tolist()
        assert fast.decode(tail) == tok.tokenizer.decode(tail, skip_special_tokens=False)


async def test_build_engine_makes_the_fake_from_settings(model_dir: str) -> None:
    settings = InferenceSettings(model=model_dir, engine="fake", fake_delay_s=0.25, fake_tokens_per_s=50.0)
    eng = build_engine(settings)
    assert isinstance(eng, FakeEngine) and isinstance(eng, Engine)
    assert (eng.delay_s, eng.tokens_per_s) == (0.25, 50.0)


async def test_seedless_sessions_differ_and_each_is_reproducible(engine: FakeEngine, tok: ChatTokenizer) -> None:
    """seed None: the session (episode) is part of the hash, so a GRPO group is not one answer repeated."""
    prompt = chat(tok, ("user", "What is 12 + 7?"))
    texts = {text_of(tok, await engine.generate("r", prompt, SamplingParams(), 64, session_key=f"b.0.{g}"))
             for g in range(16)}
    assert len(texts) > 1
    again = [await engine.generate("r", prompt, SamplingParams(), 64, session_key="b.0.3") for _ in range(2)]
    assert np.array_equal(again[0].token_ids, again[1].token_ids)
    seeded = {text_of(tok, await engine.generate("r", prompt, SamplingParams(seed=5), 64, session_key=f"b.0.{g}"))
              for g in range(16)}
    assert len(seeded) == 1  # an explicit seed is reproducible across sessions


async def test_delay_jitter_is_fixed_by_the_request_id(model_dir: str, tok: ChatTokenizer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request waits delay_s plus up to delay_jitter_s, the same for the same id (what a test or a benchmark
    run sees again), spread over the range across ids."""
    settings = InferenceSettings(model=model_dir, engine="fake", fake_delay_s=0.1, fake_delay_jitter_s=0.2)
    eng = build_engine(settings)
    assert isinstance(eng, FakeEngine)
    await eng.start()
    waits: list[tuple[str, float]] = []

    async def recorded(request_id: str, seconds: float) -> bool:
        waits.append((request_id, seconds))
        return False

    monkeypatch.setattr(eng, "_wait", recorded)
    prompt = chat(tok, ("user", "Hello"))
    for rid in [f"b.{i}.0:a1:t0:r1" for i in range(200)] + ["b.0.0:a1:t0:r1"]:
        await eng.generate(rid, prompt, SamplingParams(), 8)
    seconds = [s for _, s in waits]
    assert all(0.1 <= s < 0.3 for s in seconds)
    assert seconds[-1] == seconds[0]  # the same request id waits the same
    assert min(seconds) < 0.12 and max(seconds) > 0.28 and 0.18 < statistics.mean(seconds) < 0.22
