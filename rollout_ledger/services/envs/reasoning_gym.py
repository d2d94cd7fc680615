"""The reasoning-gym env family ``rg:<dataset>``: one single-turn env per procedural dataset of the installed
``reasoning-gym`` library, its question as the prompt and its own ``score_answer`` as the reward.

Design note. Importing reasoning-gym costs about a second of CPU (sympy, matplotlib) and ~100 MB, so a worker
registers the names without importing it (the names of a known release are listed below; any other release is
imported once at start to read its registry) and imports it on the first ``rg:`` episode. Every library call
(import, dataset construction, generation, scoring) runs on one thread of the worker's ``RgLibrary``: the event
loop never stalls on a slow generator, and the library, which was not written for threads, only ever sees one.
Datasets are built once per (dataset, config, seed) and kept in an LRU, entries in a second LRU (the members of
a GRPO group share their entry); entry ``index`` of a dataset is ``dataset[index]``, which the library generates
from ``Random(seed + index)``: the same task gives the same question in every worker. A task may ask for ``shots``:
solved examples of the same dataset before its question, which teach a small model the ``<answer>`` format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_ledger.services.envs.base import REPLAY, Env, EnvSpec, Message, StepResult, TaskError
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

FAMILY = "rg"
PREFIX = f"{FAMILY}:"
DISTRIBUTION = "reasoning-gym"
"""The PyPI name of the library."""

KNOWN_RELEASES: dict[str, tuple[str, ...]] = {
    "0.1.25": (
        "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "arc_agi", "base_conversion", "basic_arithmetic", "bf",
        "binary_alternation", "binary_matrix", "bitwise_arithmetic", "boxnet", "caesar_cipher",
        "calendar_arithmetic", "chain_sum", "circuit_logic", "codeio", "coin_flip", "color_cube_rotation",
        "complex_arithmetic", "composite", "count_bits", "count_primes", "countdown", "course_schedule",
        "cryptarithm", "decimal_arithmetic", "decimal_chain_sum", "dice", "emoji_mystery", "family_relationships",
        "figlet_font", "fraction_simplification", "futoshiki", "game_of_life", "game_of_life_halting", "gcd",
        "graph_color", "group_anagrams", "gsm_symbolic", "intermediate_integration", "isomorphic_strings", "jugs",
        "kakurasu", "knight_swap", "knights_knaves", "largest_island", "lcm", "leg_counting", "letter_counting",
        "letter_jumble", "list_functions", "mahjong_puzzle", "manipulate_matrix", "maze", "mini_sudoku",
        "modulo_grid", "n_queens", "needle_haystack", "number_filtering", "number_format", "number_sequence",
        "number_sorting", "palindrome_generation", "palindrome_partitioning", "path_star", "polynomial_equations",
        "polynomial_multiplication", "pool_matrix", "power_function", "prime_factorization", "products",
        "propositional_logic", "puzzle24", "quantum_lock", "ransom_note", "rearc", "rectangle_count",
        "rotate_matrix", "rotten_oranges", "rubiks_cube", "rush_hour", "self_reference", "sentence_reordering",
        "shortest_path", "simple_equations", "simple_geometry", "simple_integration", "sokoban", "spell_backward",
        "spiral_matrix", "string_insertion", "string_manipulation", "string_splitting", "string_synthesis",
        "sudoku", "survo", "syllogism", "time_intervals", "tower_of_hanoi", "tsumego", "word_ladder",
        "word_sequence_reversal", "word_sorting", "zebra_puzzles",
    ),
}
"""The datasets of reasoning-gym releases, by version: registering them costs no import of the library
(tests/unit/test_reasoning_gym.py checks the list against the installed library's registry)."""

DEFAULT_SYSTEM_PROMPT = "default"
"""The key in ``reasoning_gym.utils.SYSTEM_PROMPTS`` used unless the task names another: think step by step,
then the final answer alone inside ``<answer>...</answer>``."""

ENTRY_CACHE = 1024
"""Generated entries kept per worker (a GRPO group's members reuse their task's entry)."""

MAX_SHOTS = 8
"""Solved examples a task may ask for (``shots``)."""

SHOT_SEED = 1_000_003
"""The examples of a task with seed ``s`` are entries ``0..shots-1`` of the same dataset and config at seed
``s + SHOT_SEED`` (another generator stream than the tasks'; the same examples for every task of a batch)."""

TASK_KEYS = ("config", "seed", "index", "system_prompt", "shots")

COMPOSITE_EXAMPLE: dict[str, Any] = {"datasets": [
    {"name": "basic_arithmetic", "weight": 1.0, "config": {}},
    {"name": "chain_sum", "weight": 1.0, "config": {}},
]}
"""The ``composite`` dataset mixes others and has no default mix."""


class RgSettings(Protocol):
    """What ``specs`` reads of the env worker's settings (``EnvWorkerSettings``; a protocol, so that the settings
    module can import this one to check its values)."""

    rg_datasets: str
    rg_cache_size: int


class RgSettingsError(ValueError):
    """``ROLLOUT_RG_DATASETS`` names something this worker cannot serve (the worker refuses to start)."""


def installed_version() -> str | None:
    """The installed reasoning-gym release (no import of the library), or None when it is not installed."""
    if importlib.util.find_spec("reasoning_gym") is None:
        return None
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # importable but without metadata: read its registry
        return ""


def available_datasets() -> tuple[str, ...]:
    """Every dataset of the installed library (empty when it is not installed): from ``KNOWN_RELEASES`` without
    importing it, else from the imported library's registry."""
    version = installed_version()
    if version is None:
        return ()
    known = KNOWN_RELEASES.get(version)
    if known is not None:
        return known
    log.info("reasoning_gym.import_for_names", version=version)
    return tuple(sorted(importlib.import_module("reasoning_gym.factory").DATASETS))


def parse_datasets(value: str) -> tuple[str, ...] | None:
    """``"all"`` -> None (every dataset), ``""``/``"none"`` -> ``()``, else the comma-separated names (an ``rg:``
    prefix is allowed); ``RgSettingsError`` when a name repeats."""
    text = value.strip()
    if text.lower() == "all":
        return None
    if text.lower() in ("", "none"):
        return ()
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().removeprefix(PREFIX)
        if not name:
            continue
        if name in names:
            raise RgSettingsError(f"ROLLOUT_RG_DATASETS lists {name!r} twice")
        names.append(name)
    return tuple(names)


def enabled_datasets(value: str) -> tuple[str, ...]:
    """The datasets ``ROLLOUT_RG_DATASETS`` enables: ``all`` is every dataset of the installed library (none when
    it is not installed); a listed name the library lacks is an ``RgSettingsError``."""
    wanted = parse_datasets(value)
    if wanted == ():
        return ()
    available = available_datasets()
    if wanted is None:
        return available
    if not available:
        raise RgSettingsError(f"ROLLOUT_RG_DATASETS={value!r} but reasoning-gym is not installed "
                              "(pip install 'rollout-ledger[envs]' or reasoning-gym)")
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise RgSettingsError(f"ROLLOUT_RG_DATASETS: reasoning-gym {installed_version()} has no dataset "
                              f"{', '.join(map(repr, unknown))} (it has {len(available)}, e.g. basic_arithmetic)")
    return wanted


@dataclass(frozen=True)
class RgTask:
    """An ``rg:<dataset>`` task, checked: which entry of which dataset, and the system prompt."""

    dataset: str
    config: dict[str, Any]
    """Fields of the dataset's config dataclass (``size``, difficulty knobs); the seed is ``seed``."""
    seed: int
    index: int
    system_prompt: str
    shots: int = 0
    """Solved examples from the same dataset shown before the question (user question, assistant
    ``<answer>...</answer>``): small models learn the answer format from them."""

    @property
    def config_key(self) -> str:
        return json.dumps(self.config, sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, dataset: str, task: dict[str, Any]) -> RgTask:
        """``{"config": {...}, "seed": n, "index": i, "system_prompt": key}``, every field optional (seed 0,
        index 0); ``TaskError`` names what is wrong."""
        if not isinstance(task, dict):
            raise TaskError(f"an rg task is a JSON object, got {type(task).__name__}")
        unknown = sorted(set(task) - set(TASK_KEYS))
        if unknown:
            raise TaskError(f"unknown task field(s) {', '.join(map(repr, unknown))} for {PREFIX}{dataset}; "
                            f"expected {', '.join(TASK_KEYS)}")
        config = task.get("config", {})
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise TaskError(f"task field 'config' must be an object of the dataset's config fields, got {config!r}")
        if "seed" in config:
            raise TaskError("put the seed in the task's 'seed' field, not in 'config'")
        try:
            json.dumps(config)
        except (TypeError, ValueError) as exc:
            raise TaskError(f"task field 'config' is not JSON: {exc}") from None
        prompt = task.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        if not isinstance(prompt, str):
            raise TaskError(f"task field 'system_prompt' must name a reasoning-gym system prompt, got {prompt!r}")
        shots = _natural(task, "shots")
        if shots > MAX_SHOTS:
            raise TaskError(f"task field 'shots' is at most {MAX_SHOTS}, got {shots}")
        return cls(dataset=dataset, config=config, seed=_natural(task, "seed"), index=_natural(task, "index"),
                   system_prompt=prompt, shots=shots)

    def shot_task(self, index: int) -> RgTask:
        """Solved example ``index`` of this task (see ``SHOT_SEED``)."""
        return dataclasses.replace(self, seed=(self.seed + SHOT_SEED) % 2**32, index=index, shots=0)


def _natural(task: dict[str, Any], key: str) -> int:
    value = task.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TaskError(f"task field {key!r} must be an integer >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class Scored:
    """The library's verdict on one answer."""

    answer: str | None
    """What ``reasoning_gym.utils.extract_answer`` read between the last ``<answer>`` tags (None: no tags)."""
    reward: float
    """``dataset.score_answer(answer, entry)``; 0.0 when the scorer raised on the answer."""
    error: str | None = None
    """The scorer's exception, when it raised (some scorers raise on unparseable answers)."""


class RgLibrary:
    """The reasoning-gym library as one worker uses it: imported on first use, built datasets and generated
    entries in bounded LRUs, every library call on one thread of its own."""

    def __init__(self, cache_size: int = 32, entry_cache: int = ENTRY_CACHE) -> None:
        self.cache_size = cache_size
        self.entry_cache = entry_cache
        self._datasets: OrderedDict[tuple[str, str, int], Any] = OrderedDict()
        self._entries: OrderedDict[tuple[str, str, int, int], dict[str, Any]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.builds = 0
        """Datasets built so far (the cache's misses)."""

    async def _call(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reasoning-gym")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prompt(self, task: RgTask) -> tuple[list[Message], dict[str, Any]]:
        """The prompt (system prompt, solved examples, question) and the entry (question, answer, metadata) of
        ``task``."""
        result: tuple[list[Message], dict[str, Any]] = await self._call(self._prompt, task)
        return result

    async def score(self, task: RgTask, entry: dict[str, Any], completion: str) -> Scored:
        """The library's score of the answer in ``completion`` for ``entry``."""
        result: Scored = await self._call(self._score, task, entry, completion)
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # --- on the library's thread ---------------------------------------------------------------------
    def _prompt(self, task: RgTask) -> tuple[list[Message], dict[str, Any]]:
        prompts = importlib.import_module("reasoning_gym.utils").SYSTEM_PROMPTS
        if task.system_prompt not in prompts:
            raise TaskError(f"unknown system_prompt {task.system_prompt!r}; reasoning-gym has "
                            f"{', '.join(sorted(prompts))}")
        entry = self._entry(task)
        messages: list[Message] = [{"role": "system", "content": prompts[task.system_prompt]}]
        for i in range(task.shots):
            shot = self._entry(task.shot_task(i))
            if shot.get("answer") is None:
                raise TaskError(f"{PREFIX}{task.dataset} has no reference answers to show as shots")
            messages += [{"role": "user", "content": str(shot["question"])},
                         {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}]
        messages.append({"role": "user", "content": str(entry["question"])})
        return messages, entry

    def _entry(self, task: RgTask) -> dict[str, Any]:
        dataset = self._dataset(task)  # built or refreshed in its LRU even on an entry hit: step scores with it
        key = (task.dataset, task.config_key, task.seed, task.index)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        if task.index >= len(dataset):
            raise TaskError(f"index {task.index} is out of range for {PREFIX}{task.dataset} of size {len(dataset)} "
                            "(a larger config.size allows more)")
        entry = dataset[task.index]
        self._entries[key] = entry
        if len(self._entries) > self.entry_cache:
            self._entries.popitem(last=False)
        return entry

    def _dataset(self, task: RgTask) -> Any:
        key = (task.dataset, task.config_key, task.seed)
        dataset = self._datasets.get(key)
        if dataset is not None:
            self._datasets.move_to_end(key)
            return dataset
        dataset = _build(task)
        self.builds += 1
        self._datasets[key] = dataset
        if len(self._datasets) > self.cache_size:
            self._datasets.popitem(last=False)
        return dataset

    def _score(self, task: RgTask, entry: dict[str, Any], completion: str) -> Scored:
        answer: str | None = importlib.import_module("reasoning_gym.utils").extract_answer(completion)
        dataset = self._dataset(task)
        try:
            reward = float(dataset.score_answer(answer, entry))
        except Exception as exc:  # the library's scorer on an answer it cannot parse: no reward
            return Scored(answer, 0.0, f"{type(exc).__name__}: {exc}"[:300])
        return Scored(answer, reward)


def _build(task: RgTask) -> Any:
    """``create_dataset(dataset, **config, seed=seed)``; a config the dataset refuses is a ``TaskError``."""
    factory = importlib.import_module("reasoning_gym.factory")
    if task.dataset not in factory.DATASETS:
        raise TaskError(f"reasoning-gym has no dataset {task.dataset!r}")
    config = dict(task.config)
    config_cls = factory.DATASETS[task.dataset][1]
    fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name != "seed")
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise TaskError(f"{PREFIX}{task.dataset} has no config field(s) {', '.join(map(repr, unknown))}; "
                        f"its fields: {', '.join(fields)}")
    if task.dataset == "composite" and isinstance(config.get("datasets"), list):
        spec = importlib.import_module("reasoning_gym.composite").DatasetSpec
        try:
            config["datasets"] = [spec(**d) if isinstance(d, dict) else d for d in config["datasets"]]
        except TypeError as exc:
            raise TaskError(f"{PREFIX}composite config.datasets: {exc} (each is {{name, weight, config}})") from None
    try:
        return factory.create_dataset(task.dataset, **config, seed=task.seed)
    except (AssertionError, TypeError, ValueError, KeyError) as exc:
        raise TaskError(f"{PREFIX}{task.dataset} refused its config: {type(exc).__name__}: {exc}") from None


class ReasoningGymEnv(Env):
    """One episode of ``rg:<dataset>``: the library's system prompt and question, one answer, the library's
    score of the text inside its last ``<answer>`` tags."""

    resume = REPLAY
    """Deterministic given the task and the actions: a resumed attempt replays the recorded ones."""

    def __init__(self, dataset: str, library: RgLibrary) -> None:
        self.dataset = dataset
        self.library = library
        self._task: RgTask | None = None
        self._entry: dict[str, Any] | None = None

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self._task = RgTask.parse(self.dataset, task)
        messages, self._entry = await self.library.prompt(self._task)
        return messages

    async def step(self, action: str) -> StepResult:
        if self._task is None or self._entry is None:
            raise RuntimeError("step() before reset()")
        scored = await self.library.score(self._task, self._entry, action)
        info: dict[str, Any] = {"dataset": self.dataset, "seed": self._task.seed, "index": self._task.index,
                                "answer": scored.answer, "expected": self._entry.get("answer")}
        source = self._entry.get("metadata", {}).get("source_dataset")
        if source and source != self.dataset:
            info["source_dataset"] = source
        if scored.error is not None:
            info["score_error"] = scored.error
        return StepResult(observation=[], reward=scored.reward, terminated=True, info=info)


def spec(dataset: str, library: RgLibrary) -> EnvSpec:
    """The ``rg:<dataset>`` env, its episodes served by ``library``."""
    example: dict[str, Any] = {"seed": 0, "index": 0}
    if dataset == "composite":
        example["config"] = COMPOSITE_EXAMPLE
    return EnvSpec(
        name=f"{PREFIX}{dataset}",
        factory=lambda: ReasoningGymEnv(dataset, library),
        description=f"reasoning-gym {dataset}: single turn; reward = the library's score_answer of the final "
                    "<answer>...</answer>",
        multi_turn=False,
        example_task=example,
        family=FAMILY,
    )


def specs(settings: RgSettings) -> list[EnvSpec]:
    """One ``rg:<dataset>`` env per dataset ``settings.rg_datasets`` enables, sharing one ``RgLibrary``."""
    names = enabled_datasets(settings.rg_datasets)
    if not names:
        return []
    library = RgLibrary(cache_size=settings.rg_cache_size)
    return [spec(name, library) for name in names]
