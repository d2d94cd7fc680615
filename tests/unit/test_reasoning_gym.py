"""Unit tests of the reasoning-gym env family (``rg:<dataset>``) against the installed library: registration without
importing it, every dataset's example task, rewards equal to the library's own ``score_answer``, task checks, the
dataset cache and determinism. Through a real stack: tests/integration/test_library_envs.py."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import reasoning_gym
from pydantic import ValidationError

from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.envs import reasoning_gym as rg
from rollout_ledger.services.envs.base import TaskError
from rollout_ledger.services.envs.reasoning_gym import ReasoningGymEnv, RgLibrary, RgSettingsError


def library_entry(dataset: str, index: int, seed: int = 0, **config: Any) -> tuple[Any, dict[str, Any]]:
    """The library's own dataset and entry, built without our code."""
    ds = reasoning_gym.create_dataset(dataset, seed=seed, **config)
    return ds, ds[index]


def library_score(ds: Any, completion: str, entry: dict[str, Any]) -> float:
    answer = reasoning_gym.utils.extract_answer(completion)
    try:
        return float(ds.score_answer(answer, entry))
    except Exception:
        return 0.0


def test_the_known_release_lists_every_dataset_of_the_installed_library() -> None:
    from reasoning_gym.factory import DATASETS

    version = rg.installed_version()
    assert version in rg.KNOWN_RELEASES, f"add reasoning-gym {version}'s datasets to KNOWN_RELEASES"
    assert rg.KNOWN_RELEASES[version] == tuple(sorted(DATASETS))
    assert rg.available_datasets() == tuple(sorted(DATASETS))


def test_registering_the_family_does_not_import_the_library() -> None:
    code = ("import sys, time; from rollout_ledger.services.env_worker.settings import EnvWorkerSettings;"
            "from rollout_ledger.services.envs.reasoning_gym import specs; t = time.perf_counter();"
            "n = len(specs(EnvWorkerSettings())); print(n, 'reasoning_gym' in sys.modules, time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    count, imported, seconds = out.stdout.split()
    assert int(count) == len(rg.available_datasets()) and imported == "False"
    assert float(seconds) < 0.5


async def test_every_dataset_registers_and_its_example_task_resets() -> None:
    specs = rg.specs(EnvWorkerSettings())
    names = [s.name for s in specs]
    assert names == [f"rg:{n}" for n in rg.available_datasets()] and len(names) > 100
    assert {s.family for s in specs} == {"rg"} and {s.route for s in specs} == {"rg"}
    assert not any(s.multi_turn for s in specs)
    for spec in specs:
        env = spec.factory()
        messages = await env.reset(spec.example_task)
        assert [m["role"] for m in messages] == ["system", "user"], spec.name
        assert "<answer>" in messages[0]["content"] and messages[1]["content"].strip(), spec.name
    env = specs[0].factory()
    assert isinstance(env, ReasoningGymEnv)
    library = env.library
    assert library.builds == len(specs)  # one library, one dataset per env
    library.close()


@pytest.mark.parametrize(("dataset", "index"), [
    ("basic_arithmetic", 3), ("chain_sum", 0), ("spell_backward", 5), ("prime_factorization", 1),
    ("word_sorting", 2), ("countdown", 0), ("gcd", 4), ("letter_counting", 7),
])
async def test_rewards_are_the_librarys_scores(dataset: str, index: int) -> None:
    ds, entry = library_entry(dataset, index, seed=11)
    right = f"Thinking... <answer>{entry['answer']}</answer>"
    completions = [right, "<answer>zzz</answer>", f"<answer>{entry['answer']} or so</answer>", "no tags at all",
                   f"<answer>first</answer> then <answer> {entry['answer']} </answer>"]
    library = RgLibrary()
    for completion in completions:
        env = ReasoningGymEnv(dataset, library)
        messages = await env.reset({"seed": 11, "index": index})
        assert messages[1]["content"] == entry["question"]
        result = await env.step(completion)
        assert result.terminated and result.observation == []
        assert result.reward == library_score(ds, completion, entry), (dataset, completion)
        assert result.info["expected"] == entry["answer"] and result.info["index"] == index
    assert library.builds == 1
    library.close()


async def test_right_and_wrong_answers_and_a_scorer_that_raises() -> None:
    library = RgLibrary()
    _, entry = library_entry("prime_factorization", 1)
    env = ReasoningGymEnv("prime_factorization", library)
    await env.reset({"index": 1})
    assert (await env.step(f"<answer>{entry['answer']}</answer>")).reward == 1.0
    env = ReasoningGymEnv("prime_factorization", library)
    await env.reset({"index": 1})
    wrong = await env.step("<answer>twelve</answer>")  # the library's scorer raises ValueError on it
    assert wrong.reward == 0.0 and wrong.info["answer"] == "twelve" and "ValueError" in wrong.info["score_error"]
    env = ReasoningGymEnv("prime_factorization", library)
    await env.reset({"index": 1})
    untagged = await env.step(entry["answer"])
    assert untagged.reward == 0.0 and untagged.info["answer"] is None
    library.close()


async def test_config_seed_and_composite() -> None:
    library = RgLibrary()
    _, entry = library_entry("basic_arithmetic", 2, seed=5, min_terms=2, max_terms=2, max_digits=1, size=10)
    env = ReasoningGymEnv("basic_arithmetic", library)
    task = {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "size": 10}, "seed": 5, "index": 2,
            "system_prompt": "direct"}
    messages = await env.reset(task)
    assert messages[1]["content"] == entry["question"]
    assert messages[0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["direct"]
    assert (await env.step(f"<answer>{entry['answer']}</answer>")).reward == 1.0

    spec = rg.spec("composite", library)
    env = spec.factory()
    await env.reset({**spec.example_task, "index": 4})
    result = await env.step("<answer>0</answer>")
    assert result.info["source_dataset"] in ("basic_arithmetic", "chain_sum")
    library.close()


async def test_shots_are_solved_examples_of_the_same_dataset() -> None:
    library = RgLibrary()
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    env = ReasoningGymEnv("basic_arithmetic", library)
    messages = await env.reset({"config": config, "seed": 3, "index": 5, "shots": 2})
    _, entry = library_entry("basic_arithmetic", 5, seed=3, **config)
    shots = reasoning_gym.create_dataset("basic_arithmetic", seed=3 + rg.SHOT_SEED, **config)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[1:5] == [{"role": "user", "content": shots[0]["question"]},
                             {"role": "assistant", "content": f"<answer>{shots[0]['answer']}</answer>"},
                             {"role": "user", "content": shots[1]["question"]},
                             {"role": "assistant", "content": f"<answer>{shots[1]['answer']}</answer>"}]
    assert messages[-1]["content"] == entry["question"]
    assert (await env.step(f"<answer>{entry['answer']}</answer>")).reward == 1.0
    with pytest.raises(TaskError, match="has no reference answers to show as shots"):
        await ReasoningGymEnv("rush_hour", library).reset({"shots": 1})
    library.close()


@pytest.mark.parametrize(("task", "message"), [
    ({"shots": 9}, "'shots' is at most 8"),
    ({"config": {"no_such_knob": 1}}, "no config field(s) 'no_such_knob'; its fields: "),
    ({"config": {"min_terms": 0}}, "refused its config: AssertionError"),
    ({"config": {"size": 5}, "index": 5}, "index 5 is out of range for rg:basic_arithmetic of size 5"),
    ({"index": -1}, "'index' must be an integer >= 0"),
    ({"seed": "x"}, "'seed' must be an integer >= 0"),
    ({"config": {"seed": 3}}, "put the seed in the task's 'seed' field"),
    ({"config": [1]}, "'config' must be an object"),
    ({"dataset": "x"}, "unknown task field(s) 'dataset'"),
    ({"system_prompt": "pirate"}, "unknown system_prompt 'pirate'"),
])
async def test_bad_tasks_are_task_errors(task: dict[str, Any], message: str) -> None:
    library = RgLibrary()
    with pytest.raises(TaskError) as err:
        await ReasoningGymEnv("basic_arithmetic", library).reset(task)
    assert message in str(err.value)
    library.close()


async def test_datasets_are_cached_in_a_bounded_lru_and_entries_are_deterministic() -> None:
    library = RgLibrary(cache_size=2)
    for seed in (1, 2, 1, 3, 1):
        for index in (0, 1):
            await ReasoningGymEnv("chain_sum", library).reset({"seed": seed, "index": index})
    assert library.builds == 3  # 1, 2, (1 cached), 3 (evicts 2), (1 cached)
    await ReasoningGymEnv("chain_sum", library).reset({"seed": 2, "index": 0})
    assert library.builds == 4
    library.close()
    # the same task gives the same entry in another worker (a fresh library), for generators of every kind
    # (list_functions is left out: its generator 0 draws from the global random, a defect of the library)
    for dataset in ("basic_arithmetic", "zebra_puzzles", "sudoku", "word_ladder", "maze", "family_relationships",
                    "arc_1d", "gsm_symbolic"):
        prompts = []
        for _ in range(2):
            library = RgLibrary()
            prompts.append(await ReasoningGymEnv(dataset, library).reset({"seed": 7, "index": 3}))
            library.close()
        assert prompts[0] == prompts[1], dataset


def test_the_setting_selects_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rg.specs(EnvWorkerSettings(rg_datasets="none")) == []
    assert rg.specs(EnvWorkerSettings(rg_datasets="")) == []
    chosen = rg.specs(EnvWorkerSettings(rg_datasets=" basic_arithmetic, rg:chain_sum "))
    assert [s.name for s in chosen] == ["rg:basic_arithmetic", "rg:chain_sum"]
    with pytest.raises(ValidationError, match=r"ROLLOUT_RG_DATASETS: reasoning-gym .* has no dataset 'nope'"):
        EnvWorkerSettings(rg_datasets="basic_arithmetic,nope")
    with pytest.raises(ValidationError, match="lists 'gcd' twice"):
        EnvWorkerSettings(rg_datasets="gcd,gcd")
    monkeypatch.setattr(rg, "installed_version", lambda: None)  # the library not installed
    assert rg.specs(EnvWorkerSettings()) == []
    with pytest.raises(RgSettingsError, match="reasoning-gym is not installed"):
        rg.enabled_datasets("gcd")
