"""Subjects, streams, consumers and buckets: the one place names and stream policies are declared.

The k8s manifests and docs/architecture.md follow these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- work queue: one message per episode to run, routed by the route of its env -----------------
WORK_STREAM = "RL_WORK"
WORK_SUBJECT = "rl.work.episodes"
"""The previous release's one work subject (every env worker pulled it, whatever the env). Work is published on
``work_subject(route)`` now; items a previous release queued here still run: every env worker also pulls the
legacy consumer ``WORK_CONSUMER``, and one that lacks the item's env hands it back instead of failing it."""
WORK_CONSUMER = "env-workers"
"""The legacy consumer of ``WORK_SUBJECT`` (exactly that subject, so it overlaps no route's consumer: a work-queue
stream refuses consumers with overlapping filters)."""
WORK_ROUTES = f"{WORK_SUBJECT}.*"
"""Every route's subject: ``rl.work.episodes.<token>``."""
_ROUTE_SAFE = frozenset("-_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def route_token(route: str) -> str:
    """A route as one subject token and consumer-name suffix: every character but ``[-_a-zA-Z0-9]`` written
    ``=XX`` (its UTF-8 bytes in hex; ``=`` itself too), so ``:``, ``.``, ``*``, ``>``, ``/`` and spaces never reach a
    subject or a consumer name. Reversible (``route_of_token``)."""
    if not route:
        raise ValueError("an empty route")
    return "".join(c if c in _ROUTE_SAFE else "".join(f"={b:02X}" for b in c.encode()) for c in route)


def route_of_token(token: str) -> str:
    """The route a ``route_token`` stands for."""
    return env_name_of_key(token)


def work_subject(route: str) -> str:
    """The subject the work items of ``route`` are published on."""
    return f"{WORK_SUBJECT}.{route_token(route)}"


def work_consumer(route: str) -> str:
    """The durable pull consumer of ``route`` (filter ``work_subject(route)``), shared by every env worker that has
    the route."""
    return f"{WORK_CONSUMER}-{route_token(route)}"


def work_consumer_subject(consumer: str) -> str | None:
    """The one subject the work consumer ``consumer`` delivers (its filter): ``WORK_SUBJECT`` for the legacy consumer,
    ``work_subject(route)`` for a route's; None for a name that is neither (or not canonical)."""
    if consumer == WORK_CONSUMER:
        return WORK_SUBJECT
    prefix = f"{WORK_CONSUMER}-"
    if not consumer.startswith(prefix) or len(consumer) == len(prefix):
        return None
    token = consumer[len(prefix):]
    try:
        if route_token(route_of_token(token)) != token:  # e.g. lower-case hex or a stray "=": not one we made
            return None
    except ValueError:
        return None
    return f"{WORK_SUBJECT}.{token}"

# --- event log: everything that happened, replayable ---------------------------------------------
EVENTS_STREAM = "RL_EVENTS"
EVENTS_SUBJECT_PREFIX = "rl.events"
RECORDER_CONSUMER = "recorder"


def event_subject(event_type: str) -> str:
    """``rl.events.<type>``, e.g. ``rl.events.turn.generated``."""
    return f"{EVENTS_SUBJECT_PREFIX}.{event_type}"


def subject_of(event_type: str, route: str | None = None) -> str:
    """The subject an event is published to: a work item (``episode.requested``) to its env's ``route``
    (``work_subject``), or without one to the legacy subject every env worker pulls; any other event to
    ``event_subject``."""
    if event_type == "episode.requested":
        return work_subject(route) if route is not None else WORK_SUBJECT
    return event_subject(event_type)


# --- dead letters of consumers that have no database (the env workers' work queue) ----------------
DEAD_LETTER_STREAM = "RL_DEAD_LETTERS"
DEAD_LETTER_SUBJECT_PREFIX = "rl.deadletters"
DEAD_LETTER_CONSUMER = "recorder-dead-letters"
"""The recorder stores every message of ``DEAD_LETTER_STREAM`` as a row of ``dead_letters``."""
WORK_DEAD_LETTER_SUBJECT = f"{DEAD_LETTER_SUBJECT_PREFIX}.work"
"""An env worker republishes here a work item it cannot decode (the item's bytes; why in ``DEAD_REASON_HEADER``,
where it came from in ``DEAD_SUBJECT_HEADER`` / ``DEAD_SEQ_HEADER``), then terminates the item."""
DEAD_SUBJECT_HEADER = "Rollout-Dead-Subject"
DEAD_REASON_HEADER = "Rollout-Dead-Reason"
DEAD_SEQ_HEADER = "Rollout-Dead-Seq"
"""The stream sequence of the rejected message in its own stream."""
DEAD_TRUNCATED_HEADER = "Rollout-Dead-Truncated"
"""Set (to the original size in bytes) when the payload was cut to ``DEAD_LETTER_MAX_PAYLOAD``."""
DEAD_LETTER_MAX_PAYLOAD = 1024 * 1024
"""Bytes of a rejected payload kept in a dead letter (the rest is cut: a hostile 8 MiB item stays bounded)."""


# --- inference: core NATS request/reply ----------------------------------------------------------
INFER_ANY = "rl.infer.any"
"""Any inference worker (queue group ``INFER_QUEUE``)."""
INFER_QUEUE = "inference"
INFER_HEARTBEAT = "rl.infer.heartbeat"
"""Inference workers announce themselves and their load here every ``heartbeat_s``."""
INFER_CANCEL = "rl.infer.cancel"
"""A requester that stops waiting for a turn (its episode's deadline passed) publishes the ``request_id`` here;
the worker running it aborts it in the engine (core NATS, every worker listens; best effort)."""


# --- resume: core NATS request/reply to the recorder ---------------------------------------------
RESUME_SUBJECT = "rl.recorder.resume"
"""An env worker starting an attempt after the first asks the recorders here for the episode's recorded turns
(``shared/resume.py``); any recorder of the queue group ``RESUME_QUEUE`` answers from Postgres."""
RESUME_QUEUE = "recorders"


# --- wire headers --------------------------------------------------------------------------------
MSG_ID_HEADER = "Nats-Msg-Id"
"""JetStream's dedupe header: every event is published with its ``event_id`` here."""
ERROR_HEADER = "Rollout-Error"
"""Reply header naming the error class of a failed request (an inference worker's error reply)."""
RETRYABLE_HEADER = "Rollout-Retryable"
"""Reply header: ``true`` when another try (possibly on another worker) can succeed, else ``false``."""
PROGRESS_TO_HEADER = "Rollout-Progress-To"
"""Request header: the requester's progress subject (``infer_progress_subject``). The worker that takes the request
publishes there, every ``PROGRESS_EVERY_HEADER`` seconds until it answers, that it still holds the request (a
progress message: the reply subjects of the requests it holds for that requester, one a line). Such a requester
waits ``request_timeout_s`` from the last sign of life instead of from the send, so a turn that takes longer than
that on a slow but live worker finishes instead of being cut and started again from nothing. A request without it
(an older requester) gets no progress; a worker of an older release sends none, and its requester waits from the
send as before. Progress goes to a subject of its own, not to the reply subject: a worker may answer a request once
(``allow_responses``), and the requester's reply inbox takes the first message as the reply."""
PROGRESS_EVERY_HEADER = "Rollout-Progress-Every"
"""Request header: seconds between two progress messages about the request (with ``PROGRESS_TO_HEADER``)."""
PROGRESS_MIN_S = 0.25
"""The shortest progress interval a worker honours (a smaller ``PROGRESS_EVERY_HEADER`` is raised to it); also how
often its progress loop looks for requests due a message."""
PARKED_HEADER = "Rollout-Parked"
"""On a work item handed back by a worker of an older contract major: how many times it was handed back (its
``Nats-Msg-Id`` gets ``:parked<n>`` so the copy is not deduplicated against the original)."""
STATUS_HEADER = "Status"
"""NATS's status header on a reply the server generated."""
NO_RESPONDERS_STATUS = "503"
"""``Status`` of NATS's reply to a request nobody subscribes to."""


def progress_asked(headers: dict[str, str] | None) -> tuple[str, float] | None:
    """``(progress subject, interval)`` of a request that asks for progress: a subject under ``INFER_PROGRESS`` and a
    positive finite number of seconds (at least ``PROGRESS_MIN_S``); None when it asks for none or asks in a way
    this code does not read (a worker never publishes progress anywhere else)."""
    if headers is None:
        return None
    to, raw = headers.get(PROGRESS_TO_HEADER), headers.get(PROGRESS_EVERY_HEADER)
    if to is None or raw is None or not to.startswith(f"{INFER_PROGRESS}.") \
            or not _one_token(to[len(INFER_PROGRESS) + 1:]):
        return None
    try:
        every_s = float(raw)
    except ValueError:
        return None
    if not every_s > 0 or every_s == float("inf"):
        return None
    return to, max(every_s, PROGRESS_MIN_S)


def _one_token(token: str) -> bool:
    return bool(token) and not any(c in token for c in ".*> \t\r\n")


def error_headers(error_class: str, retryable: bool) -> dict[str, str]:
    """Headers of an error reply."""
    return {ERROR_HEADER: error_class, RETRYABLE_HEADER: "true" if retryable else "false"}


def infer_worker_subject(worker_id: str) -> str:
    """The subject that reaches one inference worker (session-sticky routing)."""
    return f"rl.infer.worker.{worker_id}"


POLICY_POOL = "policy"
"""The model pool of the policy's inference workers (``ROLLOUT_POOL``'s default)."""


INFER_PROGRESS = "rl.infer.progress"
"""Prefix of the requesters' progress subjects (``PROGRESS_TO_HEADER``)."""


def infer_progress_subject(requester: str) -> str:
    """The subject on which the requester ``requester`` (one token, unique per client) hears of its requests'
    progress."""
    return f"{INFER_PROGRESS}.{requester}"


def infer_pool_subject(pool: str) -> str:
    """The subject that reaches any inference worker of the model pool ``pool`` (queue group ``INFER_QUEUE``):
    requests addressed by pool name, e.g. an environment's simulated user served by another model."""
    return f"rl.infer.pool.{pool}"


# --- key-value buckets --------------------------------------------------------------------------
ENVS_BUCKET = "rl_envs"
"""Env name -> its advert (description, ``route``), written by env workers at start; read by the scheduler. A family
of envs (``rg:<dataset>``) is one entry, ``<family>:*``, listing its ``members``."""
CANCEL_BUCKET = "rl_cancelled"
"""Cancelled batch ids, written by the scheduler; watched by env workers."""
POLICY_BUCKET = "rl_policy"
"""The policy version every inference worker should serve (key ``POLICY_KEY``, a ``PolicyAnnouncement``), written
by the scheduler when a trainer announces a version; watched by inference workers."""
POLICY_KEY = "current"
POLICY_WORKERS_BUCKET = "rl_policy_workers"
"""Inference worker id -> its ``WorkerPolicyReport``, written by each worker; mirrored into Postgres by the
scheduler."""
POLICY_ENV_BUCKET = "rl_policy_env"
"""Env worker id -> its ``EnvPolicyReport`` (whether it holds new episodes back for a ``drain`` announcement and has
drained), written by each env worker; read by inference workers, which swap in mode ``drain`` once every live env
worker has drained for the version."""
LEASE_BUCKET = "rl_episode_leases"
"""Episode id (``episode_lease_key``) -> the env worker running it and its work item, written when the worker
starts the episode and again every few seconds, deleted when it ends; a worker handed a redelivery of an episode
whose lease is live does not run it (services/env_worker/leases.py)."""
LEASE_TTL_S = 15.0
"""A lease not written again for this long expires: its holder died and the episode may run as a new attempt."""
ENV_WORKERS_BUCKET = "rl_env_workers"
"""Env worker id -> the routes and envs it serves now (``services/env_worker/routing.py``), written every
``ENV_WORKER_TTL_S / 3``; the scheduler reads which routes have a live worker (a batch whose env has none shows
its episodes in ``waiting_for_env``)."""
ENV_WORKER_TTL_S = 15.0
"""An env worker's entry not written again for this long expires: the worker is gone."""
BUCKETS = (ENVS_BUCKET, CANCEL_BUCKET, POLICY_BUCKET, POLICY_WORKERS_BUCKET, POLICY_ENV_BUCKET, LEASE_BUCKET,
           ENV_WORKERS_BUCKET)
"""Every KV bucket the services declare."""
BUCKET_TTL_S = {POLICY_WORKERS_BUCKET: 60.0, POLICY_ENV_BUCKET: 60.0, LEASE_BUCKET: LEASE_TTL_S,
                ENV_WORKERS_BUCKET: ENV_WORKER_TTL_S}
"""Buckets whose entries expire when not written again in time (a worker that stopped reporting drops out)."""
BUCKET_HISTORY = {POLICY_BUCKET: 16}
"""Buckets that keep earlier values of a key (1 elsewhere): a worker that cannot load the current policy version
serves the newest earlier one it can."""

_KEY_SAFE = frozenset("-/_.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def env_key(name: str) -> str:
    """The ``rl_envs`` key of an env name. KV keys allow only ``[-/_=.a-zA-Z0-9]``, so any other character
    (the ``:`` of ``remote:<name>``) is written ``=XX`` (its UTF-8 bytes in hex, ``=`` itself too); names of
    safe characters are their own key."""
    return "".join(c if c in _KEY_SAFE else "".join(f"={b:02X}" for b in c.encode()) for c in name)


def episode_lease_key(episode_id: str) -> str:
    """The ``rl_episode_leases`` key of an episode: every character but ``[-_a-zA-Z0-9]`` written ``=XX`` (the dots
    of an episode id too, so no id makes an empty key token)."""
    return "".join(c if c in _LEASE_KEY_SAFE else "".join(f"={b:02X}" for b in c.encode()) for c in episode_id)


_LEASE_KEY_SAFE = _KEY_SAFE - frozenset("/.")


def env_name_of_key(key: str) -> str:
    """The env name an ``rl_envs`` key stands for (inverse of ``env_key``)."""
    if "=" not in key:
        return key
    out = bytearray()
    i = 0
    while i < len(key):
        hexpair = key[i + 1:i + 3]
        if key[i] == "=" and len(hexpair) == 2 and all(c in "0123456789ABCDEFabcdef" for c in hexpair):
            out.append(int(hexpair, 16))
            i += 3
        else:
            out += key[i].encode()
            i += 1
    return out.decode(errors="replace")

# --- advisories ---------------------------------------------------------------------------------
WORK_MAX_DELIVERIES_PREFIX = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{WORK_STREAM}"


def work_max_deliveries_advisory(consumer: str) -> str:
    """The subject NATS publishes on when a work item of ``consumer`` ran out of deliveries."""
    return f"{WORK_MAX_DELIVERIES_PREFIX}.{consumer}"


WORK_MAX_DELIVERIES_ADVISORY = work_max_deliveries_advisory(WORK_CONSUMER)
"""Published by NATS when an episode's work item on the legacy consumer ran out of deliveries (its env workers kept
dying)."""
WORK_MAX_DELIVERIES_ADVISORIES = f"{WORK_MAX_DELIVERIES_PREFIX}.*"
"""The max-deliveries advisories of every work consumer (the legacy one and each route's)."""
ADVISORY_STREAM = "RL_ADVISORIES"
"""Keeps those advisories durably, so an episode given up on is marked failed even if the recorder was down."""
ADVISORY_CONSUMER = "recorder-advisories"


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream as declared by this project."""

    name: str
    subjects: list[str]
    retention: str
    """``workqueue`` or ``limits``."""
    max_age_s: float
    duplicate_window_s: float = 120.0
    max_msg_size: int = 8 * 1024 * 1024
    description: str = ""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer and its ack policy."""

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float
    max_deliver: int
    """-1 for unlimited."""
    max_ack_pending: int
    description: str = ""
    backoff_s: list[float] = field(default_factory=list)


STREAMS = (
    StreamSpec(
        WORK_STREAM,
        [WORK_SUBJECT, WORK_ROUTES],
        "workqueue",
        max_age_s=7 * 24 * 3600,
        description="episodes waiting for an env worker",
    ),
    StreamSpec(
        EVENTS_STREAM,
        [f"{EVENTS_SUBJECT_PREFIX}.>"],
        "limits",
        max_age_s=7 * 24 * 3600,
        description="the durable event log of every episode",
    ),
    StreamSpec(
        DEAD_LETTER_STREAM,
        [f"{DEAD_LETTER_SUBJECT_PREFIX}.>"],
        "limits",
        max_age_s=7 * 24 * 3600,
        description="messages a consumer without a database rejected, for the recorder to store in dead_letters",
    ),
    StreamSpec(
        ADVISORY_STREAM,
        [WORK_MAX_DELIVERIES_ADVISORIES],
        "limits",
        max_age_s=7 * 24 * 3600,
        description="max-deliveries advisories of the work queue (episodes whose workers kept dying)",
    ),
)

