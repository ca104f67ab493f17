"""A real Apache Kafka (KRaft) on loopback, from Maven Central jars, for development and tests.

Stdlib only. Every node is a combined broker+controller JVM (``kafka.Kafka server.properties``)
with a static controller quorum (``controller.quorum.voters``). Jars come from
``deploy/local/pom.xml`` through ``mvn dependency:copy-dependencies`` into a cache outside the
repository::

    ${ALPAMAYO_CACHE:-~/.cache/alpamayo-worker}/kafka-<version>-<pom hash>/libs

and the state of a named cluster (config, data, logs, pid files, TLS material) lives in::

    ${ALPAMAYO_CACHE:-~/.cache/alpamayo-worker}/kafka-run/<name>/

Python use::

    from deploy.local.cluster import LocalKafka
    kafka = LocalKafka(name="dev", nodes=1)
    bootstrap = kafka.start()      # idempotent; returns "127.0.0.1:PORT[,...]"
    kafka.kill_node(2); kafka.start_node(2)   # node ids are 1..nodes (= Kafka broker ids)
    kafka.stop()

CLI::

    python -m deploy.local.cluster start|stop|status|kill-node I|start-node I|jars \
        [--name N] [--nodes N] [--security plaintext|sasl_ssl] [--base-port P] [--fresh]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

__all__ = [
    "LocalKafka",
    "LocalKafkaError",
    "cache_root",
    "ensure_jars",
    "kafka_version",
    "probe_api_versions",
    "probe_metadata",
]

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"

KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"

SECURITY_MODES = ("plaintext", "sasl_ssl")
SCRAM_MECHANISM = "SCRAM-SHA-512"
DEFAULT_USERS = {"admin": "admin-secret", "worker": "worker-secret", "producer": "producer-secret"}

NODE_JVM_OPTS = [
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",  # small heap on a 2-core box: no GC threads fighting the broker
    "-XX:TieredStopAtLevel=1",  # C1 only: much less CPU at startup, plenty for local traffic
    "-Djava.awt.headless=true",
    "-Djava.net.preferIPv4Stack=true",
    "-Dlog4j2.shutdownHookEnabled=false",  # else log4j stops before Kafka's shutdown is logged
]
TOOL_JVM_OPTS = ["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto"]

LOG4J2_PROPERTIES = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
logger.common.name = org.apache.kafka.common.config
logger.common.level = WARN
"""


class LocalKafkaError(RuntimeError):
    """The local cluster could not be prepared, started or stopped (message says where to look)."""


# --------------------------------------------------------------------------------------------
# paths, jars
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$ALPAMAYO_CACHE`` or ``~/.cache/alpamayo-worker``."""
    # Reads ALPAMAYO_CACHE itself, the one exception to worker/config.py owning it (and, below, the one copy
    # of worker.demo_cache.file_lock): this module is stdlib-only and runs on the system python without the venv.
    env = os.environ.get("ALPAMAYO_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "alpamayo-worker"
    return root.resolve()


def kafka_version(pom: Path = POM) -> str:
    m = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", pom.read_text())
    if not m:
        raise LocalKafkaError(f"no <kafka.version> property in {pom}")
    return m.group(1)


def jars_dir(pom: Path = POM) -> Path:
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    return cache_root() / f"kafka-{kafka_version(pom)}-{digest}" / "libs"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_jars(pom: Path = POM, *, quiet: bool = True) -> Path:
    """Return the directory of Kafka jars, fetching them with Maven when missing.

    The directory is complete when it holds ``.complete``; a half-copied one is redone.
    """
    libs = jars_dir(pom)
    marker = libs / ".complete"
    if marker.exists():
        return libs
    with _file_lock(libs.parent / ".lock"):
        if marker.exists():
            return libs
        mvn = shutil.which("mvn")
        if not mvn:
            raise LocalKafkaError("Maven (mvn) is not on PATH: it is needed once to fetch the Kafka jars")
        _check_java()
        work = Path(tempfile.mkdtemp(prefix="mvn-", dir=libs.parent))
        try:
            # run Maven on a copy of the pom so that no target/ appears in the repository
            shutil.copy2(pom, work / "pom.xml")
            out = work / "libs"
            cmd = [
                mvn, "-B", *(["-q"] if quiet else []), "-f", str(work / "pom.xml"),
                "dependency:copy-dependencies", "-DincludeScope=runtime",
                f"-DoutputDirectory={out}",
            ]
            proc = subprocess.run(cmd, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LocalKafkaError(
                    "fetching the Kafka jars failed: " + " ".join(cmd) + "\n" + (proc.stdout + proc.stderr)[-4000:]
                )
            jars = sorted(p.name for p in out.glob("*.jar"))
            if not any(j.startswith("kafka_2.13-") for j in jars):
                raise LocalKafkaError(f"Maven ran but {out} holds no kafka_2.13 jar: {jars}")
            if libs.exists():
                shutil.rmtree(libs)
            out.rename(libs)
            marker.write_text("\n".join(jars) + "\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return libs


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise LocalKafkaError("java is not on PATH (Kafka 4 brokers need Java 17+)")
    return java


def _check_java() -> None:
    proc = subprocess.run([_java(), "-version"], capture_output=True, text=True)
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if m:
        major = int(m.group(1))
        if major == 1 and m.group(2):
            major = int(m.group(2))
        if major < 17:
            raise LocalKafkaError(f"Kafka 4 needs Java 17+, {_java()} is Java {major}")


# --------------------------------------------------------------------------------------------
# minimal Kafka protocol client (readiness probes)
# --------------------------------------------------------------------------------------------

API_METADATA = 3
API_VERSIONS = 18


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the broker")
        buf += chunk
    return bytes(buf)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def uvarint(self) -> int:
        shift = result = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def string(self) -> str | None:
        n = self.take(">h")
        if n < 0:
            return None
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s

    def compact_string(self) -> str | None:
        n = self.uvarint() - 1
        if n < 0:
            return None
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


def _roundtrip(sock: socket.socket, api_key: int, version: int, body: bytes, *, flexible: bool,
               corr: int = 1) -> _Reader:
    cid = b"alpamayo-local-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(cid)) + cid
    if flexible:
        header += b"\x00"  # request header v2: empty tagged fields
    msg = header + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    size = struct.unpack(">i", _recv_exact(sock, 4))[0]
    r = _Reader(_recv_exact(sock, size))
    got = r.take(">i")
    if got != corr:
        raise ConnectionError(f"correlation id mismatch ({got} != {corr})")
    if flexible and api_key != API_VERSIONS:  # ApiVersions responses always use header v0
        r.skip_tags()
    return r


def _connect(host: str, port: int, timeout: float, ssl_context: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(timeout)
    if ssl_context is not None:
        try:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    return sock


def _api_versions(sock: socket.socket) -> dict[int, tuple[int, int]]:
    r = _roundtrip(sock, API_VERSIONS, 0, b"", flexible=False)
    err = r.take(">h")
    out: dict[int, tuple[int, int]] = {}
    for _ in range(r.take(">i")):
        key, lo, hi = r.take(">hhh")
        out[key] = (lo, hi)
    if err and not out:
        raise ConnectionError(f"ApiVersions error code {err}")
    return out


def probe_api_versions(host: str, port: int, timeout: float = 3.0,
                       ssl_context: ssl.SSLContext | None = None) -> dict[int, tuple[int, int]]:
    """Send a real ApiVersions request; return {api_key: (min, max)}. Raises OSError on failure."""
    with _connect(host, port, timeout, ssl_context) as sock:
        return _api_versions(sock)


def probe_metadata(host: str, port: int, timeout: float = 3.0,
                   ssl_context: ssl.SSLContext | None = None) -> dict:
    """ApiVersions + a Metadata request for no topics on a PLAINTEXT (or TLS, no SASL) listener.

    Returns ``{"brokers": {node_id: (host, port)}, "cluster_id": str|None, "controller_id": int}``.
    Only unfenced (registered, caught-up) brokers are listed by a KRaft broker.
    """
    with _connect(host, port, timeout, ssl_context) as sock:
        versions = _api_versions(sock)
        lo, hi = versions.get(API_METADATA, (4, 8))
        if lo <= 8 and hi >= 4:
            v = min(hi, 8)
            body = struct.pack(">ib", 0, 0)  # topics: empty array, allow_auto_topic_creation=false
            if v >= 8:
                body += struct.pack(">bb", 0, 0)
            r = _roundtrip(sock, API_METADATA, v, body, flexible=False, corr=2)
            r.take(">i")  # throttle_time_ms
            brokers = {}
            for _ in range(r.take(">i")):
                node = r.take(">i")
                bhost = r.string()
                bport = r.take(">i")
                r.string()  # rack
                brokers[node] = (bhost, bport)
            cluster_id = r.string()
            controller = r.take(">i")
        else:
            v = min(hi, 12)
            body = _uvarint(1) + b"\x00"  # topics: empty compact array, allow_auto_topic_creation
            if v <= 10:
                body += b"\x00"  # include_cluster_authorized_operations
            body += b"\x00" + b"\x00"  # include_topic_authorized_operations, tagged fields
            r = _roundtrip(sock, API_METADATA, v, body, flexible=True, corr=2)
            r.take(">i")
            brokers = {}
            for _ in range(r.uvarint() - 1):
                node = r.take(">i")
                bhost = r.compact_string()
                bport = r.take(">i")
                r.compact_string()
                r.skip_tags()
                brokers[node] = (bhost, bport)
            cluster_id = r.compact_string()
            controller = r.take(">i")
        return {"brokers": brokers, "cluster_id": cluster_id, "controller_id": controller,
                "metadata_version": v}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _cluster_id(name: str) -> str:
    """A fixed, valid Kafka Uuid string (22 chars base64url) per cluster name."""
    salt = 0
    while True:
        raw = hashlib.sha256(f"alpamayo-local-kafka:{name}:{salt}".encode()).digest()[:16]
        cid = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if not cid.startswith("-") and raw != bytes(16):
            return cid
        salt += 1


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pid_alive(pid: int, must_contain: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
            if must_contain is not None:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if must_contain not in cmdline:
                    return False  # pid reused by something else
        except (OSError, IndexError):
            return False
    return True


def _tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            text = fh.read().decode(errors="replace")
    except OSError:
        return "(no log yet)"
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------------------------


class LocalKafka:
    """A named local KRaft cluster of ``nodes`` combined broker+controller JVMs on 127.0.0.1.

    Node ids are ``1..nodes`` and equal the broker ids that Kafka reports (e.g. partition leaders).
    """

    def __init__(self, name: str = "dev", nodes: int = 1, base_port: int | None = None,
                 security: str = "plaintext", users: dict[str, str] | None = None,
                 overrides: dict[str, object] | None = None, start_timeout: float = 120.0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"bad cluster name {name!r}")
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        if security not in SECURITY_MODES:
            raise ValueError(f"security must be one of {SECURITY_MODES}, not {security!r}")
        self.name = name
        self.nodes = nodes
        self.base_port = base_port
        self.security = security
        self.users = dict(users if users is not None else (DEFAULT_USERS if security == "sasl_ssl" else {}))
        self.overrides = {k: str(v) for k, v in (overrides or {}).items()}
        self.start_timeout = start_timeout
        self.state_dir = cache_root() / "kafka-run" / name
        self.cluster_id = _cluster_id(name)
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock_depth = 0
        self._lock_fh = None

    # ---- construction from persisted state (CLI) ------------------------------------------

    @classmethod
    def from_state(cls, name: str = "dev", **defaults) -> "LocalKafka":
        """A LocalKafka with the settings persisted by the last start of ``name`` (else defaults)."""
        path = cache_root() / "kafka-run" / name / "cluster.json"
        kw = dict(defaults)
        if path.exists():
            st = json.loads(path.read_text())
            for key in ("nodes", "security", "users", "overrides", "base_port"):
                if key in st and kw.get(key) is None:
                    kw[key] = st[key]
        kw = {k: v for k, v in kw.items() if v is not None}
        return cls(name=name, **kw)

    # ---- paths -----------------------------------------------------------------------------

    @property
    def ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))

    def node_dir(self, i: int) -> Path:
        return self.state_dir / f"node-{i}"

    def log_file(self, i: int) -> Path:
        return self.node_dir(i) / "kafka.log"

    def _pid_file(self, i: int) -> Path:
        return self.node_dir(i) / "kafka.pid"

    def _config_file(self, i: int) -> Path:
        return self.node_dir(i) / "server.properties"

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def ca_file(self) -> str | None:
        """PEM CA certificate that signs the broker certificate (sasl_ssl only)."""
        return str(self.tls_dir / "ca.pem") if self.security == "sasl_ssl" else None

    # ---- persisted state -------------------------------------------------------------------

    def _state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def _load_state(self) -> dict:
        try:
            return json.loads(self._state_file().read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self, st: dict) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")
        tmp.replace(self._state_file())

    def _signature(self) -> dict:
        return {
            "kafka_version": kafka_version(),
            "nodes": self.nodes,
            "security": self.security,
            "users": hashlib.sha256(json.dumps(self.users, sort_keys=True).encode()).hexdigest()[:16],
            "cluster_id": self.cluster_id,
        }

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive per-cluster lock across processes (re-entrant within this object)."""
        if self._lock_depth == 0:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fh = open(self.state_dir / ".lock", "a+")
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX)
        self._lock_depth += 1
        try:
            yield
        finally:
            self._lock_depth -= 1
            if self._lock_depth == 0 and self._lock_fh is not None:
                fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
                self._lock_fh.close()
                self._lock_fh = None

    # ---- ports -----------------------------------------------------------------------------

    def _ports(self) -> dict[int, dict[str, int]]:
        st = self._load_state()
        ports = st.get("ports")
        if not ports:
            raise LocalKafkaError(f"local Kafka {self.name!r} has never been started (no {self._state_file()})")
        return {int(k): v for k, v in ports.items()}

    def _choose_ports(self, running: bool) -> dict[int, dict[str, int]]:
        st = self._load_state()
        old = {int(k): v for k, v in (st.get("ports") or {}).items()}
        if self.base_port is not None:
            want = {
                i: {"client": self.base_port + 3 * (i - 1), "controller": self.base_port + 3 * (i - 1) + 1,
                    "internal": self.base_port + 3 * (i - 1) + 2}
                for i in self.ids
            }
            if not running:
                busy = [p for v in want.values() for p in v.values() if not _port_free(p)]
                if busy:
                    raise LocalKafkaError(f"ports {busy} (from base_port={self.base_port}) are in use")
            return want
        if old and sorted(old) == self.ids:
            if running or all(_port_free(p) for v in old.values() for p in v.values()):
                return old
        free = _free_ports(3 * self.nodes)
        return {i: {"client": free[3 * (i - 1)], "controller": free[3 * (i - 1) + 1],
                    "internal": free[3 * (i - 1) + 2]} for i in self.ids}

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT[,127.0.0.1:PORT...]`` of the client listener (PLAINTEXT or SASL_SSL)."""
        ports = self._ports()
        return ",".join(f"127.0.0.1:{ports[i]['client']}" for i in self.ids)

    @property
    def internal_bootstrap(self) -> str:
        """The unauthenticated loopback listener (PLAINTEXT inter-broker one under sasl_ssl)."""
        ports = self._ports()
        key = "internal" if self.security == "sasl_ssl" else "client"
        return ",".join(f"127.0.0.1:{ports[i][key]}" for i in self.ids)

    def client_config(self, user: str | None = None) -> dict:
        """Keyword arguments for aiokafka clients (bootstrap, security, SASL/SCRAM, TLS context)."""
        cfg: dict = {"bootstrap_servers": self.bootstrap}
        if self.security == "plaintext":
            cfg["security_protocol"] = "PLAINTEXT"
            return cfg
        if user is None:
            user = next(iter(self.users))
        cfg.update(
            security_protocol="SASL_SSL",
            sasl_mechanism=SCRAM_MECHANISM,
            sasl_plain_username=user,
            sasl_plain_password=self.users[user],
            ssl_context=self.ssl_context(),
        )
        return cfg

    def ssl_context(self) -> ssl.SSLContext:
        if self.security != "sasl_ssl":
            raise LocalKafkaError("ssl_context() is only for security='sasl_ssl'")
        return ssl.create_default_context(cafile=self.ca_file)

    # ---- config ----------------------------------------------------------------------------

    def _server_properties(self, i: int, ports: dict[int, dict[str, int]]) -> str:
        p = ports[i]
        n = self.nodes
        rf = min(3, n)
        isr = 2 if n >= 3 else 1
        voters = ",".join(f"{j}@127.0.0.1:{ports[j]['controller']}" for j in self.ids)
        conf: dict[str, str] = {
            "process.roles": "broker,controller",
            "node.id": str(i),
            "controller.quorum.voters": voters,
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(self.node_dir(i) / "data"),
            "num.partitions": "1",
            "default.replication.factor": str(rf),
            "min.insync.replicas": str(isr),
            "offsets.topic.replication.factor": str(rf),
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(isr),
            "transaction.state.log.num.partitions": "8",
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(isr),
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "delete.topic.enable": "true",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "num.recovery.threads.per.data.dir": "1",
            "log.segment.bytes": str(64 * 1024 * 1024),
            # a SIGKILLed node is declared dead (and leadership moves) within ~4 s, not 9 s
            "broker.heartbeat.interval.ms": "1000",
            "broker.session.timeout.ms": "4000",
            "controlled.shutdown.enable": "true",
        }
        if self.security == "plaintext":
            conf.update({
                "listeners": f"PLAINTEXT://127.0.0.1:{p['client']},CONTROLLER://127.0.0.1:{p['controller']}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{p['client']}",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "PLAINTEXT",
            })
        else:
            conf.update({
                "listeners": (f"SASL_SSL://127.0.0.1:{p['client']},INTERNAL://127.0.0.1:{p['internal']},"
                              f"CONTROLLER://127.0.0.1:{p['controller']}"),
                "advertised.listeners": f"SASL_SSL://127.0.0.1:{p['client']},INTERNAL://127.0.0.1:{p['internal']}",
                "listener.security.protocol.map": "SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "INTERNAL",
                "sasl.enabled.mechanisms": SCRAM_MECHANISM,
                "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": str(self.tls_dir / "broker-keystore.pem"),
                "ssl.client.auth": "none",
            })
        conf.update(self.overrides)
        head = f"# generated by deploy/local/cluster.py for local cluster {self.name!r}, node {i}; edits are overwritten\n"
        return head + "".join(f"{k}={v}\n" for k, v in conf.items())

    def _ensure_tls(self) -> None:
        d = self.tls_dir
        if (d / "broker-keystore.pem").exists() and (d / "ca.pem").exists():
            return
        openssl = shutil.which("openssl")
        if not openssl:
            raise LocalKafkaError("security='sasl_ssl' needs the openssl command to make a local CA")
        d.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            proc = subprocess.run([openssl, *args], cwd=d, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise LocalKafkaError(f"openssl {' '.join(args)} failed:\n{proc.stderr[-2000:]}")

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "3650",
            "-keyout", "ca.key", "-out", "ca.pem", "-subj", f"/CN=alpamayo-local-ca-{self.name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        run("req", "-newkey", "rsa:2048", "-nodes", "-sha256", "-keyout", "broker.key", "-out", "broker.csr",
            "-subj", "/CN=localhost")
        (d / "broker.ext").write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
        run("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-sha256", "-days", "3650", "-out", "broker.crt", "-extfile", "broker.ext")
        key = (d / "broker.key").read_text()
        if "BEGIN PRIVATE KEY" not in key:  # Kafka's PEM keystore wants PKCS#8
            run("pkcs8", "-topk8", "-nocrypt", "-in", "broker.key", "-out", "broker.pk8")
            key = (d / "broker.pk8").read_text()
        tmp = d / "broker-keystore.pem.tmp"
        tmp.write_text(key + (d / "broker.crt").read_text() + (d / "ca.pem").read_text())
        tmp.replace(d / "broker-keystore.pem")

    # ---- processes -------------------------------------------------------------------------

    def _pid(self, i: int) -> int | None:
        try:
            return int(self._pid_file(i).read_text().strip())
        except (OSError, ValueError):
            return None

    def node_alive(self, i: int) -> bool:
        proc = self._procs.get(i)
        if proc is not None:
            if proc.poll() is None:
                return True  # our child (its /proc cmdline may still be python's right after fork)
            self._procs.pop(i, None)
            return False
        pid = self._pid(i)
        return pid is not None and _pid_alive(pid, must_contain=str(self._config_file(i)))

    def _probe(self, i: int, ports: dict[int, dict[str, int]], expect: list[int], timeout: float = 2.0) -> str | None:
        """None when node i answers Metadata listing every broker in ``expect``; else why not."""
        key = "internal" if self.security == "sasl_ssl" else "client"
        try:
            md = probe_metadata("127.0.0.1", ports[i][key], timeout=timeout)
            if self.security == "sasl_ssl":
                probe_api_versions("127.0.0.1", ports[i]["client"], timeout=timeout, ssl_context=self.ssl_context())
        except (OSError, ssl.SSLError, struct.error, IndexError, UnicodeDecodeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        missing = sorted(set(expect) - set(md["brokers"]))
        if missing:
            return f"answers, but brokers {missing} are not registered yet (sees {sorted(md['brokers'])})"
        if md["cluster_id"] not in (None, self.cluster_id):
            return f"answers with cluster id {md['cluster_id']}, expected {self.cluster_id} (another cluster on this port?)"
        return None

    def _wait_ready(self, ids: list[int], expect: list[int], timeout: float) -> None:
        ports = self._ports()
        deadline = time.monotonic() + timeout
        why: dict[int, str | None] = {i: "not probed" for i in ids}
        while True:
            for i in ids:
                if why[i] is None:
                    continue
                if not self.node_alive(i):
                    raise LocalKafkaError(
                        f"local Kafka {self.name!r} node {i} exited during startup; log: {self.log_file(i)}\n"
                        f"--- last lines ---\n{_tail(self.log_file(i))}")
                why[i] = self._probe(i, ports, expect)
            if all(w is None for w in why.values()):
                return
            if time.monotonic() > deadline:
                details = "\n".join(
                    f"node {i}: {w}; log: {self.log_file(i)}\n--- last lines ---\n{_tail(self.log_file(i), 15)}"
                    for i, w in why.items() if w is not None)
                raise LocalKafkaError(
                    f"local Kafka {self.name!r} did not become ready within {timeout:.0f}s:\n{details}")
            time.sleep(0.25)

    def _format(self, ids: list[int], libs: Path) -> None:
        """Format the storage of the given nodes (in parallel), with SCRAM users if any."""
        procs = []
        for i in ids:
            data = self.node_dir(i) / "data"
            if (data / "meta.properties").exists():
                continue
            if data.exists():
                shutil.rmtree(data)
            cmd = [_java(), *TOOL_JVM_OPTS, f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                   "-cp", f"{libs}/*", STORAGE_TOOL_MAIN, "format", "--config", str(self._config_file(i)),
                   "--cluster-id", self.cluster_id, "--ignore-formatted"]
            for user, password in self.users.items():
                cmd += ["--add-scram", f"{SCRAM_MECHANISM}=[name={user},password={password}]"]
            out = open(self.node_dir(i) / "format.log", "w")
            procs.append((i, subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              cwd=self.node_dir(i)), out))
        errors = []
        for i, proc, out in procs:
            rc = proc.wait()
            out.close()
            if rc != 0:
                errors.append(f"node {i}: storage format exited {rc}; log: {self.node_dir(i) / 'format.log'}\n"
                              + _tail(self.node_dir(i) / "format.log"))
        if errors:
            raise LocalKafkaError("\n".join(errors))

    def _spawn(self, i: int, libs: Path) -> None:
        log = self.log_file(i)
        if log.exists() and log.stat().st_size > 0:
            log.replace(log.with_suffix(".log.1"))
        out = open(log, "ab")
        env = dict(os.environ)
        for var in ("KAFKA_OPTS", "KAFKA_HEAP_OPTS", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS"):
            env.pop(var, None)
        cmd = [_java(), *NODE_JVM_OPTS,
               f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
               f"-Dkafka.logs.dir={self.node_dir(i)}",
               "-cp", f"{libs}/*", KAFKA_MAIN, str(self._config_file(i))]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.node_dir(i), env=env, start_new_session=True, close_fds=True)
        finally:
            out.close()
        self._procs[i] = proc
        self._pid_file(i).write_text(f"{proc.pid}\n")

    def _prepare(self, running: bool, fresh: bool) -> Path:
        libs = ensure_jars()
        st = self._load_state()
        sig = self._signature()
        if st.get("signature") and st["signature"] != sig:
            if running:
                raise LocalKafkaError(
                    f"local Kafka {self.name!r} is running with {st['signature']}; asked for {sig}. "
                    f"Stop it first: python -m deploy.local.cluster stop --name {self.name}")
            fresh = True
        if fresh and not running:
            for i in range(1, max(self.nodes, int(st.get("nodes", 0))) + 1):
                shutil.rmtree(self.node_dir(i), ignore_errors=True)
            shutil.rmtree(self.tls_dir, ignore_errors=True)
        ports = self._choose_ports(running)
        self._save_state({"name": self.name, "signature": sig, "nodes": self.nodes, "security": self.security,
                          "users": self.users, "overrides": self.overrides, "base_port": self.base_port,
                          "ports": {str(k): v for k, v in ports.items()}, "cluster_id": self.cluster_id,
                          "kafka_version": sig["kafka_version"], "libs": str(libs)})
        (self.state_dir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
        if self.security == "sasl_ssl":
            self._ensure_tls()
        for i in self.ids:
            self.node_dir(i).mkdir(parents=True, exist_ok=True)
            if not running or not self.node_alive(i):
                self._config_file(i).write_text(self._server_properties(i, ports))
        return libs

    # ---- public API ------------------------------------------------------------------------

    def start(self, *, fresh: bool = False, timeout: float | None = None) -> str:
        """Start every node (or reuse a running, answering cluster); return the bootstrap string.

        ``fresh=True`` wipes data first when the cluster is not running. Raises LocalKafkaError
        (naming the log file) when a node exits or does not answer in time.
        """
        timeout = self.start_timeout if timeout is None else timeout
        with self._locked():
            alive = [i for i in self.ids if self.node_alive(i)]
            if alive and len(alive) == self.nodes and self._load_state().get("signature") == self._signature():
                ports = self._ports()
                if all(self._probe(i, ports, self.ids) is None for i in self.ids):
                    return self.bootstrap
            libs = self._prepare(running=bool(alive), fresh=fresh)
            dead = [i for i in self.ids if i not in alive]
            self._format(dead, libs)
            for i in dead:
                self._spawn(i, libs)
            try:
                self._wait_ready(self.ids, self.ids, timeout)
            except LocalKafkaError:
                self._stop_ids(dead, timeout=10)
                raise
            return self.bootstrap

    def is_running(self) -> bool:
        """Every node process is alive and answers a Metadata request listing all brokers."""
        if not self._state_file().exists():
            return False
        if not all(self.node_alive(i) for i in self.ids):
            return False
        try:
            ports = self._ports()
        except LocalKafkaError:
            return False
        return all(self._probe(i, ports, self.ids) is None for i in self.ids)

    def _stop_ids(self, ids: list[int], timeout: float) -> None:
        pids = {}
        for i in ids:
            pid = self._pid(i)
            if pid is not None and self.node_alive(i):
                pids[i] = pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            for i in list(pids):
                self._reap(i)
                if not self.node_alive(i):
                    pids.pop(i)
            if pids:
                time.sleep(0.1)
        for i, pid in pids.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for i in pids:
            self._wait_dead(i, 10)
        for i in ids:
            self._pid_file(i).unlink(missing_ok=True)
            self._procs.pop(i, None)

    def _reap(self, i: int) -> None:
        proc = self._procs.get(i)
        if proc is not None:
            proc.poll()

    def _wait_dead(self, i: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.node_alive(i) and time.monotonic() < deadline:
            self._reap(i)
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every node (controlled shutdown), SIGKILL whatever is left after ``timeout``."""
        with self._locked():
            st = self._load_state()
            n = max(self.nodes, int(st.get("nodes", 0) or 0))
            self._stop_ids(list(range(1, n + 1)), timeout)

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` (1..nodes, = broker id): no controlled shutdown, as in a crash."""
        self._check_id(i)
        with self._locked():
            pid = self._pid(i)
            if pid is None or not self.node_alive(i):
                return
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_dead(i, 10)
            self._pid_file(i).unlink(missing_ok=True)
            self._procs.pop(i, None)

    def stop_node(self, i: int, timeout: float = 30.0) -> None:
        """SIGTERM node ``i`` (controlled shutdown), SIGKILL after ``timeout``."""
        self._check_id(i)
        with self._locked():
            self._stop_ids([i], timeout)

    def start_node(self, i: int, timeout: float | None = None) -> None:
        """(Re)start node ``i`` and wait until it is registered and answering again."""
        self._check_id(i)
        timeout = self.start_timeout if timeout is None else timeout
        with self._locked():
            if self.node_alive(i):
                return
            libs = ensure_jars()
            ports = self._ports()
            self._config_file(i).write_text(self._server_properties(i, ports))
            self._format([i], libs)
            self._spawn(i, libs)
            self._wait_ready([i], [i], timeout)

    def _check_id(self, i: int) -> None:
        if i not in self.ids:
            raise ValueError(f"node id must be in 1..{self.nodes}, not {i}")

    def status(self) -> dict:
        st = self._load_state()
        out = {"name": self.name, "state_dir": str(self.state_dir), "nodes": self.nodes,
               "security": self.security, "kafka_version": st.get("kafka_version"), "nodes_status": {}}
        try:
            ports = self._ports()
            out["bootstrap"] = self.bootstrap
        except LocalKafkaError:
            ports = None
        for i in self.ids:
            alive = self.node_alive(i)
            ready = None
            if alive and ports:
                ready = self._probe(i, ports, [i]) or "ready"
            out["nodes_status"][i] = {"pid": self._pid(i), "alive": alive, "probe": ready,
                                      "log": str(self.log_file(i))}
        out["running"] = bool(ports) and all(v["alive"] and v["probe"] == "ready" for v in out["nodes_status"].values())
        if self.security == "sasl_ssl":
            out["ca_file"] = self.ca_file
            out["users"] = sorted(self.users)
        return out

    # ---- shared use by several processes (e.g. concurrent pytest sessions) ------------------

    def _lease_dir(self) -> Path:
        return self.state_dir / "leases"

    def acquire(self, timeout: float | None = None, fresh_if_stopped: bool = False) -> str:
        """start() plus a lease held by this process; release() stops only when no lease is left."""
        with self._locked():
            running = all(self.node_alive(i) for i in self.ids)
            bootstrap = self.start(fresh=fresh_if_stopped and not running, timeout=timeout)
            self._lease_dir().mkdir(parents=True, exist_ok=True)
            (self._lease_dir() / str(os.getpid())).write_text(f"{time.time()}\n")
            return bootstrap

    def release(self, timeout: float = 30.0) -> bool:
        """Drop this process's lease; stop the cluster when no live lease is left. True if stopped."""
        with self._locked():
            d = self._lease_dir()
            (d / str(os.getpid())).unlink(missing_ok=True)
            others = []
            for f in d.glob("*") if d.exists() else []:
                try:
                    pid = int(f.name)
                except ValueError:
                    continue
                if _pid_alive(pid):
                    others.append(pid)
                else:
                    f.unlink(missing_ok=True)
            if others:
                return False
            self.stop(timeout)
            return True


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.local.cluster",
                                 description="Run a local Apache Kafka (KRaft) from Maven Central jars.")
    ap.add_argument("command", choices=["start", "stop", "status", "kill-node", "start-node", "stop-node", "jars"])
    ap.add_argument("node", nargs="?", type=int, help="node id (1..nodes) for kill-node/start-node/stop-node")
    ap.add_argument("--name", default=os.environ.get("ALPAMAYO_KAFKA_NAME", "dev"))
    ap.add_argument("--nodes", type=int, default=None, help="default: as last started, else 1")
    ap.add_argument("--security", choices=SECURITY_MODES, default=None, help="default: as last started, else plaintext")
    ap.add_argument("--base-port", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="start: wipe data first (when not running)")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--json", action="store_true", help="status: print JSON")
    args = ap.parse_args(argv)

    try:
        if args.command == "jars":
            print(ensure_jars(quiet=False))
            return 0
        kafka = LocalKafka.from_state(args.name, nodes=args.nodes, security=args.security, base_port=args.base_port)
        if args.command == "start":
            t0 = time.monotonic()
            bootstrap = kafka.start(fresh=args.fresh, timeout=args.timeout)
            print(bootstrap)
            print(f"# local Kafka {kafka.name!r}: {kafka.nodes} node(s), {kafka.security}, ready in "
                  f"{time.monotonic() - t0:.1f}s; state {kafka.state_dir}", file=sys.stderr)
            if kafka.security == "sasl_ssl":
                print(f"# SCRAM users {sorted(kafka.users)} (mechanism {SCRAM_MECHANISM}); CA {kafka.ca_file}",
                      file=sys.stderr)
            return 0
        if args.command == "stop":
            kafka.stop(timeout=args.timeout or 30.0)
            print(f"stopped local Kafka {kafka.name!r}")
            return 0
        if args.command == "status":
            st = kafka.status()
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                print(f"{st['name']}: {'running' if st['running'] else 'not running'}"
                      f" ({st['nodes']} node(s), {st['security']}, Kafka {st['kafka_version']})")
                if st.get("bootstrap"):
                    print(f"bootstrap: {st['bootstrap']}")
                for i, ns in st["nodes_status"].items():
                    print(f"  node {i}: pid={ns['pid']} alive={ns['alive']} probe={ns['probe']} log={ns['log']}")
                if st.get("ca_file"):
                    print(f"ca_file: {st['ca_file']}  users: {', '.join(st['users'])}")
            return 0 if st["running"] else 3
        if args.node is None:
            ap.error(f"{args.command} needs a node id")
        if args.command == "kill-node":
            kafka.kill_node(args.node)
        elif args.command == "stop-node":
            kafka.stop_node(args.node)
        else:
            kafka.start_node(args.node, timeout=args.timeout)
        print(f"{args.command} {args.node}: done")
        return 0
    except LocalKafkaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `status | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
