"""Settings every service shares (bus, store, model, logging); each service subclasses ``BaseServiceSettings`` and
the mixins of what it does (``ConsumerSettings`` for a JetStream pull consumer, ``DatabaseSettings`` for a pool).

All settings come from environment variables, documented in docs/configuration.md. ``NATS_URL`` and
``DATABASE_URL`` are read without a prefix; everything else is ``ROLLOUT_<NAME>``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_ledger.shared.deploy import HTTP_PORT


def default_model_dir() -> Path:
    """Where ``rollout model fetch`` caches the converted SmolLM2-135M-Instruct."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-ledger" / "models" / "SmolLM2-135M-Instruct"


def normalize_database_url(url: str) -> str:
    """Accept ``postgres://`` / ``postgresql://`` and use the psycopg 3 driver.

    Several hosts (a primary and its standbys; with ``target_session_attrs=read-write`` a connection lands on the
    one that accepts writes) may be written as libpq writes them, ``postgresql://u:pw@h1:p1,h2:p2/db?...``, or as
    SQLAlchemy does, ``postgresql+psycopg://u:pw@/db?host=h1:p1&host=h2:p2&...`` (or ``?host=h1,h2&port=p1,p2``);
    the first becomes the second (the only one SQLAlchemy parses). Hosts in both places are refused."""
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    return _hosts_into_query(url)


def _split_netloc(url: str) -> tuple[str, str, str, str, str] | None:
    """``scheme://userinfo@hosts/rest`` -> (scheme, userinfo with its ``@`` or empty, hosts, path, query); None when
    ``url`` has no ``://``. Split by hand: ``urllib`` refuses a port list."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    netloc, _, query = rest.partition("?")
    netloc, slash, path = netloc.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    return scheme, userinfo + at, hosts, slash + path, query


def _hosts_into_query(url: str) -> str:
    parts = _split_netloc(url)
    if parts is None or "," not in parts[2]:
        return url
    scheme, userinfo, hosts, path, query = parts
    from urllib.parse import parse_qsl, quote

    if any(k in ("host", "hostaddr", "port") for k, _ in parse_qsl(query, keep_blank_values=True)):
        raise ValueError("a database URL names its hosts either in the netloc (h1:p1,h2:p2) or in the query "
                         "(?host=h1:p1&host=h2:p2), not in both")
    names = hosts.split(",")
    if not all(names):
        raise ValueError(f"empty host in the host list {hosts!r} of the database URL")
    listed = "&".join(f"host={quote(h, safe=':[]')}" for h in names)
    return f"{scheme}://{userinfo}{path or '/'}?{listed}" + (f"&{query}" if query else "")


def libpq_database_url(url: str) -> str:
    """``url`` (any form ``normalize_database_url`` takes) as a libpq connection URI, for psycopg and ADBC
    connections made without SQLAlchemy: no driver suffix, and several hosts in the netloc
    (``postgresql://u:pw@h1:p1,h2:p2/db?target_session_attrs=read-write``), the form libpq reads."""
    from urllib.parse import parse_qsl, quote, urlencode

    normal = normalize_database_url(url).replace("postgresql+psycopg://", "postgresql://", 1)
    parts = _split_netloc(normal)
    if parts is None:
        return normal
    scheme, userinfo, hosts, path, query = parts
    params = parse_qsl(query, keep_blank_values=True)
    listed = [v for k, v in params if k == "host"]
    if hosts or not any(":" in h and not h.startswith("/") for h in listed):
        return normal  # a netloc host, a socket directory or ?host=h1,h2&port=p1,p2: libpq reads them as they are
    if any(k == "port" for k, _ in params):
        raise ValueError("a database URL gives its ports either with each host (host=h1:p1) or as port=, not both")
    netloc = ",".join(listed)
    rest = [(k, v) for k, v in params if k not in ("host", "port")]
    tail = f"?{urlencode(rest, quote_via=quote)}" if rest else ""
    return f"{scheme}://{userinfo}{quote(netloc, safe=':,[]')}{path}{tail}"


@dataclass(frozen=True)
class NatsSecurity:
    """How a service authenticates to NATS and verifies it: user/password and TLS files (empty: not used)."""

    user: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""


def with_query(url: str, params: dict[str, str]) -> str:
    """``url`` with ``params`` set in its query string (replacing the same names)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.update_query_dict(params).render_as_string(hide_password=False)


class BaseServiceSettings(BaseSettings):
    """Settings shared by every service."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="ignore", populate_by_name=True,
                                      use_attribute_docstrings=True)

    nats_url: str = Field("nats://127.0.0.1:4222", validation_alias=AliasChoices("NATS_URL", "ROLLOUT_NATS_URL"))
    """NATS server(s), comma-separated."""
    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        validation_alias=AliasChoices("DATABASE_URL", "ROLLOUT_DATABASE_URL"),
    )
    """Postgres DSN (``postgres://`` is accepted and normalised to psycopg 3). A primary and its standbys may be
    listed (``postgresql://u:pw@h1:5432,h2:5432/db?target_session_attrs=read-write``, or SQLAlchemy's
    ``?host=h1:5432&host=h2:5432``): each new connection goes to the one that takes writes."""
    log_level: str = "INFO"
    """Log level (JSON logs unless ROLLOUT_LOG_FORMAT=console)."""
    log_format: str = "auto"
    """``json``, ``console`` or ``auto`` (console on a TTY)."""
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    """Identity of this process in events and metrics (defaults to host-pid)."""
    http_host: str = "127.0.0.1"
    """Address the service's HTTP server (health, metrics, API) binds: loopback unless configured (the k8s manifests
    set ``0.0.0.0`` so the pod is reachable)."""
    http_port: int = HTTP_PORT
    """Port of the HTTP server; 0 picks a free one."""
    model: str = Field(default_factory=lambda: str(default_model_dir()))
    """Hugging Face model directory (or hub id where a hub is reachable); tokenizer and template come from it."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight work may take to finish before the process exits."""
    nats_connect_timeout_s: float = 2.0
    """Bounded connect timeout (nats-py's default takes minutes to fail)."""
    nats_user: str = ""
    """NATS user this service connects as (its catalog name: ``scheduler``, ``env-worker``, ...; the permissions
    of each are in shared/nats_auth.py); empty: no credentials (a NATS server without authorization)."""
    nats_password: SecretStr = SecretStr("")
    """Password of ``ROLLOUT_NATS_USER`` (from a Secret; the local stack generates one per service)."""
    nats_tls_ca: str = ""
    """CA bundle (PEM file) that verifies the NATS server's certificate; set it to connect with TLS."""
    nats_tls_cert: str = ""
    """Client certificate (PEM file) for a NATS server that verifies clients (mutual TLS); optional."""
    nats_tls_key: str = ""
    """Private key (PEM file) of ``ROLLOUT_NATS_TLS_CERT``."""
    stream_replicas: int = Field(1, ge=1, le=5)
    """Replicas of every JetStream stream and KV bucket the services declare: 1 on a single NATS server, 3 on a
    three-node JetStream cluster (an existing stream is scaled to it at the next service start)."""
    tracing_endpoint: str = Field(
        "", validation_alias=AliasChoices("ROLLOUT_TRACING_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"))
    """OpenTelemetry collector (OTLP over HTTP, protobuf) the service sends its spans to, e.g.
    ``http://otel-collector:4318`` (``/v1/traces`` is appended unless the URL ends with it); the standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read too. Empty: tracing off, no span made and no trace header written
    (docs/tracing.md)."""
    tracing_sample_ratio: float = Field(1.0, ge=0, le=1)
    """Fraction of episodes traced, decided where the trace starts (the scheduler's publish of the work item) and
    followed by every service downstream."""
    tracing_export_timeout_s: float = Field(10.0, gt=0)
    """How long one export of a batch of spans to the collector may take (the SDK's export thread; never a turn)."""

    @field_validator("database_url")
    @classmethod
    def _normalize_db(cls, v: str) -> str:
        return normalize_database_url(v)

    def nats_security(self) -> NatsSecurity:
        """The credentials and TLS files ``bus.connect`` uses."""
        return NatsSecurity(user=self.nats_user, password=self.nats_password.get_secret_value(),
                            tls_ca=self.nats_tls_ca, tls_cert=self.nats_tls_cert, tls_key=self.nats_tls_key)


class ConsumerSettings(BaseServiceSettings):
    """Settings of a service that pulls from a JetStream durable consumer (env worker: work items; recorder:
    events)."""

    ack_wait_s: float = Field(30.0, gt=0)
    """A message not acked within this time is redelivered (in-progress pings extend it while it is worked on)."""
    max_ack_pending: int = Field(20_000, ge=1)
    """Messages delivered to the consumer and not yet acked, across every replica."""
    fetch_timeout_s: float = Field(1.0, gt=0)
    """How long one pull waits for messages (also bounds how fast SIGTERM is noticed)."""
    park_delay_s: float = Field(30.0, gt=0)
    """A message written at a newer major of the event contract (a newer producer in a rolling upgrade) is
    handed back for this long, counted and never dead-lettered, until an upgraded consumer reads it."""


class DatabaseSettings(BaseServiceSettings):
    """Settings of a service that holds a Postgres connection pool."""

    db_pool_size: int = Field(5, ge=1)
    """Postgres connections per process (SQLAlchemy pool size, the same again as overflow)."""
    db_sslmode: Literal["", "disable", "allow", "prefer", "require", "verify-ca", "verify-full"] = ""
    """TLS to Postgres (libpq ``sslmode``; empty: the DSN's own, else libpq's ``prefer``). ``verify-full`` checks
    the server's certificate against ``ROLLOUT_DB_SSLROOTCERT`` and its name against the DSN's host."""
    db_sslrootcert: str = ""
    """CA file the server's certificate is verified with (libpq ``sslrootcert``)."""
    db_sslcert: str = ""
    """Client certificate file, for a server that asks for one (libpq ``sslcert``)."""
    db_sslkey: str = ""
    """Key file of ``ROLLOUT_DB_SSLCERT`` (libpq ``sslkey``; mode 0600)."""

    @model_validator(mode="after")
    def _tls_into_dsn(self) -> DatabaseSettings:
        """The TLS fields become query parameters of ``database_url`` (what psycopg and libpq read); a parameter
        the DSN sets already is replaced."""
        given = {"sslmode": self.db_sslmode, "sslrootcert": self.db_sslrootcert, "sslcert": self.db_sslcert,
                 "sslkey": self.db_sslkey}
        params = {k: v for k, v in given.items() if v}
        if params:
            self.database_url = with_query(self.database_url, params)
        return self
