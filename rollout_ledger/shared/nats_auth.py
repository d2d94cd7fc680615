"""Who may do what on NATS: one user per service and the subjects it may publish and subscribe to.

Derived from the names of ``subjects.py`` (streams, consumers, buckets, core subjects) and from which service
produces which event type, so a subject or bucket added there is covered here or fails the unit test that
checks every one is granted to someone. The local stack (cli/stack/servers.py) renders this table with generated
passwords; the k8s manifests hold it as deploy/k8s/base/nats-auth.conf (passwords read from the NATS pod's
environment, filled from a Secret), kept equal to ``render_authorization()`` by tests/unit/test_nats_auth.py.

Every user is denied ``$JS.EVENT.>`` and ``$SYS.>`` (no forged advisories or system requests), JetStream's
delete/purge API except the one message delete the recorder needs on the work queue, and stream updates except
the scheduler's. Each user's request inbox is ``_INBOX.<user>.>`` (``inbox_prefix``), so no service reads the
replies meant for another; inference workers answer requests through ``allow_responses``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rollout_ledger.shared import subjects as sj
from rollout_ledger.shared.events import (
    EpisodeCancelled,
    EpisodeFailed,
    EpisodeFinished,
    EpisodeStarted,
    InferenceRequested,
    StepCompleted,
    TurnGenerated,
)

SCHEDULER = "scheduler"
ENV_WORKER = "env-worker"
INFERENCE_WORKER = "inference-worker"
RECORDER = "recorder"
USERS = (SCHEDULER, ENV_WORKER, INFERENCE_WORKER, RECORDER)
"""Every service that connects to NATS (the exporter, the migrations and the trainer's client use Postgres and
REST only); the user name is the service's catalog name."""

API = "$JS.API"
DENY_PUBLISH = ("$JS.EVENT.>", "$SYS.>", f"{API}.STREAM.DELETE.>", f"{API}.STREAM.PURGE.>",
                f"{API}.STREAM.SNAPSHOT.>", f"{API}.STREAM.RESTORE.>", f"{API}.META.>", f"{API}.SERVER.>",
                f"{API}.ACCOUNT.>")
"""Denied to every user whatever it is allowed: forged JetStream advisories (the recorder trusts the
max-deliveries advisory), system-account requests, removing streams or their contents, cluster operations."""
DENY_SUBSCRIBE = ("$SYS.>",)


WORK_CONSUMERS = "*"
"""Every consumer of ``RL_WORK`` (the legacy ``env-workers`` and one ``env-workers-<token>`` per route: a permission
wildcard covers a whole token only, so the env workers own every consumer name on the work stream)."""


def _durables() -> dict[tuple[str, str], str]:
    """(stream, durable consumer) -> the one user that owns it (declares, pulls and acks)."""
    return {(sj.WORK_STREAM, WORK_CONSUMERS): ENV_WORKER, (sj.EVENTS_STREAM, sj.RECORDER_CONSUMER): RECORDER,
            (sj.ADVISORY_STREAM, sj.ADVISORY_CONSUMER): RECORDER,
            (sj.DEAD_LETTER_STREAM, sj.DEAD_LETTER_CONSUMER): RECORDER}


def deny_publish(user: str) -> tuple[str, ...]:
    """``DENY_PUBLISH`` and, whatever wildcard a grant holds, every way to change, pull from or ack a durable consumer
    of another user (create-or-update could re-filter the recorder's consumer; a pull would take its deliveries)."""
    foreign = []
    for (stream, durable), owner in _durables().items():
        if owner == user:
            continue
        foreign += [f"{API}.CONSUMER.{verb}.{stream}.{durable}" for verb in ("CREATE", "DELETE", "PAUSE", "RESET",
                                                                             "UNPIN", "DURABLE.CREATE", "MSG.NEXT")]
        foreign += [f"{API}.CONSUMER.CREATE.{stream}.{durable}.>", f"$JS.ACK.{stream}.{durable}.>"]
    return (*DENY_PUBLISH, *foreign)


def _event_type(cls: type) -> str:
    return str(cls.model_fields["type"].default)  # type: ignore[attr-defined]  # the pydantic event classes


EVENT_PRODUCERS: Mapping[str, tuple[str, ...]] = {
    ENV_WORKER: tuple(_event_type(c) for c in (EpisodeStarted, InferenceRequested, StepCompleted, EpisodeFinished,
                                                EpisodeFailed, EpisodeCancelled)),
    INFERENCE_WORKER: (_event_type(TurnGenerated),),
    RECORDER: (_event_type(EpisodeFailed),),  # an episode whose work item ran out of deliveries
}
"""The ``rl.events.<type>`` each service may publish (the scheduler publishes work items, no events)."""


@dataclass(frozen=True)
class Permissions:
    """One NATS user's permissions."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May answer requests it received (publish once to their reply subject) without a publish grant on it."""


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of ``user``'s connections (nats-py ``inbox_prefix``)."""
    return f"_INBOX.{user}"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _streams() -> list[str]:
    return [s.name for s in sj.STREAMS] + [kv_stream(b) for b in sj.BUCKETS]


def _topology(update: bool) -> list[str]:
    """Look up and create the contract's streams and buckets (``bus.ensure_topology`` at every start); with
    ``update``, also change their configuration (replicas, limits)."""
    verbs = ("INFO", "CREATE", "UPDATE") if update else ("INFO", "CREATE")
    return [f"{API}.STREAM.{verb}.{stream}" for stream in _streams() for verb in verbs]


def _durable(stream: str, consumer: str) -> list[str]:
    """Declare, look up and pull from one durable consumer, and ack its messages."""
    return [f"{API}.CONSUMER.CREATE.{stream}.{consumer}", f"{API}.CONSUMER.CREATE.{stream}.{consumer}.>",
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{consumer}", f"{API}.CONSUMER.INFO.{stream}.{consumer}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}", f"$JS.ACK.{stream}.{consumer}.>"]


def _kv_read(bucket: str) -> list[str]:
    """Get keys and watch a bucket (watchers and ``keys()`` are ordered ephemeral consumers with flow control)."""
    stream = kv_stream(bucket)
    return [f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>", f"{API}.STREAM.MSG.GET.{stream}",
            f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.>", f"{API}.CONSUMER.DELETE.{stream}.>", f"$JS.FC.{stream}.>"]


def _kv_write(bucket: str) -> list[str]:
    """Put, create, update and delete keys of a bucket (and read them)."""
    return [f"$KV.{bucket}.>", *_kv_read(bucket)]


def _events(user: str) -> list[str]:
    return [sj.event_subject(t) for t in EVENT_PRODUCERS.get(user, ())]


def permission_table() -> dict[str, Permissions]:
    """Every service user and its permissions."""
    return {
        SCHEDULER: Permissions(
            publish=(*_topology(update=True), sj.WORK_ROUTES,
                     sj.WORK_SUBJECT,  # a previous release's scheduler during a rolling upgrade
                     *_kv_write(sj.CANCEL_BUCKET), *_kv_write(sj.POLICY_BUCKET),
                     *_kv_read(sj.ENVS_BUCKET), *_kv_read(sj.POLICY_WORKERS_BUCKET), *_kv_read(sj.POLICY_ENV_BUCKET),
                     *_kv_read(sj.ENV_WORKERS_BUCKET),
                     f"{API}.CONSUMER.LIST.{sj.WORK_STREAM}"),  # the work consumers' state, for the queue gauges
            subscribe=(f"{inbox_prefix(SCHEDULER)}.>",),
        ),
        ENV_WORKER: Permissions(
            publish=(*_topology(update=False), *_durable(sj.WORK_STREAM, WORK_CONSUMERS),
                     # a retry's work item (its env's route); hand-back of a work item of a newer contract major or
                     # of an env this worker lacks (bus.hand_back, on the subject it came from: legacy or route)
                     sj.WORK_ROUTES, sj.WORK_SUBJECT,
                     f"{API}.STREAM.MSG.GET.{sj.WORK_STREAM}",  # is the work item of a leased episode still queued
                     # after a NATS restart: turns whose reply was lost, read back from RL_EVENTS (a short-lived
                     # push consumer filtered to turn.generated, into its own inbox; inference_client.recover)
                     f"{API}.CONSUMER.CREATE.{sj.EVENTS_STREAM}.*.{sj.event_subject('turn.generated')}",
                     sj.WORK_DEAD_LETTER_SUBJECT, *_events(ENV_WORKER),
                     sj.INFER_ANY, sj.infer_worker_subject("*"), sj.INFER_CANCEL,
                     sj.infer_pool_subject("*"),  # an env's own generations addressed to a model pool (env_llm.py)
                     sj.RESUME_SUBJECT,  # a resumed attempt's recorded turns, read from a recorder
                     *_kv_write(sj.ENVS_BUCKET), *_kv_write(sj.POLICY_ENV_BUCKET), *_kv_write(sj.LEASE_BUCKET),
                     *_kv_write(sj.ENV_WORKERS_BUCKET),
                     *_kv_read(sj.CANCEL_BUCKET), *_kv_read(sj.POLICY_BUCKET), *_kv_read(sj.POLICY_WORKERS_BUCKET)),
            subscribe=(f"{inbox_prefix(ENV_WORKER)}.>", sj.INFER_HEARTBEAT,
                       sj.infer_progress_subject("*")),  # its requests still generated (inference_request.py)
        ),
        INFERENCE_WORKER: Permissions(
            publish=(*_topology(update=False), *_events(INFERENCE_WORKER), sj.INFER_HEARTBEAT,
                     sj.infer_progress_subject("*"),  # a request held here is still being generated
                     # its replies, explicitly: under allow_responses alone, nats-server refused some replies to
                     # env workers' requests (`permissions violation for publish to "_inbox.env-worker..."`, the
                     # demo's first tau2 user turns), and each such try waited out its request timeout
                     f"{inbox_prefix(ENV_WORKER)}.>",
                     *_kv_write(sj.POLICY_WORKERS_BUCKET),
                     *_kv_read(sj.POLICY_BUCKET), *_kv_read(sj.POLICY_ENV_BUCKET)),
            subscribe=(f"{inbox_prefix(INFERENCE_WORKER)}.>", sj.INFER_ANY, sj.infer_worker_subject("*"),
                       sj.INFER_CANCEL, sj.infer_pool_subject("*")),
            allow_responses=True,
        ),
        RECORDER: Permissions(
            publish=(*_topology(update=False), *_durable(sj.EVENTS_STREAM, sj.RECORDER_CONSUMER),
                     *_durable(sj.ADVISORY_STREAM, sj.ADVISORY_CONSUMER),
                     *_durable(sj.DEAD_LETTER_STREAM, sj.DEAD_LETTER_CONSUMER), *_events(RECORDER),
                     f"{API}.CONSUMER.INFO.{sj.WORK_STREAM}.{WORK_CONSUMERS}",  # an advisory checked against it
                     # the work item of an episode given up on: read it, then remove it from the queue
                     f"{API}.STREAM.MSG.GET.{sj.WORK_STREAM}", f"{API}.STREAM.MSG.DELETE.{sj.WORK_STREAM}"),
            subscribe=(f"{inbox_prefix(RECORDER)}.>", sj.RESUME_SUBJECT),
            allow_responses=True,  # answers to resume queries (shared/resume.py)
        ),
    }


def may(pattern: str, subject: str) -> bool:
    """Whether the NATS subject pattern ``pattern`` (``*`` one token, ``>`` the rest) matches ``subject``."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


def may_publish(user: str, subject: str) -> bool:
    """What the server decides for ``user`` publishing on ``subject`` (a reply under ``allow_responses`` aside)."""
    perms = permission_table()[user]
    return (any(may(p, subject) for p in perms.publish)
            and not any(may(p, subject) for p in deny_publish(user)))


def may_subscribe(user: str, subject: str) -> bool:
    perms = permission_table()[user]
    return (any(may(p, subject) for p in perms.subscribe)
            and not any(may(p, subject) for p in DENY_SUBSCRIBE))


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def password_variable(user: str) -> str:
    """The environment variable the k8s nats.conf reads ``user``'s password from (``ENV_WORKER_NATS_PASSWORD``)."""
    return f"{user.upper().replace('-', '_')}_NATS_PASSWORD"


def render_authorization(passwords: Mapping[str, str] | None = None,
                         extra_users: Mapping[str, str] | None = None) -> str:
    """The ``authorization`` block of nats.conf. ``passwords``: user -> password written in (the local stack);
    None: each password is the variable ``password_variable(user)`` that nats-server reads from its environment
    (the k8s manifests). ``extra_users``: user -> password of unrestricted users (the local stack's ``admin``
    for operators' tools). No anonymous connection is accepted."""
    lines = ["# Generated from shared/nats_auth.py (python -m rollout_ledger.shared.nats_auth); do not edit.",
             "authorization {", "  users = ["]
    for user, perms in permission_table().items():
        secret = f'"{passwords[user]}"' if passwords is not None else f"${password_variable(user)}"
        lines += [f'    {{user: "{user}", password: {secret}, permissions: {{',
                  f"      publish: {{allow: {_list(perms.publish)},",
                  f"                deny: {_list(deny_publish(user))}}}",
                  f"      subscribe: {{allow: {_list(perms.subscribe)}, deny: {_list(DENY_SUBSCRIBE)}}}"]
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    for user, password in (extra_users or {}).items():
        lines.append(f'    {{user: "{user}", password: "{password}"}}')
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_authorization(), end="")
