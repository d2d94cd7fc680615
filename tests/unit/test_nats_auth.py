"""The NATS permission table (rollout_ledger/shared/nats_auth.py): every name of rollout_ledger/shared/subjects.py is
granted to the service that needs it and to no other, nobody may forge advisories, and the k8s nats.conf carries
exactly this table."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rollout_ledger.cli.stack.servers import find_nats_server
from rollout_ledger.services import catalog
from rollout_ledger.shared import nats_auth, subjects
from rollout_ledger.shared.kit.settings import BaseServiceSettings
from rollout_ledger.shared.nats_auth import (
    ENV_WORKER,
    INFERENCE_WORKER,
    RECORDER,
    SCHEDULER,
    USERS,
    may,
    may_publish,
    may_subscribe,
    permission_table,
    render_authorization,
)

ROOT = Path(__file__).resolve().parents[2]
API = "$JS.API"


def publishers(subject: str) -> set[str]:
    return {user for user in USERS if may_publish(user, subject)}


def test_subject_patterns_match_like_nats() -> None:
    assert may("rl.events.>", "rl.events.turn.generated")
    assert not may("rl.events.>", "rl.events")
    assert may("rl.infer.worker.*", "rl.infer.worker.w1")
    assert not may("rl.infer.worker.*", "rl.infer.worker.w1.x")
    assert not may("$KV.rl_policy.>", "$KV.rl_policy_workers.w1")
    assert may("rl.work.episodes", "rl.work.episodes") and not may("rl.work.episodes", "rl.work.episodes.x")


def test_users_are_the_services_that_use_nats() -> None:
    assert set(USERS) == {w.name for w in catalog.WORKLOADS.values() if w.uses_nats}
    assert set(permission_table()) == set(USERS)


@pytest.mark.parametrize("subject", ["$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.RL_WORK.env-workers",
                                     subjects.WORK_MAX_DELIVERIES_ADVISORY, "$SYS.REQ.SERVER.PING",
                                     f"{API}.STREAM.DELETE.RL_EVENTS", f"{API}.STREAM.PURGE.RL_EVENTS",
                                     f"{API}.STREAM.MSG.DELETE.RL_EVENTS", f"{API}.CONSUMER.DELETE.RL_WORK.env-workers",
                                     f"{API}.STREAM.DELETE.KV_rl_cancelled", f"{API}.STREAM.PURGE.KV_rl_policy"])
def test_nobody_forges_advisories_or_removes_the_log(subject: str) -> None:
    assert publishers(subject) == set()


def test_only_the_scheduler_cancels_announces_and_enqueues() -> None:
    assert publishers(f"$KV.{subjects.CANCEL_BUCKET}.batch-1") == {SCHEDULER}
    assert publishers(f"$KV.{subjects.POLICY_BUCKET}.{subjects.POLICY_KEY}") == {SCHEDULER}
    # env workers hand a work item of a newer contract major back to the queue; nobody else writes work
    assert publishers(subjects.WORK_SUBJECT) == {SCHEDULER, ENV_WORKER}
    # work per route: the scheduler enqueues, env workers publish retries and hand items back
    for route in ("arithmetic", "remote:echo", "rg"):
        assert publishers(subjects.work_subject(route)) == {SCHEDULER, ENV_WORKER}, route
    assert publishers(f"{subjects.work_subject('rg')}.x") == set()
    # only the scheduler changes a stream's configuration (every service may create a missing one)
    for stream in (subjects.EVENTS_STREAM, subjects.WORK_STREAM, "KV_rl_policy"):
        assert publishers(f"{API}.STREAM.UPDATE.{stream}") == {SCHEDULER}
        assert publishers(f"{API}.STREAM.CREATE.{stream}") == set(USERS)


def test_each_event_type_has_its_producers_only() -> None:
    assert publishers(subjects.event_subject("turn.generated")) == {INFERENCE_WORKER}
    for event in ("step.completed", "episode.started", "episode.finished", "episode.cancelled",
                  "inference.requested"):
        assert publishers(subjects.event_subject(event)) == {ENV_WORKER}, event
    assert publishers(subjects.event_subject("episode.failed")) == {ENV_WORKER, RECORDER}
    assert publishers(subjects.event_subject("episode.requested")) == set()
    assert publishers(subjects.event_subject("made.up")) == set()


def test_inference_requests_and_replies() -> None:
    assert publishers(subjects.INFER_ANY) == {ENV_WORKER}
    assert publishers(subjects.infer_worker_subject("w1")) == {ENV_WORKER}
    assert publishers(subjects.INFER_CANCEL) == {ENV_WORKER}
    assert publishers(subjects.INFER_HEARTBEAT) == {INFERENCE_WORKER}
    assert {u for u in USERS if may_subscribe(u, subjects.INFER_ANY)} == {INFERENCE_WORKER}
    assert {u for u in USERS if may_subscribe(u, subjects.INFER_HEARTBEAT)} == {ENV_WORKER}
    # progress: an inference worker tells a requester its request is still held, on the requester's own subject
    progress = subjects.infer_progress_subject("abc123")
    assert publishers(progress) == {INFERENCE_WORKER}
    assert {u for u in USERS if may_subscribe(u, progress)} == {ENV_WORKER}
    assert [u for u, p in permission_table().items() if p.allow_responses] == [INFERENCE_WORKER, RECORDER]


def test_resume_queries_go_from_env_workers_to_recorders() -> None:
    assert publishers(subjects.RESUME_SUBJECT) == {ENV_WORKER}
    assert {u for u in USERS if may_subscribe(u, subjects.RESUME_SUBJECT)} == {RECORDER}


def test_replies_reach_only_their_requester() -> None:
    for user in USERS:
        inbox = f"{nats_auth.inbox_prefix(user)}.abc.1"
        assert {u for u in USERS if may_subscribe(u, inbox)} == {user}
        assert not may_subscribe(user, "_INBOX.abc.1"), "the default inbox prefix is nobody's"
    assert not any(may_subscribe(u, subjects.WORK_SUBJECT) for u in USERS), "work is pulled, never subscribed"
    assert not any(may_subscribe(u, subjects.work_subject("arithmetic")) for u in USERS)
    assert not any(may_subscribe(u, "$SYS.ACCOUNT.x.CONNECT") for u in USERS)


def test_an_inference_worker_may_answer_an_env_worker_however_long_the_turn_took() -> None:
    """``allow_responses: true`` lets a reply through only within 2 minutes of the request's delivery (nats-server's
    default expiry): a turn that took longer (a long turn on a CPU, kept alive by progress messages) had its reply
    refused, and its try waited out its timeout. The inference worker may publish into env workers' inboxes
    explicitly, and into nobody else's."""
    env_inbox = f"{nats_auth.inbox_prefix(ENV_WORKER)}.abc.1"
    assert publishers(env_inbox) == {INFERENCE_WORKER}
    for user in USERS:
        if user != ENV_WORKER:
            assert not may_publish(INFERENCE_WORKER, f"{nats_auth.inbox_prefix(user)}.abc.1"), user


def test_every_stream_is_written_and_consumed_by_someone() -> None:
    """A stream added to subjects.py without a grant fails here (the advisory stream is written by NATS itself)."""
    consumers = {subjects.WORK_STREAM: (subjects.WORK_CONSUMER, ENV_WORKER),
                 subjects.EVENTS_STREAM: (subjects.RECORDER_CONSUMER, RECORDER),
                 subjects.ADVISORY_STREAM: (subjects.ADVISORY_CONSUMER, RECORDER),
                 subjects.DEAD_LETTER_STREAM: (subjects.DEAD_LETTER_CONSUMER, RECORDER)}
    assert set(consumers) == {s.name for s in subjects.STREAMS}
    for spec in subjects.STREAMS:
        durable, user = consumers[spec.name]
        pull = f"{API}.CONSUMER.MSG.NEXT.{spec.name}.{durable}"
        assert {u for u in USERS if may_publish(u, pull)} == {user}, spec.name
        assert {u for u in USERS if may_publish(u, f"$JS.ACK.{spec.name}.{durable}.1.2.3.4.5")} == {user}
    assert publishers(subjects.WORK_MAX_DELIVERIES_ADVISORY) == set()  # RL_ADVISORIES: written by NATS only
    assert publishers(subjects.work_max_deliveries_advisory(subjects.work_consumer("rg"))) == set()
    assert publishers(subjects.WORK_DEAD_LETTER_SUBJECT) == {ENV_WORKER}
    for route in ("arithmetic", "remote:echo"):  # every route's consumer: the env workers' only
        durable = subjects.work_consumer(route)
        for verb in ("MSG.NEXT", "DURABLE.CREATE", "CREATE", "INFO"):
            assert may_publish(ENV_WORKER, f"{API}.CONSUMER.{verb}.{subjects.WORK_STREAM}.{durable}"), verb
        assert {u for u in USERS if may_publish(u, f"{API}.CONSUMER.MSG.NEXT.{subjects.WORK_STREAM}.{durable}")} \
            == {ENV_WORKER}
        assert {u for u in USERS if may_publish(u, f"$JS.ACK.{subjects.WORK_STREAM}.{durable}.1.2.3.4.5")} \
            == {ENV_WORKER}


def test_every_bucket_has_its_writers_only() -> None:
    writers = {subjects.ENVS_BUCKET: {ENV_WORKER}, subjects.CANCEL_BUCKET: {SCHEDULER},
               subjects.POLICY_BUCKET: {SCHEDULER}, subjects.POLICY_WORKERS_BUCKET: {INFERENCE_WORKER},
               subjects.POLICY_ENV_BUCKET: {ENV_WORKER}, subjects.LEASE_BUCKET: {ENV_WORKER},
               subjects.ENV_WORKERS_BUCKET: {ENV_WORKER}}
    assert set(writers) == set(subjects.BUCKETS), (
        "a new bucket needs its writers here and in rollout_ledger/shared/nats_auth.py")
    for bucket, users in writers.items():
        assert publishers(f"$KV.{bucket}.some-key") == users, bucket
        # whoever writes a bucket can read it back (get and watch)
        for user in users:
            assert may_publish(user, f"{API}.DIRECT.GET.KV_{bucket}.$KV.{bucket}.some-key")
            assert may_publish(user, f"{API}.CONSUMER.CREATE.KV_{bucket}.watcher.$KV.{bucket}.>")


@pytest.mark.parametrize("template", ["{api}.CONSUMER.CREATE.{s}.{d}",
                                      "{api}.CONSUMER.CREATE.{s}.{d}.rl.events.turn.generated",
                                      "{api}.CONSUMER.DURABLE.CREATE.{s}.{d}", "{api}.CONSUMER.DELETE.{s}.{d}",
                                      "{api}.CONSUMER.MSG.NEXT.{s}.{d}", "$JS.ACK.{s}.{d}.1.2.3.4.5"])
def test_only_its_owner_touches_a_durable_consumer(template: str) -> None:
    """Even a wildcard grant (a short-lived consumer of any name) cannot re-filter, pull from or ack another
    service's durable consumer: create is create-or-update."""
    owners = {(subjects.WORK_STREAM, subjects.WORK_CONSUMER): ENV_WORKER,
              (subjects.WORK_STREAM, subjects.work_consumer("remote:echo")): ENV_WORKER,
              (subjects.EVENTS_STREAM, subjects.RECORDER_CONSUMER): RECORDER,
              (subjects.ADVISORY_STREAM, subjects.ADVISORY_CONSUMER): RECORDER,
              (subjects.DEAD_LETTER_STREAM, subjects.DEAD_LETTER_CONSUMER): RECORDER}
    for (stream, durable), owner in owners.items():
        subject = template.format(api=API, s=stream, d=durable)
        assert publishers(subject) <= {owner}, subject
    # the recorder may still read the work consumer's state (to check an advisory against it)
    assert may_publish(RECORDER, f"{API}.CONSUMER.INFO.{subjects.WORK_STREAM}.{subjects.WORK_CONSUMER}")
    assert may_publish(RECORDER, f"{API}.CONSUMER.INFO.{subjects.WORK_STREAM}.{subjects.work_consumer('rg')}")


def test_the_recorder_removes_only_work_items() -> None:
    assert publishers(f"{API}.STREAM.MSG.DELETE.{subjects.WORK_STREAM}") == {RECORDER}
    for stream in (subjects.EVENTS_STREAM, subjects.ADVISORY_STREAM, subjects.DEAD_LETTER_STREAM):
        assert publishers(f"{API}.STREAM.MSG.DELETE.{stream}") == set()


def test_k8s_nats_conf_carries_the_table() -> None:
    conf = (ROOT / "deploy/k8s/base/nats-auth.conf").read_text()
    assert conf == render_authorization(), (
        "regenerate: python -m rollout_ledger.shared.nats_auth > deploy/k8s/base/nats-auth.conf")
    for user in USERS:
        assert f"${nats_auth.password_variable(user)}" in conf
    for path in ("deploy/k8s/base/nats.conf", "deploy/k8s/overlays/prod/nats.conf"):
        assert "include ./nats-auth.conf" in (ROOT / path).read_text(), path


@pytest.mark.parametrize("conf", ["deploy/k8s/base/nats.conf", "deploy/k8s/overlays/prod/nats.conf"])
def test_k8s_nats_conf_is_valid_and_needs_every_password(conf: str, tmp_path: Path) -> None:
    """``nats-server -t`` accepts the manifests' config with the passwords in its environment, and refuses to start
    without one (never an open server because a Secret key is missing)."""
    shutil.copy(ROOT / conf, tmp_path / "nats.conf")
    shutil.copy(ROOT / "deploy/k8s/base/nats-auth.conf", tmp_path / "nats-auth.conf")
    env = {"PATH": os.environ.get("PATH", ""), "POD_NAME": "nats-0",
           **{nats_auth.password_variable(u): f"pw-{u}" for u in USERS}}

    def check(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([find_nats_server(), "-t", "-c", "nats.conf"], cwd=tmp_path, env=environment,
                              capture_output=True, text=True, timeout=30, check=False)

    ok = check(env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    missing = check({k: v for k, v in env.items() if k != nats_auth.password_variable(RECORDER)})
    assert missing.returncode != 0 and "RECORDER_NATS_PASSWORD" in missing.stderr + missing.stdout


def test_local_rendering_writes_passwords_in() -> None:
    text = render_authorization({u: f"pw-{u}" for u in USERS}, extra_users={"admin": "pw-admin"})
    assert '"pw-scheduler"' in text and '{user: "admin", password: "pw-admin"}' in text
    assert "$SCHEDULER_NATS_PASSWORD" not in text
    assert text.count("allow_responses: true") == 2  # inference workers (turns), recorders (resume queries)


def test_services_bind_loopback_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_HTTP_HOST", raising=False)
    assert BaseServiceSettings().http_host == "127.0.0.1"
    monkeypatch.setenv("ROLLOUT_HTTP_HOST", "0.0.0.0")
    assert BaseServiceSettings().http_host == "0.0.0.0"


def test_nats_security_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_NATS_USER", "recorder")
    monkeypatch.setenv("ROLLOUT_NATS_PASSWORD", "s3cret")
    monkeypatch.setenv("ROLLOUT_NATS_TLS_CA", "/etc/nats-ca/ca.crt")
    settings = BaseServiceSettings()
    assert "s3cret" not in repr(settings)
    security = settings.nats_security()
    assert (security.user, security.password, security.tls_ca) == ("recorder", "s3cret", "/etc/nats-ca/ca.crt")
