"""verl 0.9.1 learning from the ledger through verl's own extension points: an agent loop whose episodes the ledger
runs, and a checkpoint engine (with its manager) that announces each step's weights as a ledger policy version.

Design note
===========

Wiring (``.venv-verl`` from ``make verl`` has verl 0.9.1 on CPU torch; a training run needs verl's GPU extras)::

    # agent_loops.yaml, given as actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: rollout_ledger
      _target_: rollout_ledger.client.adapters.verl.LedgerAgentLoop
      rollout_ledger: {env: guess-number, batch: {max_turns: 4, max_staleness: 0}}

    actor_rollout_ref.rollout.agent.default_agent_loop=rollout_ledger        # or an agent_name column
    +actor_rollout_ref.rollout.custom.rollout_ledger.url=http://scheduler:8000
    actor_rollout_ref.rollout.checkpoint_engine.backend=rollout_ledger
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=rollout_ledger.client.adapters.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_ledger.checkpoint_dir=/shared/ckpt
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_ledger.model_path=${actor_rollout_ref.model.path}
    actor_rollout_ref.rollout.checkpoint_manager_class=rollout_ledger.client.adapters.verl.LedgerCheckpointManager

The registry entry (``agent_loop_config_path``) is what reaches verl's agent-loop workers, which are Ray actors in
processes of their own (``AgentLoopWorker.__init__``, verl/experimental/agent_loop/agent_loop.py 534-539);
importing this module also registers the loop under ``rollout_ledger`` with verl's ``register`` decorator (470),
which is enough when the workers run in the importing process.

**One sample, one ledger episode.** verl calls ``run(sampling_params, **kwargs)`` once per sample, in a fresh
``LedgerAgentLoop`` (``_run_agent_loop``, 661), with the dataset row's fields as ``kwargs``. ``run`` submits the
sample's ledger batch, waits until it is done, reads its episode's trajectory and returns it as
``AgentLoopOutput``. The task is the row's ``extra_info["ledger_task"]`` (a JSON object or its JSON text; text
survives Parquet, where the struct columns of differing tasks get each other's keys as nulls) or what ``task_fn``
makes of the row; the env is ``extra_info["ledger_env"]`` or the configured ``env``.

**Groups.** verl's trainer gives each prompt a ``uid`` and repeats the prompt ``rollout.n`` times in a row
(``RayPPOTrainer.fit``, trainer/ppo/ray_trainer.py 1482-1491); GRPO groups rows by ``uid``. The ledger groups by
``group_id`` (``{batch}.{task_index}``). So each verl group is ONE ledger batch of one task with ``group_size = n``:
its id is derived from the uid and the request (``verl-{uid}-{hash}``), and every sample of the group submits the
same request, which the scheduler makes idempotent (the first creates the batch, the others get it back). Sample
``k`` of the group takes the group's episode ``k``, and ``k`` is ``priority % n``: verl's ``AgentLoopManager``
numbers the rows of the whole batch ``0..N-1`` in ``priority`` before it splits the batch among its workers
(agent_loop.py 1245), and the repeat is interleaved, so row ``u * n + k`` is member ``k`` of prompt ``u``. A group
split across two agent-loop workers still maps to one ledger group, each member to a distinct episode, and the
ledger's own groups (``rollout export --complete-groups``, the viewer, advantages) are verl's. Validation rows use
``val_kwargs.n`` (recognised by their sampling parameters, which ``generate_sequences`` takes from ``val_kwargs``);
a REMAX greedy baseline row has validation's sampling, so it is a group of ``val_kwargs.n`` of its own.
``group_size`` in the settings overrides both.

**Why the REST trajectory, not ``TrajectoryReader``.** An agent loop handles one sample, in many concurrent
coroutines of several Ray actors. ``GET /v1/episodes/{id}/trajectory`` reads exactly that episode's stored
trajectory, token-exact, over HTTP: no database login on the rollout nodes and no shared state. A
``TrajectoryReader`` delivers a consumer's feed in batches, exactly once, to one reader per consumer (an advisory
lock): hundreds of per-sample readers cannot share one cursor, and a cursor per sample would be a feed scan each.
So the agent loop needs no database URL; ``TrajectoryReader(..., fmt="verl")`` stays the way to read the same
rows in bulk (the tests check that both give the same samples).

**The sample** is the ledger's ``verl`` record (the shape ``rollout export --format verl`` writes) of
the trajectory's last segment: ``prompt_ids`` (the context before the first sampled id), ``response_ids``
(sampled ids and the environment's observation ids between turns), ``response_mask`` (1 exactly on sampled ids),
``response_logprobs`` (the engine's logprob of each sampled id, stored at generation; 0.0 elsewhere),
``reward_score`` (the episode's reward: verl's ``_postprocess`` puts it on the last response token as
``rm_scores``, 1097-1098), ``num_turns`` (the prompt, each sampled turn and each observation, as verl counts
messages) and ``extra_fields`` ``ledger_*`` (episode, group, batch, status, attempt, reward, weight versions),
which verl turns into columns of the batch. A trajectory with several segments (a context policy or chat template
that rewrote history) trains its last one only: verl takes one sequence per sample (``ledger_num_samples`` says
how many there were). A response longer than ``rollout.response_length`` is cut to it (``ledger_cut_from``), a
prompt longer than ``rollout.prompt_length`` keeps its end (verl's ``_cap_text_prompt_length``).

**Failures are data.** An episode that failed (env or inference) returns a sample that trains nothing (its
response mask all 0) with reward 0.0 and ``ledger_status`` saying why; one that ended without a trajectory
(cancelled, failed before its first turn) returns its prompt and an empty response. The group keeps its layout;
the failed member's 0.0 does count in verl's group mean (verl has no per-sample exclusion). The ledger being
unreachable, refusing a request or not finishing in ``timeout_s`` raises ``VerlLedgerError``: the step fails.

**Weights.** ``LedgerCheckpointManager`` (``rollout.checkpoint_manager_class``; ray_trainer.py 969-978 builds it)
makes ``update_weights(global_steps)``, which verl calls after each step and once before training (1430, 1686),
ask the actor workers for their weights through the ``rollout_ledger`` checkpoint-engine backend
(engine_workers.py 758-765: ``send_weights`` of ``get_per_tensor_param()``): ``LedgerCheckpointEngine`` on rank 0
writes them as a Hugging Face directory (sharded safetensors, plus the model's config and tokenizer files) to
``checkpoint_dir/v{version:06d}`` (written aside and renamed: the ledger never sees half a checkpoint) and announces
it with ``LedgerClient.publish_version(version, dir, mode)``, returning once every inference worker serves it. The
other ranks consume the generator (FSDP gathers each tensor collectively) and write nothing. ``version`` is
``global_steps + version_offset``; step 0 (the base model the ledger already serves) is not published unless
``publish_initial``. verl's own rollout replicas are not updated (the ledger's inference workers generate);
``checkpoint_dir`` must be readable by those workers at the same path.

**Settings** (first found wins): the ``rollout_ledger`` mapping of the agent loop's registry entry; then
``actor_rollout_ref.rollout.custom.rollout_ledger`` (verl's config has no ``custom`` key until one is added, hence
the ``+``); then environment variables, which must be set where verl's agent-loop and actor workers run (Ray
actors: the driver's environment on a local cluster, ``runtime_env.env_vars`` on others). The checkpoint engine
reads ``checkpoint_engine.engine_kwargs.rollout_ledger`` (verl passes them as keyword arguments), then the
environment. Each field's docstring names its variable (``AgentLoopSettings``, ``WeightSettings``). No database
URL: both sides speak to the scheduler only. The scheduler's token is ``token`` or ``ROLLOUT_API_TOKEN``.

What needs a GPU (not run by the tests, which run verl's own agent-loop workers, dataset, batch assembly and
checkpoint-engine registry on CPU against a real ledger): verl's trainer itself (``RayPPOTrainer.fit``), its
FSDP / Megatron actor workers (so ``get_per_tensor_param`` from a sharded model), its vLLM / sglang rollout
servers, which the trainer still starts and puts to sleep though this agent loop never calls them, and the
checkpoint engine's collective consumption across ranks.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import orjson
import structlog

from rollout_ledger.client import records
from rollout_ledger.client.rest import LedgerClient, SchedulerError
from rollout_ledger.shared.errors import RolloutError

log = structlog.get_logger(__name__)

NAME = "rollout_ledger"
"""The agent loop's registered name, the checkpoint-engine backend, and the settings key in verl's config."""
BATCH_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What the scheduler accepts as a client batch id."""
NO_TRAINING = ("failed",)
"""Trajectory statuses whose sampled ids train nothing (an infrastructure or env failure, not the policy's)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
"""Files of a model directory that are weights (not copied into a version: the new weights replace them)."""
POLL_FIRST_S = 0.05
"""The first wait between two looks at a batch; it doubles up to ``poll_s``."""


class VerlLedgerError(RolloutError):
    """The ledger could not give verl a sample or take its weights (the message says why and what to set)."""


# --- settings ---------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """An OmegaConf node (verl's config) as plain Python containers; anything else as it is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # no verl, so no OmegaConf node either
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _json_object(value: Any, what: str) -> dict[str, Any]:
    value = _plain(value)
    if value is None:
        return {}
    parsed = orjson.loads(value) if isinstance(value, str | bytes) else value
    if not isinstance(parsed, Mapping):
        raise VerlLedgerError(f"{what} must be a JSON object (a mapping), got {parsed!r}")
    return dict(parsed)


def _layered(cls: type[Any], sources: Sequence[Mapping[str, Any]], env: Mapping[str, str],
             environ: Mapping[str, str]) -> dict[str, Any]:
    """Each field of ``cls``: from the first source that sets it, else its environment variable (``env``)."""
    known = {f.name for f in fields(cls)}
    for source in sources:
        unknown = set(source) - known
        if unknown:
            raise VerlLedgerError(f"unknown {NAME} setting(s) {sorted(unknown)}; known: {sorted(known)}")
    out: dict[str, Any] = {}
    for name in known:
        value = next((s[name] for s in sources if s.get(name) is not None), None)
        if value is None and environ.get(env.get(name, "")):
            value = environ[env[name]]
        if value is not None:
            out[name] = _plain(value)
    return out


@dataclass(frozen=True)
class AgentLoopSettings:
    """How ``LedgerAgentLoop`` reaches the ledger and what it asks for."""

    url: str = "http://127.0.0.1:8000"
    """The scheduler's REST API (``ROLLOUT_SCHEDULER_URL``)."""
    token: str | None = None
    """Its bearer token; else what ``LedgerClient`` resolves (``ROLLOUT_API_TOKEN``, the local stack's)."""
    env: str | None = None
    """The ledger environment of every sample without ``extra_info["ledger_env"]`` (``ROLLOUT_VERL_ENV``)."""
    batch: dict[str, Any] = field(default_factory=dict)
    """More fields of each ``POST /v1/batches`` (``max_turns``, ``context``, ``max_staleness``, ``metadata``,
    ``sampling``), a mapping or its JSON text (``ROLLOUT_VERL_BATCH``). verl's temperature, top_p and top_k
    override ``sampling``'s; ``sampling.max_tokens`` (per turn) defaults to ``rollout.response_length``."""
    task_key: str = "ledger_task"
    """The key of ``extra_info`` (or of the row) holding the ledger task (``ROLLOUT_VERL_TASK_KEY``)."""
    task_fn: str | None = None
    """``module:function`` (or ``module.function``) making the task of a row's ``kwargs`` instead
    (``ROLLOUT_VERL_TASK_FN``)."""
    group_size: int | None = None
    """Episodes per verl group; None: ``rollout.n``, ``val_kwargs.n`` for validation rows
    (``ROLLOUT_VERL_GROUP_SIZE``). It must be the number of rows verl repeats each prompt into."""
    timeout_s: float | None = None
    """How long a sample waits for its batch; None: as long as it runs (``ROLLOUT_VERL_TIMEOUT_S``)."""
    poll_s: float = 1.0
    """The longest wait between two looks at the batch (``ROLLOUT_VERL_POLL_S``)."""
    batch_prefix: str = "verl"
    """The start of every batch id (``ROLLOUT_VERL_BATCH_PREFIX``): give each run its own when uids could repeat."""

    ENV: ClassVar[dict[str, str]] = {
        "url": "ROLLOUT_SCHEDULER_URL", "env": "ROLLOUT_VERL_ENV", "batch": "ROLLOUT_VERL_BATCH",
        "task_key": "ROLLOUT_VERL_TASK_KEY", "task_fn": "ROLLOUT_VERL_TASK_FN",
        "group_size": "ROLLOUT_VERL_GROUP_SIZE", "timeout_s": "ROLLOUT_VERL_TIMEOUT_S",
        "poll_s": "ROLLOUT_VERL_POLL_S", "batch_prefix": "ROLLOUT_VERL_BATCH_PREFIX"}
    """The environment variable of each field."""

    @classmethod
    def resolve(cls, *sources: Mapping[str, Any] | None,
                environ: Mapping[str, str] | None = None) -> AgentLoopSettings:
        """From the given mappings in order (the registry entry's, ``rollout.custom``'s), then the environment."""
        got = _layered(cls, [_json_object(s, NAME) for s in sources], cls.ENV,
                       os.environ if environ is None else environ)
        if "batch" in got:
            got["batch"] = _json_object(got["batch"], f"{NAME}.batch")
        for name, kind in (("group_size", int), ("timeout_s", float), ("poll_s", float)):
            if name in got:
                got[name] = kind(got[name])
        settings = cls(**got)
        if settings.group_size is not None and settings.group_size < 1:
            raise VerlLedgerError(f"{NAME}.group_size must be at least 1, got {settings.group_size}")
        return settings


@dataclass(frozen=True)
class WeightSettings:
    """Where ``LedgerCheckpointEngine`` writes each version and how it announces it."""

    url: str = "http://127.0.0.1:8000"
    """The scheduler's REST API (``ROLLOUT_SCHEDULER_URL``)."""
    token: str | None = None
    """Its bearer token; else what ``LedgerClient`` resolves (``ROLLOUT_API_TOKEN``)."""
    checkpoint_dir: str | None = None
    """Where versions are written, ``v{version:06d}`` each: a path the ledger's inference workers read as well
    (``ROLLOUT_VERL_CHECKPOINT_DIR``). Required."""
    model_path: str | None = None
    """The local Hugging Face directory of the model being trained: its config, generation config and tokenizer
    files go into each version (``ROLLOUT_VERL_MODEL_PATH``). Required."""
    swap_mode: str = "drain"
    """How the inference workers move to a new version: drain, abort or keep (``ROLLOUT_VERL_SWAP_MODE``)."""
    serve_timeout_s: float = 600.0
    """How long ``update_weights`` waits for every inference worker to serve it (``ROLLOUT_VERL_SERVE_TIMEOUT_S``)."""
    version_offset: int = 0
    """Added to verl's ``global_steps`` (``ROLLOUT_VERL_VERSION_OFFSET``): the ledger refuses a version not above
    the newest, so a new run on a ledger that served versions before starts above them."""
    shard_mb: int = 4096
    """Safetensors shard size at most, in MiB (``ROLLOUT_VERL_SHARD_MB``)."""
    publish_initial: bool = False
    """Publish version ``0 + version_offset`` too, at verl's first ``update_weights`` (step 0: the base model,
    which the ledger serves already when it was started with it) (``ROLLOUT_VERL_PUBLISH_INITIAL``)."""

    ENV: ClassVar[dict[str, str]] = {
        "url": "ROLLOUT_SCHEDULER_URL", "checkpoint_dir": "ROLLOUT_VERL_CHECKPOINT_DIR",
        "model_path": "ROLLOUT_VERL_MODEL_PATH", "swap_mode": "ROLLOUT_VERL_SWAP_MODE",
        "serve_timeout_s": "ROLLOUT_VERL_SERVE_TIMEOUT_S", "version_offset": "ROLLOUT_VERL_VERSION_OFFSET",
        "shard_mb": "ROLLOUT_VERL_SHARD_MB", "publish_initial": "ROLLOUT_VERL_PUBLISH_INITIAL"}
    """The environment variable of each field."""

    @classmethod
    def resolve(cls, given: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> WeightSettings:
        got = _layered(cls, [_json_object(given, f"engine_kwargs.{NAME}")], cls.ENV,
                       os.environ if environ is None else environ)
        for name, kind in (("serve_timeout_s", float), ("version_offset", int), ("shard_mb", int)):
            if name in got:
                got[name] = kind(got[name])
        if isinstance(got.get("publish_initial"), str):
            got["publish_initial"] = got["publish_initial"].strip().lower() in ("1", "true", "yes", "on")
        return cls(**got)

    def version_of(self, global_steps: int | None) -> int | None:
        """The ledger version of verl's step, or None when the step is not published (step 0 by default)."""
        if global_steps is None or (global_steps == 0 and not self.publish_initial):
            return None
        return int(global_steps) + self.version_offset

    def required(self) -> tuple[Path, Path]:
        """``checkpoint_dir`` and ``model_path``, or the error naming what is missing."""
        missing = [name for name in ("checkpoint_dir", "model_path") if not getattr(self, name)]
        if missing:
            raise VerlLedgerError(f"set {', '.join(missing)} in checkpoint_engine.engine_kwargs.{NAME} (or "
                                  + ", ".join(self.ENV[m] for m in missing) + ")")
        model = Path(str(self.model_path))
        if not (model / "config.json").is_file():
            raise VerlLedgerError(f"model_path {model} is not a local Hugging Face directory (no config.json)")
        return Path(str(self.checkpoint_dir)), model


# --- one sample: request, membership, trajectory -> AgentLoopOutput fields ----------------------------------------


def _json_safe(value: Any) -> Any:
    """Plain JSON values of a dataset field (numpy scalars and arrays included)."""
    return orjson.loads(orjson.dumps(_plain(value), option=orjson.OPT_SERIALIZE_NUMPY))


def load_function(path: str) -> Callable[..., Any]:
    """``module:function`` or ``module.function``."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise VerlLedgerError(f"task_fn {path!r} is not module:function")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise VerlLedgerError(f"task_fn {path!r} is not a function")
    return fn


def default_task(sample: Mapping[str, Any], key: str = "ledger_task") -> dict[str, Any]:
    """The ledger task of a verl row: ``extra_info[key]``, else the row's ``key``; a mapping or its JSON text."""
    extra = _plain(sample.get("extra_info"))
    task = extra.get(key) if isinstance(extra, Mapping) else None
    if task is None:
        task = sample.get(key)
    if task is None:
        raise VerlLedgerError(f"this row has no ledger task: put it in the dataset's extra_info[{key!r}] (a JSON "
                              "object, or its JSON text), or set task_fn")
    return _json_object(_json_safe(task), f"the task in {key!r}")


def sample_env(sample: Mapping[str, Any], default: str | None) -> str:
    """``extra_info["ledger_env"]`` of the row, else the configured env."""
    extra = _plain(sample.get("extra_info"))
    env = extra.get("ledger_env") if isinstance(extra, Mapping) else None
    env = env or default
    if not env:
        raise VerlLedgerError(f"no ledger env: set {NAME}.env (ROLLOUT_VERL_ENV) or extra_info['ledger_env']")
    return str(env)


def sampling_request(verl_params: Mapping[str, Any], base: Mapping[str, Any], response_length: int) -> dict[str, Any]:
    """The batch's ``sampling``: the configured one, with verl's temperature, top_p and top_k over it."""
    out = dict(_json_object(base, f"{NAME}.batch.sampling"))
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        if verl_params.get(name) is not None:
            out[name] = kind(verl_params[name])
    out.setdefault("max_tokens", int(response_length))
    return out


def group_size_of(verl_params: Mapping[str, Any], rollout: Any, given: int | None = None) -> int:
    """How many rows verl made of this sample's prompt: ``given``, else ``val_kwargs.n`` for a row sampled with
    validation's parameters that differ from training's (``generate_sequences`` takes them from ``val_kwargs``),
    else ``rollout.n``. ``rollout`` is ``actor_rollout_ref.rollout`` (a DictConfig or the dataclass)."""
    if given is not None:
        return given
    val = rollout.val_kwargs
    key = ("temperature", "top_p", "top_k")
    got = tuple(verl_params.get(k) for k in key)
    train = tuple(getattr(rollout, k) for k in key)
    validation = tuple(getattr(val, k) for k in key)
    if got == validation and got != train:
        return int(val.n)
    if got == validation and int(val.n) > int(rollout.n):
        raise VerlLedgerError(f"validation and training sample alike ({dict(zip(key, got, strict=True))}) and "
                              f"val_kwargs.n {val.n} > rollout.n {rollout.n}: a validation row cannot be told from a "
                              f"training one; set {NAME}.group_size or give validation its own sampling")
    return int(rollout.n)


def member_of(priority: Any, group_size: int) -> int:
    """Which episode of its group a row is: ``priority % group_size`` (see the design note)."""
    if priority is None:
        raise VerlLedgerError("the row has no `priority`: verl's AgentLoopManager numbers every row of a batch "
                              "with it (agent_loop.py 1245); a custom manager must do the same")
    return int(priority) % group_size


def batch_id_of(prefix: str, uid: str, request: Mapping[str, Any]) -> str:
    """The ledger batch of one verl group: the prefix, the uid and a hash of the request (a group sampled otherwise,
    a REMAX baseline, is another batch instead of a conflict)."""
    digest = hashlib.sha256(orjson.dumps(request, option=orjson.OPT_SORT_KEYS)).hexdigest()[:8]
    name = f"{prefix}-{uid}-{digest}"
    if not BATCH_ID.match(name):
        name = f"{prefix[:24]}-{hashlib.sha256(uid.encode()).hexdigest()[:24]}-{digest}"
    if not BATCH_ID.match(name):
        raise VerlLedgerError(f"batch_prefix {prefix!r} makes no valid batch id ([A-Za-z0-9_-])")
    return name


@dataclass(frozen=True)
class LedgerSample:
    """What ``AgentLoopOutput`` gets from one episode (verl-free, so it is tested without verl)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 exactly on sampled ids (0 on observation ids, and everywhere for a failed trajectory)."""
    response_logprobs: list[float]
    """The engine's logprob of each sampled id, verbatim (float32); 0.0 elsewhere."""
    reward: float
    num_turns: int
    extra: dict[str, Any]
    """``ledger_*`` fields: verl makes each a column of the batch."""


def _ids(trajectory: Mapping[str, Any]) -> dict[str, Any]:
    versions = [int(v) for v in trajectory.get("weight_versions") or [] if int(v) >= 0]
    return {
        "ledger_episode_id": trajectory["episode_id"], "ledger_group_id": trajectory["group_id"],
        "ledger_batch_id": trajectory["batch_id"], "ledger_status": trajectory["status"],
        "ledger_attempt": int(trajectory["attempt"]), "ledger_reward": trajectory["reward"],
        "ledger_min_version": min(versions, default=None), "ledger_max_version": max(versions, default=None),
    }


def turns_of(trajectory: Mapping[str, Any]) -> int:
    """verl's ``num_turns``: messages, so the prompt, each sampled turn and each observation."""
    kinds = [s["kind"] for s in trajectory.get("spans") or []]
    sampled = {s["turn_index"] for s in trajectory.get("spans") or [] if s["kind"] == "sampled"}
    return 1 + (len(sampled) if kinds else int(trajectory["num_turns"])) + kinds.count("observation")


def sample_of(trajectory: Mapping[str, Any], response_length: int) -> LedgerSample:
    """The verl sample of a stored trajectory (``GET /v1/episodes/{id}/trajectory``): the ledger's ``verl`` shape
    (docs/export.md; ``rollout export --format verl``) of its last segment, the response cut to
    ``response_length``."""
    ids = np.asarray(trajectory["token_ids"], np.int32)
    mask = np.asarray(trajectory["loss_mask"], np.int32)
    logprobs = np.asarray(trajectory["logprobs"], np.float32)
    found = records.samples({"segments": trajectory["segments"], "action_ranges": trajectory["action_ranges"]})
    if found:
        s, p, e = found[-1].start, found[-1].prompt_end, found[-1].end
    else:  # nothing sampled (it failed at its first turn): the prompt alone
        s = 0
        p = e = int(trajectory["prompt_len"])
    extra = _ids(trajectory)
    extra["ledger_num_samples"] = len(found)
    extra["ledger_cut_from"] = e - p if e - p > response_length else None
    e = min(e, p + response_length)
    response_mask = np.zeros(e - p, np.int32) if trajectory["status"] in NO_TRAINING else mask[p:e]
    reward = trajectory["reward"]
    return LedgerSample(
        prompt_ids=ids[s:p].tolist(), response_ids=ids[p:e].tolist(), response_mask=response_mask.tolist(),
        response_logprobs=logprobs[p:e].tolist(),
        reward=0.0 if reward is None or trajectory["status"] in NO_TRAINING else float(reward),
        num_turns=turns_of(trajectory), extra=extra)


def missing_sample(episode: Mapping[str, Any], prompt_ids: Sequence[int]) -> LedgerSample:
    """The sample of an episode that ended without a trajectory: its prompt, no response, reward 0.0."""
    extra = {
        "ledger_episode_id": episode["id"], "ledger_group_id": episode["group_id"],
        "ledger_batch_id": episode["batch_id"], "ledger_status": episode["status"],
        "ledger_attempt": int(episode["attempt"]), "ledger_reward": None, "ledger_min_version": None,
        "ledger_max_version": None, "ledger_num_samples": 0, "ledger_cut_from": None,
    }
    return LedgerSample([int(t) for t in prompt_ids], [], [], [], 0.0, 1, extra)


class EpisodeRun:
    """One verl row's episode on the ledger: submit (idempotent), wait for its group, read it (blocking calls,
    each run in a thread by the agent loop)."""

    def __init__(self, ledger: LedgerClient, request: Mapping[str, Any], member: int) -> None:
        self.ledger = ledger
        self.request = dict(request)
        self.member = member
        self.batch_id = str(request["batch_id"])
        self.episode_id: str | None = None

    def submit(self) -> str:
        created = self.ledger.submit(**self.request)
        ids = created["episode_ids"]
        if self.member >= len(ids):
            raise VerlLedgerError(f"batch {self.batch_id} has {len(ids)} episodes; this row is member {self.member}")
        self.episode_id = str(ids[self.member])
        return self.episode_id

    def done(self) -> bool:
        return bool(self.ledger.batch(self.batch_id).get("done"))

    def _get(self, path: str) -> dict[str, Any] | None:
        resp = self.ledger.http.get(path)
        if resp.status_code == httpx.codes.NOT_FOUND:
            return None
        if resp.status_code >= 400:
            raise SchedulerError(f"GET {path} -> {resp.status_code}: {resp.text}")
        body: dict[str, Any] = resp.json()
        return body

    def trajectory(self) -> dict[str, Any] | None:
        """The stored trajectory (None when the episode ended without one)."""
        return self._get(f"/v1/episodes/{self.episode_id}/trajectory")

    def episode(self) -> dict[str, Any]:
        got = self._get(f"/v1/episodes/{self.episode_id}")
        if got is None:
            raise VerlLedgerError(f"episode {self.episode_id} of batch {self.batch_id} is unknown to the scheduler")
        return got


# --- weights: a Hugging Face directory per version -----------------------------------------------------------------


def version_dir(checkpoint_dir: Path, version: int) -> Path:
    return checkpoint_dir / f"v{version:06d}"


def copy_model_files(model_path: Path, dest: Path) -> list[str]:
    """The model directory's files that are not weights (config, generation config, tokenizer, chat template)."""
    copied = []
    for path in sorted(model_path.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    return copied


class ShardWriter:
    """Writes ``(name, tensor)`` pairs as safetensors shards of at most ``shard_bytes`` (one tensor over it gets a
    shard of its own), then the index; names them as Hugging Face does. Blocking: ``write_version`` runs it in a
    thread."""

    def __init__(self, dest: Path, shard_bytes: int) -> None:
        self.dest = dest
        self.shard_bytes = max(1, shard_bytes)
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: Any) -> None:
        if name in self.pending or any(name in names for _, names in self.files):
            raise VerlLedgerError(f"tensor {name!r} came twice from the trainer")
        size = int(tensor.numel()) * int(tensor.element_size())
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        # a copy on the CPU: the trainer may reuse the GPU buffer, and safetensors refuses shared storage
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        path = self.dest / f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending = {}
        self.total_bytes += self.pending_bytes
        self.pending_bytes = 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards ``-of-`` and write the index (one shard: ``model.safetensors``)."""
        self.flush()
        if not self.files:
            raise VerlLedgerError("the trainer sent no weights")
        if len(self.files) == 1:
            self.files[0][0].rename(self.dest / "model.safetensors")
            return ["model.safetensors"]
        count, weight_map, names = len(self.files), {}, []
        for i, (path, tensors) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.dest / final)
            names.append(final)
            weight_map.update(dict.fromkeys(tensors, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        return names


async def _pairs(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    if hasattr(weights, "__aiter__"):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair


def _aside(checkpoint_dir: Path, version: int) -> Path:
    """An empty directory beside where version ``version`` goes."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    partial = checkpoint_dir / f".{version_dir(checkpoint_dir, version).name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    return partial


def _into_place(partial: Path, model_path: Path, final: Path) -> None:
    copy_model_files(model_path, partial)
    if final.exists():  # a crashed run's, or a repeated step's
        shutil.rmtree(final)
    partial.rename(final)


async def write_version(weights: Any, checkpoint_dir: Path, model_path: Path, version: int,
                        shard_bytes: int) -> tuple[Path, int]:
    """Write a version's directory aside, then rename it into place (replacing one a crashed run left); its path
    and the bytes of its weights. The file work runs in threads: the trainer's event loop keeps going."""
    final = version_dir(checkpoint_dir, version)
    partial = await asyncio.to_thread(_aside, checkpoint_dir, version)
    try:
        writer = ShardWriter(partial, shard_bytes)
        async for name, tensor in _pairs(weights):
            await asyncio.to_thread(writer.add, str(name), tensor)
        await asyncio.to_thread(writer.close)
        await asyncio.to_thread(_into_place, partial, model_path, final)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, partial, True)
        raise
    return final, writer.total_bytes


def publish(settings: WeightSettings, version: int, directory: Path, global_steps: int | None) -> float:
    """Announce ``directory`` as ``version`` and wait until every inference worker serves it; the seconds it took."""
    with LedgerClient(settings.url, settings.token) as ledger:
        try:
            return ledger.publish_version(version, directory, mode=settings.swap_mode,
                                          notes=f"verl global_steps {global_steps}",
                                          timeout_s=settings.serve_timeout_s)
        except SchedulerError as exc:
            raise VerlLedgerError(f"the ledger refused version {version} ({exc}); a ledger that served versions "
                                  f"before needs {NAME}.version_offset above them") from exc


# --- verl's classes (only where verl is installed: the main venv imports this module without it) -----------------

try:
    import ray
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
    from verl.utils.ray_utils import auto_await
except ImportError as exc:  # the main venv (and any trainer without verl): the pure parts above still serve
    VERL_IMPORT_ERROR: ImportError | None = exc

    class _VerlMissing:
        """Stands in for verl's base classes where verl is not installed: using a class built on it says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise VerlLedgerError(f"rollout_ledger.client.adapters.verl needs verl 0.9.1 ({VERL_IMPORT_ERROR}); "
                                  "`make verl` builds .venv-verl with it")

    AgentLoopBase = CheckpointEngine = CheckpointEngineManager = _VerlMissing

    def register(agent_name: str) -> Callable[[type[Any]], type[Any]]:
        return lambda cls: cls

    def auto_await(func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    class _NoRegistry:
        @staticmethod
        def register(backend: str) -> Callable[[type[Any]], type[Any]]:
            return lambda cls: cls

    CheckpointEngineRegistry = _NoRegistry
else:
    VERL_IMPORT_ERROR = None


@register(NAME)
class LedgerAgentLoop(AgentLoopBase):
    """verl's agent loop whose episodes the ledger runs (see the design note). Built by verl per sample with
    ``rollout_ledger`` from the registry entry (``agent_loop_config_path``)."""

    def __init__(self, *args: Any, rollout_ledger: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        custom = _plain(self.rollout_config.get("custom")) or {}
        self.settings = AgentLoopSettings.resolve(rollout_ledger, custom.get(NAME))

    def _task(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if self.settings.task_fn:
            return _json_object(_json_safe(load_function(self.settings.task_fn)(kwargs)), "task_fn's task")
        return default_task(kwargs, self.settings.task_key)

    def request_of(self, sampling_params: Mapping[str, Any], kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """The ``POST /v1/batches`` body of this row's group and the row's member index."""
        uid = kwargs.get("uid")
        if uid is None:
            raise VerlLedgerError("the row has no `uid`: verl's trainer gives every prompt one (ray_trainer.py 1482)")
        size = group_size_of(sampling_params, self.rollout_config, self.settings.group_size)
        extra = {k: v for k, v in self.settings.batch.items() if k not in ("sampling", "metadata")}
        body = {
            **extra,
            "env": sample_env(kwargs, self.settings.env),
            "tasks": [self._task(kwargs)],
            "group_size": size,
            "sampling": sampling_request(sampling_params, self.settings.batch.get("sampling") or {},
                                         self.rollout_config.response_length),
            "metadata": {**_json_object(self.settings.batch.get("metadata"), f"{NAME}.batch.metadata"),
                         "verl_uid": str(uid)},
        }
        body["batch_id"] = batch_id_of(self.settings.batch_prefix, str(uid), body)
        return body, member_of(kwargs.get("priority"), size)

    async def _wait(self, run: EpisodeRun) -> None:
        deadline = None if self.settings.timeout_s is None else time.monotonic() + self.settings.timeout_s
        pause = POLL_FIRST_S
        while not await asyncio.to_thread(run.done):
            if deadline is not None and time.monotonic() > deadline:
                raise VerlLedgerError(f"batch {run.batch_id} not done after {self.settings.timeout_s} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.settings.poll_s)

    async def _prompt_of(self, episode: Mapping[str, Any], kwargs: Mapping[str, Any]) -> list[int]:
        """The prompt of an episode without a trajectory: the env's rendering when it got that far, else verl's."""
        if episode.get("prompt_token_ids"):
            return [int(t) for t in episode["prompt_token_ids"]]
        return list(await self.ct_build_initial_tokens(list(_plain(kwargs["raw_prompt"]))))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        began = time.monotonic()
        request, member = self.request_of(sampling_params, kwargs)
        with LedgerClient(self.settings.url, self.settings.token) as ledger:
            run = EpisodeRun(ledger, request, member)
            await asyncio.to_thread(run.submit)
            await self._wait(run)
            trajectory = await asyncio.to_thread(run.trajectory)
            if trajectory is not None:
                sample = sample_of(trajectory, int(self.rollout_config.response_length))
            else:
                episode = await asyncio.to_thread(run.episode)
                sample = missing_sample(episode, await self._prompt_of(episode, kwargs))
        waited = time.monotonic() - began
        log.debug("verl.sample", episode_id=run.episode_id, status=sample.extra["ledger_status"],
                  response_len=len(sample.response_ids), seconds=round(waited, 3))
        return AgentLoopOutput(
            prompt_ids=self._cap_text_prompt_length(sample.prompt_ids),
            response_ids=sample.response_ids,
            response_mask=sample.response_mask,
            response_logprobs=sample.response_logprobs,
            reward_score=sample.reward,
            num_turns=sample.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=waited),
            extra_fields=dict(sample.extra),
        )


@CheckpointEngineRegistry.register(NAME)
class LedgerCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine backend ``rollout_ledger``: ``send_weights`` on the actor's rank 0 writes the
    weights as a Hugging Face directory and publishes it as the ledger's policy version (see the design note).
    Built by verl's actor workers as ``CheckpointEngineRegistry.new(backend, is_master=rank == 0, bucket_size=...,
    **engine_kwargs[backend])`` (verl/workers/engine_workers.py 686)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **settings: Any) -> None:
        super().__init__()
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = WeightSettings.resolve(settings)

    # no process group: the ledger's inference workers read the directory, nothing goes rank to rank
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
                           global_steps: int | None = None) -> dict[str, Any]:
        """Write and publish ``weights`` as version ``global_steps + version_offset`` (rank 0); the metrics."""
        version = self.settings.version_of(global_steps)
        if version is None:
            return {f"{NAME}/published": 0}
        if not self.is_master:  # every rank takes part in gathering each tensor; rank 0 alone keeps them
            async for _ in _pairs(weights):
                pass
            return {}
        checkpoint_dir, model_path = self.settings.required()
        began = time.monotonic()
        directory, size = await write_version(weights, checkpoint_dir, model_path, version,
                                              self.settings.shard_mb << 20)
        wrote = time.monotonic() - began
        served = await asyncio.to_thread(publish, self.settings, version, directory, global_steps)
        log.info("verl.version_served", version=version, checkpoint=str(directory), bytes=size,
                 write_s=round(wrote, 3), serve_s=round(served, 3))
        return {f"{NAME}/published": 1, f"{NAME}/version": version, f"{NAME}/write_s": wrote,
                f"{NAME}/serve_s": served, f"{NAME}/bytes": size}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        raise VerlLedgerError("the ledger's inference workers load each published directory: verl's rollout "
                              f"replicas receive nothing through {NAME} (use LedgerCheckpointManager)")
        yield  # an async generator, as the interface declares  # pragma: no cover


class LedgerCheckpointManager(CheckpointEngineManager):
    """verl's ``rollout.checkpoint_manager_class``: ``update_weights`` has the actor workers send their weights
    through the ``rollout_ledger`` backend (which publishes them) and leaves verl's own rollout replicas alone."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        if getattr(config, "backend", None) != NAME:
            raise VerlLedgerError(f"LedgerCheckpointManager needs actor_rollout_ref.rollout.checkpoint_engine.backend"
                                  f"={NAME} (and custom_backend_module=rollout_ledger.client.adapters.verl), "
                                  f"got {getattr(config, 'backend', None)!r}")
        super().__init__(config, actor_wg, replicas)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        results = self.actor_wg.update_weights(global_steps=global_steps, mode=NAME)
        if inspect.isawaitable(results):
            results = await results
        elif isinstance(results, list) and results and isinstance(results[0], ray.ObjectRef):
            results = await asyncio.to_thread(ray.get, results)
        metrics: dict[str, Any] = {}
        for result in results if isinstance(results, list) else [results]:
            if isinstance(result, dict):
                metrics.update(result)
        return metrics
