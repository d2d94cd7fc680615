"""Weight swaps in the inference worker (issue 15, part 2), on the fake engine: which checkpoints may replace the
served weights, and the gate: drain finishes the generations in flight on the old version, abort cuts them and
has them generated again on the new one, keep cuts them keeping what they sampled (refused by an engine that
cannot), a refused checkpoint changes nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from rollout_ledger.services.inference_worker.checkpoints import WeightsRefused, check_compatible
from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.services.inference_worker.weights import Cut, SwapRefused, Weights
from rollout_ledger.shared.events import FinishReason, SamplingParams
from rollout_ledger.shared.policy_versions import SwapMode
from tests.helpers import until

PROMPT = np.array([1, 9690, 198, 2683, 359, 253, 5356, 2], dtype=np.int32)


def checkpoint(model_dir: str, out: Path, **config_changes: object) -> Path:
    """A copy of the model's config and tokenizer with a small valid safetensors file (the fake reads headers)."""
    out.mkdir(parents=True)
    src = Path(model_dir)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    if config_changes:
        config = json.loads((out / "config.json").read_text())
        config.update(config_changes)
        (out / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    return out


def test_a_copy_of_the_served_model_is_compatible(model_dir: str, tmp_path: Path) -> None:
    check_compatible(model_dir, checkpoint(model_dir, tmp_path / "ok"))


@pytest.mark.parametrize(("change", "needle"), [({"vocab_size": 1234}, "vocab_size"),
                                                 ({"num_hidden_layers": 3}, "num_hidden_layers"),
                                                 ({"architectures": ["MistralForCausalLM"]}, "architectures")])
def test_another_architecture_is_refused(model_dir: str, tmp_path: Path, change: dict[str, object],
                                         needle: str) -> None:
    with pytest.raises(WeightsRefused, match=f"another architecture: {needle}"):
        check_compatible(model_dir, checkpoint(model_dir, tmp_path / "bad", **change))


def test_another_tokenizer_missing_or_unreadable_weights_are_refused(model_dir: str, tmp_path: Path) -> None:
    other = checkpoint(model_dir, tmp_path / "tok")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|end|>"'))
    with pytest.raises(WeightsRefused, match="another tokenizer"):
        check_compatible(model_dir, other)
    bare = checkpoint(model_dir, tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    with pytest.raises(WeightsRefused, match=r"no \*\.safetensors"):
        check_compatible(model_dir, bare)
    corrupt = checkpoint(model_dir, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(WeightsRefused, match="not a readable safetensors"):
        check_compatible(model_dir, corrupt)
    with pytest.raises(WeightsRefused, match="not a directory"):
        check_compatible(model_dir, tmp_path / "missing")


async def _turn(engine: FakeEngine, weights: Weights, rid: str) -> tuple[int, FinishReason, int]:
    """One request through the gate as the server runs it: (version it carries, finish, generations)."""
    runs = 0
    while True:
        version = await weights.admit(rid)
        runs += 1
        try:
            generation = await engine.generate(rid, PROMPT, SamplingParams(), 16, session_key=rid)
        finally:
            cut = weights.finished(rid)
        if cut is not Cut.AGAIN:
            return version, generation.finish_reason, runs


async def _engine(model_dir: str, delay_s: float) -> FakeEngine:
    engine = FakeEngine(model_dir, delay_s=delay_s, load_s=0.2)
    await engine.start()
    return engine


async def test_drain_finishes_in_flight_turns_on_the_old_version_and_holds_new_ones(
        model_dir: str, tmp_path: Path) -> None:
    engine = await _engine(model_dir, delay_s=0.3)
    weights = Weights(engine, version=0)
    in_flight = [asyncio.create_task(_turn(engine, weights, f"old-{i}")) for i in range(3)]
    await until(lambda: len(weights._running) == 3, 5, "the three turns admitted on version 0")
    swap = asyncio.create_task(weights.swap(1, str(checkpoint(model_dir, tmp_path / "v1")), SwapMode.DRAIN))
    await until(lambda: weights.swapping, 5, "the swap to close the gate")
    late = asyncio.create_task(_turn(engine, weights, "late"))
    await swap
    assert [await t for t in in_flight] == [(0, FinishReason.STOP, 1)] * 3, "finished on the old weights"
    assert await late == (1, FinishReason.STOP, 1), "held at the gate, then generated on the new weights"
    assert weights.serving == 1 and engine.checkpoint == str(tmp_path / "v1")
    assert weights.last_swap_s is not None and weights.last_swap_s >= 0.2


async def test_abort_cuts_in_flight_turns_and_generates_them_again_on_the_new_version(
        model_dir: str, tmp_path: Path) -> None:
    engine = await _engine(model_dir, delay_s=5.0)
    weights = Weights(engine, version=3)
    in_flight = [asyncio.create_task(_turn(engine, weights, f"cut-{i}")) for i in range(2)]
    await asyncio.sleep(0.05)
    engine.delay_s = 0.0  # the regenerated turns are quick
    await asyncio.wait_for(weights.swap(4, str(checkpoint(model_dir, tmp_path / "v4")), SwapMode.ABORT), 3)
    results = await asyncio.gather(*in_flight)
    assert results == [(4, FinishReason.STOP, 2)] * 2, "aborted once, generated again on version 4"


async def test_keep_cuts_in_flight_turns_and_keeps_what_they_sampled(model_dir: str, tmp_path: Path) -> None:
    engine = await _engine(model_dir, delay_s=2.0)
    weights = Weights(engine, version=2)
    prompt = PROMPT
    partial: dict[str, object] = {}

    async def turn(rid: str) -> None:
        await weights.admit(rid)
        try:
            generation = await engine.generate(rid, prompt, SamplingParams(), 16, session_key="s")
        finally:
            partial[rid] = (weights.finished(rid), generation)

    engine.delay_s, whole = 0.0, await engine.generate("whole", prompt, SamplingParams(), 16, session_key="s")
    engine.delay_s, full = 2.0, whole.token_ids
    in_flight = [asyncio.create_task(turn(f"keep-{i}")) for i in range(2)]
    await asyncio.sleep(1.0)  # about half of each generation's time has passed
    await asyncio.wait_for(weights.swap(3, str(checkpoint(model_dir, tmp_path / "v3")), SwapMode.KEEP), 3)
    await asyncio.gather(*in_flight)
    assert weights.serving == 3
    for rid in ("keep-0", "keep-1"):
        cut, generation = partial[rid]  # type: ignore[misc]
        assert cut is Cut.CONTINUE and generation.finish_reason == FinishReason.ABORT
        n = len(generation.token_ids)
        assert 0 < n < len(full), "cut mid-way with the ids sampled so far"
        assert list(generation.token_ids) == list(full[:n]), "the ids the old version sampled, verbatim"


async def test_keep_is_refused_by_an_engine_that_cannot_continue_and_refused_checkpoints_change_nothing(
        model_dir: str, tmp_path: Path) -> None:
    engine = await _engine(model_dir, delay_s=0.0)
    weights = Weights(engine, version=2)
    engine.supports_keep = False  # type: ignore[misc]
    with pytest.raises(SwapRefused, match="mode keep"):
        await weights.swap(3, str(checkpoint(model_dir, tmp_path / "v3")), SwapMode.KEEP)
    with pytest.raises(WeightsRefused, match="vocab_size"):
        await weights.swap(3, str(checkpoint(model_dir, tmp_path / "bad", vocab_size=7)), SwapMode.DRAIN)
    assert weights.serving == 2 and not weights.swapping and engine.checkpoint == model_dir
    assert await _turn(engine, weights, "after") == (2, FinishReason.STOP, 1), "the old version keeps serving"
