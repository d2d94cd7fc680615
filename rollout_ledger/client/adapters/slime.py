"""slime learning from the ledger through slime's own extension points: a rollout function that takes each rollout
step's groups from the ledger, and a post-write hook that serves each weight version slime writes to disk.

slime (THUDM/slime, not on PyPI; read at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515) loads both by path::

    --rollout-function-path rollout_ledger.client.adapters.slime.generate_rollout
    --custom-reward-post-process-path rollout_ledger.client.adapters.slime.reward_post_process   # recommended
    --update-weight-transport disk --update-weight-disk-dir /shared/weights --update-weight-disk-keep-files
    --custom-update-weight-post-write-path rollout_ledger.client.adapters.slime.post_write_hook
    --custom-config-path ledger.yaml      # ledger_env: arithmetic, ledger_url: ..., (see LedgerSettings)

``Sample``: the adapter builds slime's own ``slime.utils.types.Sample`` when slime is importable. Without slime (the
unit tests, a process that only converts) pass the class as ``generate_rollout(..., sample_cls=Sample)``: anything
with slime's field names and a nested ``Status`` enum (``tests/unit/slime_contract.py`` is the pinned stand-in).

Design note. slime asks its rollout function for ``args.rollout_batch_size`` groups of ``args.n_samples_per_prompt``
samples per step (``slime/utils/arguments.py`` 691-701; its own function asserts both, ``slime/rollout/
sglang_rollout.py`` 425 and 453). Each call of ``generate_rollout``:

1. takes ``rollout_batch_size`` prompt groups from slime's ``data_source`` (what a slime user configured with
   ``--prompt-data``: each group is n copies of one dataset row with ``group_index`` and ``index`` set,
   ``slime/rollout/data_source.py`` 90-118) and makes one ledger task of each (``default_task``);
2. opens the consumer's cursor (a new consumer starts after what is readable now), then submits the tasks as ONE
   batch with ``group_size = n_samples_per_prompt`` and a batch id derived from the consumer and the rollout id
   (``{consumer}-r{rollout_id}``): a restarted run that submits the same step again gets the same batch back
   instead of a second one (and, when that batch was delivered to the consumer before, stops saying so);
3. reads exactly that batch's groups through ``TrajectoryReader.read_groups`` (complete groups, record shape
   ``slime``), checking the batch between waits: once every episode of it is terminal and its groups still cannot
   all be delivered, it stops with the cause rather than waiting forever;
4. turns every record into a ``Sample`` and acknowledges the delivery (the cursor advances once the samples are
   built: a crash before that delivers the batch again).

Layout of what it returns, as slime nests rollouts. slime's default is ``list[list[Sample]]``, a group per prompt
and a sample per rollout. A rollout that is several training samples (the ledger's multi-segment trajectories: a
record per segment, ``num_samples`` > 1) is a ``list[Sample]`` in the sample's place, ``list[list[list[Sample]]]``
in all, every sibling carrying the same ``rollout_id``: slime's fan-out convention (``slime/rollout/
sglang_rollout.py`` 300-306, ``slime/observability/rollout_data_utils.py`` 92-121 validates it, ``slime/ray/
rollout.py`` 601-604 flattens it; its agent trajectories build the siblings the same way, ``slime/agent/
trajectory.py`` 248-261). slime flattens by looking at the first element only, so the depth must be the same
everywhere: when any trajectory of the step has several samples, every rollout of the step is a list.

Per sample: ``tokens`` (the segment's prompt + response), ``response_length``, ``loss_mask`` and
``rollout_log_probs`` over the response, ``reward`` (the episode's, on every segment; 0.0 where the ledger has
none), ``status`` (``Sample.Status``: completed / truncated / aborted, a failed trajectory is aborted),
``weight_versions`` (strings), ``prompt`` (the text the policy saw), ``label`` (the dataset row's label, else the
task as JSON), ``group_index`` / ``index`` (the data source's), ``rollout_id`` (= ``index``: slime keeps a rollout's
samples in one training step by it, ``slime/ray/rollout.py`` 647-655 and ``slime/utils/dp_schedule.py`` 127-133)
and ``metadata`` (the row's metadata, the ledger's record metadata, and ``episode_id``, ``group_id``, ``batch_id``,
``env``, ``attempt``, ``sample_index``, ``num_samples``, ``advantage``).

Advantages. slime's built-in group normalisation reshapes the rewards into groups only when there are exactly
``rollout_batch_size * n_samples_per_prompt`` samples (``slime/ray/rollout.py`` 613-631); with segments, or a
member that failed without a trajectory, it normalises the whole step as one group. ``reward_post_process`` gives
slime the ledger's own group advantage of each trajectory instead (computed per group in the read's query, the
estimator chosen from slime's ``--advantage-estimator`` and normalisation flags as slime would).

Weights. slime's disk transport writes ``{update_weight_disk_dir}/weight_v{N:06d}`` per sync and runs the hook on
every trainer rank (``slime/backends/megatron_utils/update_weight/update_weight_from_disk.py`` 66-91).
``post_write_hook`` announces the directory as policy version ``N + ledger_version_offset`` on rank 0 and returns
once every inference worker serves it; the other ranks return at once (slime's barrier waits for rank 0). Keep
``--update-weight-disk-keep-files``: otherwise slime deletes the directory once its own engines reloaded it, or
right after the hook when it has none (``slime/ray/actor_group.py`` 232-235, 267-268), and an inference worker that
starts later loads the announced directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import structlog

from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
from rollout_ledger.client.reader import Batch, Selection, TrajectoryReader
from rollout_ledger.client.rest import LedgerClient
from rollout_ledger.shared.errors import RolloutError

SLIME_SAMPLE: type[Any] | None
"""slime's ``Sample`` class when slime is installed, else None (pass ``sample_cls``)."""
try:
    from slime.utils.types import Sample as _SlimeSample
except ImportError:  # slime is not on PyPI: most processes that import this module do not have it
    SLIME_SAMPLE = None
else:
    SLIME_SAMPLE = _SlimeSample

log = structlog.get_logger(__name__)

CHECK_S = 5.0
"""Seconds ``generate_rollout`` waits for the groups between two looks at the batch's status."""
SETTLE_S = 10.0
"""Once every episode of the batch is terminal, how long its last trajectories get to become readable."""
VERSION_DIR = re.compile(r"^weight_v(\d+)$")
"""The name of each directory slime's disk transport writes (``weight_v{N:06d}``)."""
GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
"""slime's estimators that subtract the group mean (``slime/ray/rollout.py`` 614)."""
STD_NORMALISED = ("grpo", "gspo", "cispo")
"""Those that also divide by the group's std unless ``--disable-grpo-std-normalization`` (627)."""


class LedgerRolloutError(RolloutError):
    """The ledger could not give slime this step's groups or serve its weights (the message says why)."""


# --- settings --------------------------------------------------------------------------------------------------


def _setting(args: Any, attr: str, env: Sequence[str], environ: Mapping[str, str]) -> Any:
    """``args.<attr>`` when set (slime copies every key of ``--custom-config-path``'s YAML onto ``args``,
    ``slime/utils/arguments.py`` 2013-2019), else the first of ``env`` that is set, else None."""
    value = getattr(args, attr, None)
    if value is not None:
        return value
    return next((environ[name] for name in env if environ.get(name)), None)


def _json_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    parsed = orjson.loads(value) if isinstance(value, str | bytes) else value
    if not isinstance(parsed, dict):
        raise LedgerRolloutError(f"{what} must be a JSON object (a mapping), got {parsed!r}")
    return dict(parsed)


@dataclass(frozen=True)
class LedgerSettings:
    """Where the ledger is and how the adapter uses it. Each is the slime ``args`` attribute named first (a key of
    the YAML file given to ``--custom-config-path``) or else the environment variable after it."""

    url: str = "http://127.0.0.1:8000"
    """``ledger_url`` / ``ROLLOUT_SCHEDULER_URL``: the scheduler's REST API."""
    token: str | None = None
    """``ledger_token``; else what ``LedgerClient`` resolves (``ROLLOUT_API_TOKEN``, the local stack's)."""
    database_url: str | None = None
    """``ledger_database_url`` / ``ROLLOUT_EXPORT_DATABASE_URL``, ``DATABASE_URL``: the Postgres the reader reads
    (the exporter's read-only login is enough). Needed by ``generate_rollout``."""
    env: str | None = None
    """``ledger_env`` / ``ROLLOUT_SLIME_ENV``: the ledger environment every task runs in. Needed by
    ``generate_rollout``."""
    consumer: str = "slime"
    """``ledger_consumer`` / ``ROLLOUT_SLIME_CONSUMER``: the reader's consumer name, which also names the run's
    batches (``{consumer}-r{rollout_id}``): give each run its own."""
    batch: dict[str, Any] = field(default_factory=dict)
    """``ledger_batch`` / ``ROLLOUT_SLIME_BATCH`` (a JSON object): more fields of each ``POST /v1/batches``
    (``max_turns``, ``context``, ``max_staleness``, ``metadata``; ``sampling`` is merged over the one made from
    slime's ``--rollout-*`` flags)."""
    task_fn: str | None = None
    """``ledger_task_fn`` / ``ROLLOUT_SLIME_TASK_FN``: ``module.function`` making a task of a data-source sample,
    instead of ``default_task``."""
    timeout_s: float | None = None
    """``ledger_timeout_s`` / ``ROLLOUT_SLIME_TIMEOUT_S``: how long a step may wait for its groups (None: as long as
    the batch runs)."""
    swap_mode: str = "drain"
    """``ledger_swap_mode`` / ``ROLLOUT_SLIME_SWAP_MODE``: how the inference workers move to a new version (drain,
    abort, keep)."""
    serve_timeout_s: float = 600.0
    """``ledger_serve_timeout_s`` / ``ROLLOUT_SLIME_SERVE_TIMEOUT_S``: how long the hook waits for a version to be
    served."""
    version_offset: int = 0
    """``ledger_version_offset`` / ``ROLLOUT_SLIME_VERSION_OFFSET``: added to slime's version number (slime counts
    from 1 in every run; a ledger that already served versions refuses lower ones)."""

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] | None = None) -> LedgerSettings:
        env = os.environ if environ is None else environ

        def get(attr: str, *names: str) -> Any:
            return _setting(args, attr, names, env)

        timeout = get("ledger_timeout_s", "ROLLOUT_SLIME_TIMEOUT_S")
        return cls(
            url=str(get("ledger_url", "ROLLOUT_SCHEDULER_URL") or cls.url),
            token=get("ledger_token"),
            database_url=get("ledger_database_url", "ROLLOUT_EXPORT_DATABASE_URL", "DATABASE_URL"),
            env=get("ledger_env", "ROLLOUT_SLIME_ENV"),
            consumer=str(get("ledger_consumer", "ROLLOUT_SLIME_CONSUMER") or cls.consumer),
            batch=_json_object(get("ledger_batch", "ROLLOUT_SLIME_BATCH"), "ledger_batch"),
            task_fn=get("ledger_task_fn", "ROLLOUT_SLIME_TASK_FN"),
            timeout_s=None if timeout is None else float(timeout),
            swap_mode=str(get("ledger_swap_mode", "ROLLOUT_SLIME_SWAP_MODE") or cls.swap_mode),
            serve_timeout_s=float(get("ledger_serve_timeout_s", "ROLLOUT_SLIME_SERVE_TIMEOUT_S")
                                  or cls.serve_timeout_s),
            version_offset=int(get("ledger_version_offset", "ROLLOUT_SLIME_VERSION_OFFSET") or 0),
        )

    def batch_id(self, rollout_id: int) -> str:
        """The batch of one rollout step (the scheduler's ids are at most 64 of ``[A-Za-z0-9_-]``)."""
        name = f"{self.consumer}-r{rollout_id}"
        if len(name) > 64:
            digest = hashlib.sha256(self.consumer.encode()).hexdigest()[:10]
            name = f"{self.consumer[:40]}-{digest}-r{rollout_id}"
        return name


# --- tasks -----------------------------------------------------------------------------------------------------


def default_task(sample: Any) -> dict[str, Any]:
    """The ledger task of one slime prompt: the dataset row's metadata object (slime's ``--metadata-key``, default
    ``metadata``: put the env's task there, e.g. ``{"seed": 3}``) when it has one; else ``{"prompt", "label"}``
    when the row has a prompt (for a custom env that reads them); else ``{"seed": group_index}`` (no
    ``--prompt-data``: a procedural env)."""
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict) and metadata:
        return dict(metadata)
    prompt = getattr(sample, "prompt", None)
    if prompt:
        return {"prompt": prompt, "label": getattr(sample, "label", None)}
    return {"seed": int(getattr(sample, "group_index", 0) or 0)}


def load_function(path: str) -> Callable[..., Any]:
    """``module.attr`` (slime's form) or ``module:attr``."""
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not attr:
        raise LedgerRolloutError(f"a function path is module.function, got {path!r}")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise LedgerRolloutError(f"{path} is not a function")
    return fn


def sampling_of(args: Any) -> dict[str, Any]:
    """The batch's sampling from slime's ``--rollout-temperature``, ``--rollout-top-p``, ``--rollout-top-k``,
    ``--rollout-max-response-len`` (per turn here) and ``--rollout-stop``, those that are set."""
    out: dict[str, Any] = {}
    for attr, key in (("rollout_temperature", "temperature"), ("rollout_top_p", "top_p"),
                      ("rollout_top_k", "top_k"), ("rollout_max_response_len", "max_tokens"),
                      ("rollout_stop", "stop")):
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = value
    return out


def advantage_spec(args: Any) -> AdvantageSpec:
    """The group advantage slime's default reward post-processing would compute (``slime/ray/rollout.py``
    612-631): mean-subtracted for the group-normalised estimators, also std-divided (epsilon 1e-6) for GRPO, GSPO
    and CISPO unless ``--disable-grpo-std-normalization``; the reward itself otherwise."""
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in GROUP_NORMALISED or not getattr(args, "rewards_normalization", True):
        return AdvantageSpec(AdvantageKind.NONE)
    std = estimator in STD_NORMALISED and bool(getattr(args, "grpo_std_normalization", True))
    return AdvantageSpec(AdvantageKind.GRPO, epsilon=1e-6, normalize_std=std)


def batch_request(args: Any, settings: LedgerSettings, rollout_id: int,
                  tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``POST /v1/batches`` body of one rollout step."""
    extra = dict(settings.batch)
    sampling = {**sampling_of(args), **_json_object(extra.pop("sampling", None), "ledger_batch.sampling")}
    metadata = {**_json_object(extra.pop("metadata", None), "ledger_batch.metadata"),
                "trainer": "slime", "consumer": settings.consumer, "rollout_id": rollout_id}
    return {**extra, "env": settings.env, "tasks": tasks, "group_size": int(args.n_samples_per_prompt),
            "batch_id": settings.batch_id(rollout_id), "sampling": sampling, "metadata": metadata}


# --- records to samples ----------------------------------------------------------------------------------------


def _sample_class(sample_cls: type[Any] | None) -> type[Any]:
    if sample_cls is not None:
        return sample_cls
    if SLIME_SAMPLE is None:
        raise LedgerRolloutError("slime is not installed (slime.utils.types.Sample): pass sample_cls")
    return SLIME_SAMPLE


def _task_index(rec: Mapping[str, Any]) -> int:
    """The record's task (its group's place in the batch): ``task_index``, else the group id's last part
    (``{batch_id}.{task_index}``)."""
    if rec.get("task_index") is not None:
        return int(rec["task_index"])
    return int(str(rec["group_id"]).rsplit(".", 1)[1])


def _sample(rec: Mapping[str, Any], base: Any, task_index: int, sample_cls: type[Any]) -> Any:
    index = getattr(base, "index", None)
    group_index = getattr(base, "group_index", None)
    row_metadata = getattr(base, "metadata", None)
    label = getattr(base, "label", None)
    meta = rec["metadata"]
    return sample_cls(
        group_index=task_index if group_index is None else group_index,
        index=index,
        rollout_id=index,
        prompt=rec["prompt"],
        tokens=[int(t) for t in rec["tokens"]],
        response_length=int(rec["response_length"]),
        label=rec["label"] if label is None else label,
        reward=0.0 if rec["reward"] is None else float(rec["reward"]),
        loss_mask=[int(m) for m in rec["loss_mask"]],
        weight_versions=[str(v) for v in rec["weight_versions"]],
        rollout_log_probs=[float(x) for x in rec["rollout_log_probs"]],
        status=sample_cls.Status(rec["status"]),
        metadata={
            **(row_metadata if isinstance(row_metadata, dict) else {}),
            **(orjson.loads(meta) if isinstance(meta, str | bytes) else dict(meta or {})),
            **{k: rec[k] for k in ("episode_id", "group_id", "batch_id", "env", "attempt", "sample_index",
                                   "num_samples", "advantage")},
        },
    )


def to_samples(table: pa.Table, groups: Sequence[Sequence[Any]], sample_cls: type[Any]) -> list[list[Any]]:
    """slime's samples of a table in the ``slime`` record shape, nested as slime nests rollouts (module docstring):
    a group per task, in task order (= ``groups`` order); in each, a rollout per member in member order, a
    ``Sample`` or, when any trajectory of the table has several samples, a ``list[Sample]`` in segment order.
    ``groups`` are the data-source groups the tasks were made of (their ``index``, ``group_index``, ``label`` and
    ``metadata`` carry over)."""
    tasks: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for rec in table.to_pylist():
        tasks.setdefault(_task_index(rec), {}).setdefault(int(rec["index"]), []).append(rec)
    fan_out = any(len(recs) > 1 for members in tasks.values() for recs in members.values())
    out: list[list[Any]] = []
    for t in sorted(tasks):
        if t >= len(groups):
            raise LedgerRolloutError(f"a record of task {t} but only {len(groups)} groups were submitted")
        group: list[Any] = []
        for m in sorted(tasks[t]):
            recs = sorted(tasks[t][m], key=lambda r: int(r["sample_index"]))
            if len(recs) != int(recs[0]["num_samples"]):
                raise LedgerRolloutError(f"episode {recs[0]['episode_id']}: {len(recs)} records of "
                                         f"{recs[0]['num_samples']} samples")
            base = groups[t][m] if m < len(groups[t]) else None
            samples = [_sample(rec, base, t, sample_cls) for rec in recs]
            group.append(samples if fan_out else samples[0])
        out.append(group)
    return out


# --- the rollout function --------------------------------------------------------------------------------------


def _read(reader: TrajectoryReader, ledger: LedgerClient, batch_id: str, groups: int, settings: LedgerSettings,
          resubmitted: bool) -> Batch:
    """The batch's ``groups`` complete groups, waiting while it runs (see the module docstring, step 3)."""
    deadline = None if settings.timeout_s is None else time.monotonic() + settings.timeout_s
    while True:
        info = ledger.batch(batch_id)
        done = bool(info.get("done"))
        got = reader.read_groups(groups, timeout_s=SETTLE_S if done else CHECK_S)
        if got is not None:
            return got
        if done:
            why = ("; the batch existed before this step (a restarted run?): its groups may have been delivered "
                   f"to consumer {settings.consumer!r} already" if resubmitted else "")
            raise LedgerRolloutError(
                f"batch {batch_id} is done but fewer than {groups} of its groups can be delivered (episodes: "
                f"{info.get('counts')}; a group whose every member ended without a trajectory has no sample){why}")
        if deadline is not None and time.monotonic() > deadline:
            raise LedgerRolloutError(f"batch {batch_id}: {groups} groups not complete after {settings.timeout_s}s "
                                     f"(episodes: {info.get('counts')})", retryable=True)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False, *,
                     sample_cls: type[Any] | None = None, ledger: LedgerClient | None = None,
                     open_reader: Callable[[LedgerSettings, Selection], TrajectoryReader] | None = None,
                     environ: Mapping[str, str] | None = None) -> list[list[Any]]:
    """slime's ``--rollout-function-path``: this step's ``args.rollout_batch_size`` groups, generated by the ledger
    from ``data_source``'s prompts (module docstring). The keyword arguments are for processes without slime and
    for tests: the ``Sample`` class, a ``LedgerClient``, how to open the reader, the environment to read."""
    if evaluation:
        raise LedgerRolloutError("evaluation does not run through the ledger: set --eval-function-path to an "
                                 "evaluation function (e.g. slime.rollout.sglang_rollout.generate_rollout)")
    cls = _sample_class(sample_cls)
    settings = LedgerSettings.from_args(args, environ)
    if not settings.env:
        raise LedgerRolloutError("set the ledger environment the tasks run in: args.ledger_env or ROLLOUT_SLIME_ENV")
    make_task = load_function(settings.task_fn) if settings.task_fn else default_task
    groups: list[list[Any]] = data_source.get_samples(int(args.rollout_batch_size))
    tasks = [make_task(group[0]) for group in groups]
    batch_id = settings.batch_id(rollout_id)
    selection = Selection(complete_groups=True, batch_ids=(batch_id,), advantage=advantage_spec(args))
    opener = open_reader or open_ledger_reader
    with contextlib.ExitStack() as stack:
        client = ledger if ledger is not None else stack.enter_context(LedgerClient(settings.url, settings.token))
        reader = stack.enter_context(opener(settings, selection))  # the cursor exists before the batch does
        created = client.submit(**batch_request(args, settings, rollout_id, tasks))
        log.info("slime.batch_submitted", batch_id=batch_id, rollout_id=rollout_id, groups=len(groups),
                 created=created.get("created"), env=settings.env)
        batch = _read(reader, client, batch_id, len(groups), settings, resubmitted=created.get("created") is False)
        samples = to_samples(batch.table, groups, cls)
        batch.ack()
    short = [i for i, g in enumerate(samples) if len(g) < int(args.n_samples_per_prompt)]
    log.info("slime.groups_delivered", batch_id=batch_id, groups=len(samples), records=len(batch),
             short_groups=len(short))
    return samples


def open_ledger_reader(settings: LedgerSettings, selection: Selection) -> TrajectoryReader:
    """A step's reader: the consumer's cursor (a new consumer starts after what is readable now), slime records."""
    if not settings.database_url:
        raise LedgerRolloutError("set the ledger's database: args.ledger_database_url, ROLLOUT_EXPORT_DATABASE_URL "
                                 "or DATABASE_URL")
    return TrajectoryReader(settings.database_url, settings.consumer, selection=selection, fmt="slime",
                            start="latest")


def reward_post_process(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """slime's ``--custom-reward-post-process-path``: (raw rewards, the ledger's group advantage of each sample's
    trajectory) for the flattened samples of a step; 0.0 where the ledger has no advantage."""
    raw = [float(s.reward) for s in samples]
    return raw, [float(s.metadata.get("advantage") or 0.0) for s in samples]


# --- weights ---------------------------------------------------------------------------------------------------


def version_of(version_dir: str | os.PathLike[str]) -> int:
    """slime's version number of a directory its disk transport wrote (``weight_v000007`` -> 7)."""
    name = Path(version_dir).name
    found = VERSION_DIR.match(name)
    if found is None:
        raise LedgerRolloutError(f"{version_dir}: not a directory slime's disk transport writes (weight_v{{N:06d}})")
    return int(found.group(1))


def _rank() -> int:
    """This process's rank in slime's trainer (0 when torch.distributed is not loaded or not initialised)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def post_write_hook(args: Any, version_dir: str, rollout_engines: Sequence[Any], *,
                    ledger: LedgerClient | None = None, environ: Mapping[str, str] | None = None) -> None:
    """slime's ``--custom-update-weight-post-write-path``: announce the HF directory slime just wrote as the
    ledger's policy version ``N + version_offset`` (rank 0 only) and return once every inference worker serves
    it. ``rollout_engines`` (slime's own SGLang engines) are not touched."""
    if getattr(args, "update_weight_mode", "full") != "full":
        raise LedgerRolloutError("the ledger loads whole HF checkpoints: use --update-weight-mode full (a delta "
                                 "directory holds the changed tensors only)")
    if _rank() != 0:
        return
    settings = LedgerSettings.from_args(args, environ)
    version = version_of(version_dir) + settings.version_offset
    checkpoint = os.path.abspath(version_dir)
    with contextlib.ExitStack() as stack:
        client = ledger if ledger is not None else stack.enter_context(LedgerClient(settings.url, settings.token))
        took = client.publish_version(version, checkpoint, mode=settings.swap_mode,
                                      notes=f"slime {Path(version_dir).name}", timeout_s=settings.serve_timeout_s)
    log.info("slime.version_served", version=version, checkpoint=checkpoint, seconds=round(took, 3))
