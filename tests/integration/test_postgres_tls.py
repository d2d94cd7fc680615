"""Postgres authentication and TLS on a private server: passwords on TCP, ``sslmode=verify-full`` against a CA made
here, a client with the wrong CA refused, client certificates when the server asks for them, and a service
(the recorder's engine, through ``DatabaseSettings``) connected over TLS."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy import text

from rollout_ledger.cli.stack.servers import PostgresTls, PrivatePostgres
from rollout_ledger.migrations.logins import libpq
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.shared.db import check_schema, create_engine


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


class CA:
    """A self-signed CA that issues server and client certificates (PEM files in ``folder``)."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name)
        now = dt.datetime.now(dt.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = _write(folder / f"{name}.crt", self.cert.public_bytes(serialization.Encoding.PEM))
        self.path.chmod(0o644)

    def issue(self, cn: str, *, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1)))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        crt = _write(self.folder / f"{cn}.crt", cert.public_bytes(serialization.Encoding.PEM))
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
        return crt, _write(self.folder / f"{cn}.key", pem)


@pytest.fixture
def tls_dir() -> Iterator[Path]:
    # not under pytest's 0700 tmp: postgres runs as nobody when the tests run as root
    root = Path(f"/tmp/rl-pg-tls-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _started(pg: PrivatePostgres) -> PrivatePostgres:
    pg.start()
    return pg


def test_tcp_clients_need_the_password(tls_dir: Path) -> None:
    pg = _started(PrivatePostgres(tls_dir / "pg"))
    try:
        with psycopg.connect(libpq(pg.url)) as conn:
            assert conn.execute("select current_user").fetchone() == ("postgres",)
        for wrong in ("", "not-the-password"):
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(f"postgresql://postgres:{wrong}@127.0.0.1:{pg.port}/rollout", connect_timeout=5)
    finally:
        pg.stop("immediate")


def test_verify_full_connects_and_a_wrong_ca_or_plain_tcp_is_refused(tls_dir: Path) -> None:
    ca, other = CA(tls_dir, "rollout-test-ca"), CA(tls_dir, "someone-elses-ca")
    cert, key = ca.issue("127.0.0.1", server=True)
    pg = _started(PrivatePostgres(tls_dir / "pg", tls=PostgresTls(cert, key, ca.path)))
    base = f"postgresql://postgres:{pg.password}@127.0.0.1:{pg.port}/rollout"
    try:
        assert "sslmode=verify-full" in pg.url
        with psycopg.connect(libpq(pg.url)) as conn:
            assert conn.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (True,)
        with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
            psycopg.connect(f"{base}?sslmode=verify-full&sslrootcert={other.path}", connect_timeout=5)
        with pytest.raises(psycopg.OperationalError, match=r"no encryption|SSL off"):
            psycopg.connect(f"{base}?sslmode=disable", connect_timeout=5)
        # a service: migrations, and the recorder's engine through DatabaseSettings' TLS fields
        upgrade(pg.url)
        from rollout_ledger.services.recorder.settings import RecorderSettings

        settings = RecorderSettings(database_url=base, db_sslmode="verify-full", db_sslrootcert=str(ca.path))
        assert "sslmode=verify-full" in settings.database_url

        async def check() -> bool:
            engine = create_engine(settings.database_url, pool_size=1)
            try:
                await check_schema(engine)
                async with engine.connect() as conn:
                    return bool((await conn.execute(text(
                        "select ssl from pg_stat_ssl where pid = pg_backend_pid()"))).scalar())
            finally:
                await engine.dispose()

        assert asyncio.run(check())
        wrong = RecorderSettings(database_url=base, db_sslmode="verify-full", db_sslrootcert=str(other.path))
        with pytest.raises(Exception, match="certificate verify failed"):
            asyncio.run(check_schema(create_engine(wrong.database_url, pool_size=1)))
    finally:
        pg.stop("immediate")


def test_client_certificates_when_the_server_asks_for_them(tls_dir: Path) -> None:
    ca, clients = CA(tls_dir, "server-ca"), CA(tls_dir, "client-ca")
    cert, key = ca.issue("127.0.0.1", server=True)
    pg = _started(PrivatePostgres(tls_dir / "pg", tls=PostgresTls(cert, key, ca.path, client_ca=clients.path)))
    try:
        with pytest.raises(psycopg.OperationalError, match="certificate"):
            psycopg.connect(libpq(pg.url), connect_timeout=5)
        mine, mine_key = clients.issue("postgres", server=False)
        with psycopg.connect(libpq(pg.url) + f"&sslcert={mine}&sslkey={mine_key}") as conn:
            assert conn.execute("select client_dn from pg_stat_ssl where pid = pg_backend_pid()").fetchone() == (
                "/CN=postgres",)
        stranger, stranger_key = CA(tls_dir, "stranger-ca").issue("postgres", server=False)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(libpq(pg.url) + f"&sslcert={stranger}&sslkey={stranger_key}", connect_timeout=5)
    finally:
        pg.stop("immediate")


def test_the_local_stack_makes_a_login_per_service(tls_dir: Path) -> None:
    from rollout_ledger.cli.stack.servers import LocalInfra
    from rollout_ledger.migrations.logins import SERVICE_ROLES

    with LocalInfra(nats_url="nats://127.0.0.1:1", database_url="", root=tls_dir / "stack", keep=True) as infra:
        upgrade(infra.database_url)
        logins = infra.create_database_logins()
        assert set(logins) == set(SERVICE_ROLES)
        for service, url in logins.items():
            with psycopg.connect(libpq(url)) as conn:
                row = conn.execute("SELECT rolsuper, pg_has_role(current_user, %s, 'USAGE') FROM pg_roles "
                                   "WHERE rolname = current_user", (SERVICE_ROLES[service],)).fetchone()
                assert row == (False, True), service
            password = psycopg.conninfo.conninfo_to_dict(libpq(url))["password"]
            assert password and password not in {infra.postgres.password if infra.postgres else ""}
            with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
                psycopg.connect(libpq(url).replace(f":{password}@", ":wrong@"), connect_timeout=5)
