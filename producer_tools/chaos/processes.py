"""Processes of the chaos harness: the worker and the sink as supervised subprocesses, their
environment, RSS, free ports, and the tiny random checkpoint the worker serves."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from producer_tools.chaos.broker import Broker, Topics
from worker.config import cache_dir

log = logging.getLogger("alpamayo.chaos")

ROOT = Path(__file__).resolve().parents[2]
WORKER_INSTANCE = "chaos-w1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (``VmRSS`` of /proc/PID/status), None when gone."""
    return _proc_status(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``)."""
    return _proc_status(pid, "VmHWM")


def _mb(n: int | float | None) -> float | None:
    return None if n is None else round(n / (1 << 20), 1)


def _source_hash() -> str:
    h = hashlib.sha256()
    for rel in ("worker/demo/layout.py", "worker/model/checkpoint.py", "worker/model/config.py",
                "worker/model/modules.py"):
        p = ROOT / rel
        h.update(rel.encode())
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()[:12]


def tiny_checkpoint(cache: str | os.PathLike | None = None) -> Path:
    """A tiny random checkpoint of the real layout (``worker.demo.layout.write_random_checkpoint``),
    cached under ``$ALPAMAYO_CACHE/chaos/`` and keyed by the model sources that shape it."""
    base = Path(cache) if cache else cache_dir() / "chaos"
    ckpt = base / f"tiny-ckpt-{_source_hash()}"
    done = base / f"{ckpt.name}.complete"
    if done.exists() and ckpt.is_dir():
        return ckpt
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and ckpt.is_dir():
            return ckpt
        from worker.demo.layout import write_random_checkpoint  # torch: heavy, only when not cached yet

        tmp = base / f".{ckpt.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_checkpoint(tmp)
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)
        done.write_text(f"{time.time()}\n")
    return ckpt


class Managed:
    """A subprocess the harness starts, kills and restarts. With ``supervise`` on, an exit the
    harness did not cause is counted (``unplanned_exits``) and the process is started again after
    ``backoff`` seconds, as Kubernetes would restart a pod."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, *,
                 ready_url: Callable[[], str | None] | None = None, backoff: float = 1.0):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_dir = log_dir
        self.ready_url = ready_url
        self.backoff = backoff
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0
        self.unplanned_exits = 0
        self.exit_codes: list[int] = []
        self.supervise = False
        self._expect_exit = False
        self._task: asyncio.Task | None = None
        self._log = None
        self.rss_samples: list[tuple[float, int]] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    def log_path(self, n: int | None = None) -> Path:
        return self.log_dir / f"{self.name}-{self.starts if n is None else n}.log"

    def tail(self, n: int = 30) -> str:
        p = self.log_path()
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> None:
        self.starts += 1
        full = {**os.environ, **self.env}
        full["PYTHONPATH"] = str(ROOT) + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path(), "ab")
        self._expect_exit = False
        self.proc = subprocess.Popen(self.argv, env=full, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.info("%s: started pid %d (start #%d)", self.name, self.proc.pid, self.starts)
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def wait_ready(self, timeout: float = 300.0) -> None:
        if self.ready_url is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                if self.supervise:          # the watcher restarts it
                    await asyncio.sleep(0.2)
                    continue
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before ready:\n{self.tail()}")
            url = self.ready_url()
            try:
                ok = await asyncio.to_thread(_http_ok, url + "/v1/health/ready")
            except OSError:
                ok = False
            if ok:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    async def kill(self) -> None:
        """SIGKILL (a crash: no drain, no commit) and reap."""
        if not self.alive:
            return
        self._expect_exit = True
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait)
        self.kills += 1
        self.exit_codes.append(self.proc.returncode)
        log.info("%s: SIGKILLed (kill #%d)", self.name, self.kills)

    async def terminate(self, timeout: float = 120.0) -> int | None:
        """SIGTERM and wait for the exit code (SIGKILL after ``timeout``)."""
        self.supervise = False
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._expect_exit = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
            except TimeoutError:
                log.error("%s: no exit %.0fs after SIGTERM; killing it", self.name, timeout)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        self.exit_codes.append(self.proc.returncode)
        return self.proc.returncode

    async def close(self) -> None:
        self.supervise = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.alive:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self._log is not None:
            self._log.close()
            self._log = None

    def sample_rss(self) -> int | None:
        pid = self.pid
        v = rss_bytes(pid) if pid else None
        if v is not None:
            self.rss_samples.append((time.monotonic(), v))
        return v

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            p = self.proc
            if p is None or p.poll() is None or self._expect_exit:
                continue
            # an exit nobody asked for
            self._expect_exit = True
            self.unplanned_exits += 1
            self.exit_codes.append(p.returncode)
            log.warning("%s: exited by itself with code %s:\n%s", self.name, p.returncode, self.tail(12))
            if self.supervise:
                await asyncio.sleep(self.backoff)
                if self.supervise:
                    self.start()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _http_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.read().decode()
    except OSError:
        return None


def worker_env(broker: Broker, topics: Topics, *, checkpoint: Path, group: str, guarantee: str, port: int,
               reasoning_tokens: int = 4, batch_size: int = 4, device: str = "cpu",
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "NIM_FT_CHECKPOINT": str(checkpoint), "NIM_MODEL_PROFILE": "bf16", "NIM_PRECISION": "",
        "NIM_ALPAMAYO_SPECULATIVE_MODEL": "", "NIM_ALPAMAYO_TRAJ_SAMPLES": "1", "ALPAMAYO_DEVICE": device,
        "ALPAMAYO_REQUEST_TOPIC": topics.req, "ALPAMAYO_RESULT_TOPIC": topics.res,
        "ALPAMAYO_DEAD_LETTER_TOPIC": topics.dl, "ALPAMAYO_GROUP_ID": group,
        "ALPAMAYO_GROUP_INSTANCE_ID": WORKER_INSTANCE, "ALPAMAYO_PROCESSING_GUARANTEE": guarantee,
        "ALPAMAYO_HTTP_HOST": "127.0.0.1", "ALPAMAYO_HTTP_PORT": str(port),
        "ALPAMAYO_MAX_REASONING_TOKENS": str(reasoning_tokens), "ALPAMAYO_MAX_BATCH_SIZE": str(batch_size),
        "ALPAMAYO_MAX_BATCH_WAIT_MS": "20", "ALPAMAYO_DRAIN_TIMEOUT_S": "60", "ALPAMAYO_LOG_LEVEL": "INFO",
        "ALPAMAYO_CLAIM_CHECK_ROOTS": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    env.update(broker.env())
    env.update(extra or {})
    return env


def make_worker(broker: Broker, topics: Topics, work: Path, **kw) -> Managed:
    port = free_port()
    env = worker_env(broker, topics, port=port, **kw)
    w = Managed("worker", [sys.executable, "-m", "worker", "serve"], env, work,
                ready_url=lambda: f"http://127.0.0.1:{env['ALPAMAYO_HTTP_PORT']}")

    orig_start = w.start

    def start() -> None:           # a fresh side port per start: no TIME_WAIT surprises
        env["ALPAMAYO_HTTP_PORT"] = str(free_port())
        orig_start()

    w.start = start                # type: ignore[method-assign]
    return w


def make_sink(broker: Broker, topics: Topics, work: Path, lake: Path, group: str) -> Managed:
    argv = [sys.executable, "-m", "producer_tools", "sink", "--lake", str(lake), "--group-id", group,
            "--rotate-seconds", "1", "--session-timeout-ms", "6000", "--no-progress",
            "--bootstrap-servers", broker.bootstrap, "--result-topic", topics.res,
            "--dead-letter-topic", topics.dl]
    env = {**broker.env(), "OMP_NUM_THREADS": "1"}
    return Managed("sink", argv, env, work)
