"""NATS authorization and TLS: the real services complete a batch as their own users, every refusal of
rollout_ledger/shared/nats_auth.py holds on a real nats-server (each checked against stored state, with the admin doing
the same thing as the control), and TLS with a CA generated here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from rollout_ledger.cli.stack.servers import (
    ADMIN_USER,
    NatsTls,
    PrivateNats,
    find_nats_server,
    free_port,
    wait_port,
)
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.settings import NatsSecurity
from rollout_ledger.shared.subjects import (
    ADVISORY_STREAM,
    CANCEL_BUCKET,
    EVENTS_STREAM,
    POLICY_BUCKET,
    POLICY_KEY,
    RECORDER_CONSUMER,
    WORK_MAX_DELIVERIES_ADVISORY,
    WORK_STREAM,
    WORK_SUBJECT,
    event_subject,
)
from tests.helpers import API_TOKEN, AUTH, Sql
from tests.integration.test_crash import post, wait_done
from tests.integration.test_live_weights import _until_state
from tests.unit.test_weight_swap import checkpoint

DENIED_WAIT_S = 1.0
"""How long a refused JetStream request waits for the answer that never comes (the server drops it)."""


def _private_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture
def secured() -> Iterator[PrivateNats]:
    """A nats-server of its own with the project's users and permissions (the session's server stays open)."""
    root = _private_dir("rollout-ledger-nats-auth-")
    server = PrivateNats(root, auth=True)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


async def _as(server: PrivateNats, user: str) -> bus.NATS:
    return await bus.connect(server.url, name=f"test-{user}", security=server.security(user), initial_wait_s=5)


@pytest_asyncio.fixture
async def admin(secured: PrivateNats) -> AsyncIterator[bus.NATS]:
    nc = await _as(secured, ADMIN_USER)
    await bus.ensure_topology(nc.jetstream())
    yield nc
    await nc.close()


async def _refused(nc: bus.NATS, what: str) -> bool:
    """Whether the server reports a permissions violation naming ``what`` to ``nc`` (its -ERR may come after the
    answer to a later round trip, so wait for it, up to 5 s)."""
    for _ in range(100):
        error = str(nc.last_error or "").lower()
        if "permissions violation" in error and what.lower() in error:
            return True
        await asyncio.sleep(0.05)
    return False


async def _messages(admin: bus.NATS, stream: str) -> int:
    return int((await admin.jetstream().stream_info(stream)).state.messages)


async def test_no_anonymous_or_wrong_login(secured: PrivateNats) -> None:
    with pytest.raises(BusError, match="refused the login of user \\(anonymous\\)") as anon:
        await bus.connect(secured.url, name="anon", security=NatsSecurity(), initial_wait_s=20)
    assert anon.value.retryable is False
    with pytest.raises(BusError, match="refused the login of user env-worker"):
        await bus.connect(secured.url, name="wrong", initial_wait_s=20,
                          security=NatsSecurity(user="env-worker", password="not-the-password"))
    # a service user cannot log in with another user's password either
    with pytest.raises(BusError, match="refused the login of user scheduler"):
        await bus.connect(secured.url, name="swap", initial_wait_s=20, security=NatsSecurity(
            user="scheduler", password=secured.passwords["env-worker"]))


async def test_a_dead_server_fails_within_the_initial_wait() -> None:
    """nats-py alone retries a first connection forever; bus.connect gives up after ``initial_wait_s``."""
    with pytest.raises(BusError, match=r"within 1\.0s") as err:
        await bus.connect(f"nats://127.0.0.1:{free_port()}", name="dead", initial_wait_s=1.0,
                          security=NatsSecurity())
    assert err.value.retryable is True


async def test_env_worker_cannot_cancel_announce_or_forge_advisories(secured: PrivateNats,
                                                                     admin: bus.NATS) -> None:
    worker = await _as(secured, nats_auth.ENV_WORKER)
    try:
        js = worker.jetstream(timeout=DENIED_WAIT_S)
        for bucket, key in ((CANCEL_BUCKET, "batch-1"), (POLICY_BUCKET, POLICY_KEY)):
            kv = await js.key_value(bucket)  # reading is allowed
            with pytest.raises(TimeoutError):
                await kv.put(key, b"forged")
            assert await _refused(worker, f'publish to "$kv.{bucket}.{key}"')
            with pytest.raises(NotFoundError):
                await (await admin.jetstream().key_value(bucket)).get(key)
        # the max-deliveries advisory the recorder acts on: the worker's copy never reaches RL_ADVISORIES
        before = await _messages(admin, ADVISORY_STREAM)
        await worker.publish(WORK_MAX_DELIVERIES_ADVISORY, b'{"stream": "RL_EVENTS", "stream_seq": 1}')
        assert await _refused(worker, f'publish to "{WORK_MAX_DELIVERIES_ADVISORY}"')
        assert await _messages(admin, ADVISORY_STREAM) == before
        # the control: the same publish from a user without the deny is stored (so the check above can fail).
        # It waits for the stream's ack: a flush only proves the server read the message, and a stream stores
        # what it captures after that, so counting right after a flush raced the store (CI saw 0 once).
        ack = await admin.jetstream().publish(WORK_MAX_DELIVERIES_ADVISORY, b"{}", timeout=5)
        assert ack.stream == ADVISORY_STREAM
        assert await _messages(admin, ADVISORY_STREAM) == before + 1
        # nor may it remove the durable log or a message of it
        await admin.jetstream().publish(event_subject("episode.started"), b"{}")
        with pytest.raises(TimeoutError):
            await js.delete_msg(EVENTS_STREAM, 1)
        with pytest.raises(TimeoutError):
            await js.delete_stream(EVENTS_STREAM)
        assert await _messages(admin, EVENTS_STREAM) == 1
        # nor re-filter the recorder's consumer (consumer create is create-or-update) or pull from it
        await bus.ensure_consumer(admin.jetstream(), bus.recorder_consumer_spec(30.0, 100))
        with pytest.raises(TimeoutError):
            await js.add_consumer(EVENTS_STREAM, js_api.ConsumerConfig(
                name=RECORDER_CONSUMER, durable_name=RECORDER_CONSUMER, ack_policy=js_api.AckPolicy.EXPLICIT,
                filter_subject=event_subject("turn.generated")))
        info = await admin.jetstream().consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
        assert info.config.filter_subject == event_subject(">") and info.num_pending == 1
    finally:
        await worker.close()


async def test_recorder_and_inference_worker_stay_in_their_lanes(secured: PrivateNats, admin: bus.NATS) -> None:
    recorder = await _as(secured, nats_auth.RECORDER)
    inference = await _as(secured, nats_auth.INFERENCE_WORKER)
    try:
        before = await _messages(admin, WORK_STREAM)
        with pytest.raises(TimeoutError):
            await recorder.jetstream(timeout=DENIED_WAIT_S).publish(WORK_SUBJECT, b"{}", timeout=DENIED_WAIT_S)
        assert await _refused(recorder, f'publish to "{WORK_SUBJECT}"')
        with pytest.raises(TimeoutError):  # only the env workers run episodes: no turn events from the recorder
            await recorder.jetstream().publish(event_subject("turn.generated"), b"{}", timeout=DENIED_WAIT_S)
        assert await _messages(admin, WORK_STREAM) == before
        # an inference worker reads no work items and publishes no episode events
        sub = await inference.subscribe(WORK_SUBJECT)
        assert await _refused(inference, f'subscription to "{WORK_SUBJECT}"')
        await sub.unsubscribe()
        with pytest.raises(TimeoutError):
            await inference.jetstream().publish(event_subject("episode.finished"), b"{}", timeout=DENIED_WAIT_S)
        # nor another service's replies, nor the event log as it is written
        for subject in (f"{nats_auth.inbox_prefix(nats_auth.ENV_WORKER)}.>", "rl.events.>"):
            snoop = await recorder.subscribe(subject)
            await recorder.flush()
            assert await _refused(recorder, f'subscription to "{subject}"')
            await snoop.unsubscribe()
        assert await _messages(admin, EVENTS_STREAM) == 0
        # what each may do goes through: a turn event from the inference worker is stored
        await inference.jetstream().publish(event_subject("turn.generated"), b"{}", timeout=5)
        assert await _messages(admin, EVENTS_STREAM) == 1
    finally:
        await recorder.close()
        await inference.close()


def test_services_complete_a_batch_as_their_own_users(secured: PrivateNats, database_url: str, model_dir: str,
                                                      tmp_path: Path) -> None:
    """Scheduler, env worker, inference worker (fake engine) and recorder, each with its own credentials only."""
    service_env = {service: secured.env_for(service) for service in nats_auth.USERS}
    assert all(env["ROLLOUT_NATS_USER"] == service for service, env in service_env.items())
    with Stack(secured.url, database_url, tmp_path / "logs", env={"ROLLOUT_MODEL": model_dir},
               service_env=service_env, api_token=API_TOKEN) as stack:
        # each turn takes longer than the env worker's request timeout: it is the inference worker's progress on
        # the env worker's progress subject (both as their own users) that keeps the tries from timing out
        stack.start("inference-worker", name="inf-a", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="1.5")
        stack.start("env-worker", ROLLOUT_INFERENCE_REQUEST_TIMEOUT_S="1.0", ROLLOUT_INFERENCE_MAX_TRIES="1")
        stack.start("recorder")
        url = stack.start("scheduler").url
        batch_id = post(url, env="fixed-turns", tasks=[{"turns": 2}] * 3, group_size=2, max_turns=2,
                        sampling={"max_tokens": 8})
        info = wait_done(url, batch_id, 90)
        assert info["counts"] == {**info["counts"], "completed": 6}  # type: ignore[dict-item]
        sql = Sql(database_url)
        try:
            assert sql.scalar("select count(*) from trajectories where batch_id = :b", b=batch_id) == 6
        finally:
            sql.close()
        # the scheduler's own buckets: a cancel (env workers watch it) and a policy version the inference worker
        # loads and reports (its report bucket, mirrored by the scheduler)
        assert httpx.post(f"{url}/v1/batches/{batch_id}/cancel", headers=AUTH, timeout=10).status_code == 200
        r = httpx.post(f"{url}/v1/policy/versions", headers=AUTH, timeout=10,
                       json={"version": 1, "checkpoint": str(checkpoint(model_dir, tmp_path / "ckpt-1"))})
        assert r.status_code == 201, r.text
        assert _until_state(url, "inf-a", 1, "serving")["version"] == 1
        violations = [line for proc in stack.procs for line in proc.tail_log(400).splitlines()
                      if "permissions violation" in line.lower()]
        assert violations == [], "a service used a subject its user may not:\n" + "\n".join(violations[:10])


# --- TLS ------------------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_pem(path: Path, obj: x509.Certificate | ec.EllipticCurvePrivateKey) -> Path:
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _server_cert(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
                 ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


@pytest.fixture
def tls_nats() -> Iterator[tuple[PrivateNats, Path, Path]]:
    """A nats-server with TLS and authorization; the CA that signed it; another CA."""
    root = _private_dir("rollout-ledger-nats-tls-")
    ca, ca_key = _ca("rollout-ledger test CA")
    cert, key = _server_cert(ca, ca_key)
    other, _ = _ca("some other CA")
    server = PrivateNats(root / "nats", auth=True, tls_ca=_write_pem(root / "ca.pem", ca),
                         tls=NatsTls(cert=_write_pem(root / "server.pem", cert),
                                     key=_write_pem(root / "server-key.pem", key)))
    server.start()
    yield server, root / "ca.pem", _write_pem(root / "other-ca.pem", other)
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


async def test_tls_with_a_verified_server_only(tls_nats: tuple[PrivateNats, Path, Path]) -> None:
    server, ca, other_ca = tls_nats
    assert server.url.startswith("tls://")
    assert server.env_for("recorder")["ROLLOUT_NATS_TLS_CA"] == str(ca)
    nc = await bus.connect(server.url, name="tls-ok", security=server.security(nats_auth.SCHEDULER),
                           initial_wait_s=5)
    try:
        assert nc.connected_url is not None and nc.connected_url.scheme == "tls"
        await bus.ensure_topology(nc.jetstream())  # JetStream works through it
    finally:
        await nc.close()
    password = server.passwords[nats_auth.SCHEDULER]
    # a client trusting another CA (or only the system's) does not accept the server's certificate
    with pytest.raises(BusError, match="cannot connect"):
        await bus.connect(server.url, name="tls-other-ca", initial_wait_s=2,
                          security=NatsSecurity(user="scheduler", password=password, tls_ca=str(other_ca)))
    with pytest.raises(BusError, match="cannot connect"):
        await bus.connect(server.url, name="tls-system-cas", initial_wait_s=2,
                          security=NatsSecurity(user="scheduler", password=password))
    # and a plain-text client is turned away
    with pytest.raises(BusError):
        await bus.connect(server.url.replace("tls://", "nats://"), name="plain", initial_wait_s=2,
                          security=NatsSecurity(user="scheduler", password=password))



@pytest.fixture
def k8s_nats() -> Iterator[tuple[int, str]]:
    """What the manifests run: deploy/k8s/base/nats-auth.conf (passwords from the environment) and the TLS flags of
    components/nats-tls, on a real nats-server; its port and the CA file."""
    root = _private_dir("rollout-ledger-nats-k8s-")
    ca, ca_key = _ca("k8s test CA")
    cert, key = _server_cert(ca, ca_key)
    shutil.copy(Path(__file__).resolve().parents[2] / "deploy/k8s/base/nats-auth.conf", root / "nats-auth.conf")
    port = free_port()
    (root / "nats.conf").write_text(f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{root / "js"}" }}\n'
                                    "include ./nats-auth.conf\n")
    env = {nats_auth.password_variable(u): f"pw-{u}" for u in nats_auth.USERS}
    proc = subprocess.Popen([find_nats_server(), "-c", str(root / "nats.conf"), "--tls",
                             f"--tlscert={_write_pem(root / 'tls.crt', cert)}",
                             f"--tlskey={_write_pem(root / 'tls.key', key)}"],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 20, proc, "nats-server")
        yield port, str(_write_pem(root / "ca.crt", ca))
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


async def test_k8s_auth_conf_and_tls_flags_on_a_live_server(k8s_nats: tuple[int, str]) -> None:
    """A service user connects with the CA and declares the topology; plain text and a wrong password are refused."""
    port, ca_file = k8s_nats
    nc = await bus.connect(f"tls://127.0.0.1:{port}", name="k8s-recorder", initial_wait_s=5,
                           security=NatsSecurity(user="recorder", password="pw-recorder", tls_ca=ca_file))
    try:
        await bus.ensure_topology(nc.jetstream())
    finally:
        await nc.close()
    with pytest.raises(BusError):
        await bus.connect(f"nats://127.0.0.1:{port}", name="k8s-plain", initial_wait_s=2,
                          security=NatsSecurity(user="recorder", password="pw-recorder"))
    with pytest.raises(BusError, match="refused the login"):
        await bus.connect(f"tls://127.0.0.1:{port}", name="k8s-wrong", initial_wait_s=5,
                          security=NatsSecurity(user="recorder", password="pw-scheduler", tls_ca=ca_file))
