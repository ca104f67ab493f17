"""A named local Apache Kafka (KRaft) cluster on loopback: start, stop, kill and restart nodes.

Every node is a combined broker+controller JVM (``kafka.Kafka server.properties``) with a static
controller quorum (``controller.quorum.voters``), run from the jars of :mod:`deploy.local.jars`.
The state of a named cluster (config, data, logs, pid files, TLS material) lives in::

    ${ALPAMAYO_CACHE:-~/.cache/alpamayo-worker}/kafka-run/<name>/

Import it as ``from deploy.local.cluster import LocalKafka`` (see that module for the CLI).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import ssl
import struct
import subprocess
import time
from pathlib import Path
from typing import Iterator

from deploy.local.errors import LocalKafkaError
from deploy.local.host import free_ports, log_tail, pid_alive, port_free
from deploy.local.jars import cache_root, ensure_jars, java_executable, kafka_version
from deploy.local.node_config import (LOG4J2_PROPERTIES, SCRAM_MECHANISM, SECURITY_MODES, ensure_tls,
                                      server_properties)
from deploy.local.probe import probe_api_versions, probe_metadata

KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"

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


def _cluster_id(name: str) -> str:
    """A fixed, valid Kafka Uuid string (22 chars base64url) per cluster name."""
    salt = 0
    while True:
        raw = hashlib.sha256(f"alpamayo-local-kafka:{name}:{salt}".encode()).digest()[:16]
        cid = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if not cid.startswith("-") and raw != bytes(16):
            return cid
        salt += 1


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
                busy = [p for v in want.values() for p in v.values() if not port_free(p)]
                if busy:
                    raise LocalKafkaError(f"ports {busy} (from base_port={self.base_port}) are in use")
            return want
        if old and sorted(old) == self.ids:
            if running or all(port_free(p) for v in old.values() for p in v.values()):
                return old
        free = free_ports(3 * self.nodes)
        return {i: {"client": free[3 * (i - 1)], "controller": free[3 * (i - 1) + 1],
                    "internal": free[3 * (i - 1) + 2]} for i in self.ids}

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT[,127.0.0.1:PORT...]`` of the client listener (PLAINTEXT or SASL_SSL)."""
        ports = self._ports()
        return ",".join(f"127.0.0.1:{ports[i]['client']}" for i in self.ids)

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

    # ---- config (deploy.local.node_config) -------------------------------------------------

    def _write_config(self, i: int, ports: dict[int, dict[str, int]]) -> None:
        self._config_file(i).write_text(server_properties(
            i, ports, ids=self.ids, data_dir=self.node_dir(i) / "data", security=self.security,
            tls_dir=self.tls_dir, overrides=self.overrides, cluster_name=self.name))

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
        return pid is not None and pid_alive(pid, must_contain=str(self._config_file(i)))

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
                        f"--- last lines ---\n{log_tail(self.log_file(i))}")
                why[i] = self._probe(i, ports, expect)
            if all(w is None for w in why.values()):
                return
            if time.monotonic() > deadline:
                details = "\n".join(
                    f"node {i}: {w}; log: {self.log_file(i)}\n--- last lines ---\n{log_tail(self.log_file(i), 15)}"
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
            cmd = [java_executable(), *TOOL_JVM_OPTS, f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
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
                              + log_tail(self.node_dir(i) / "format.log"))
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
        cmd = [java_executable(), *NODE_JVM_OPTS,
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
            ensure_tls(self.tls_dir, self.name)
        for i in self.ids:
            self.node_dir(i).mkdir(parents=True, exist_ok=True)
            if not running or not self.node_alive(i):
                self._write_config(i, ports)
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
            self._write_config(i, ports)
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
                if pid_alive(pid):
                    others.append(pid)
                else:
                    f.unlink(missing_ok=True)
            if others:
                return False
            self.stop(timeout)
            return True
