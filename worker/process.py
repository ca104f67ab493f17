"""Running the worker: as the ``alpamayo-worker serve`` process (:func:`serve`), on a thread of
this process (:class:`WorkerThread`), or as a child process (:func:`spawn_worker` +
:func:`wait_ready`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import uvloop

from worker.config import Settings
from worker.service import EXIT_FAILED, WorkerService, load_engine

__all__ = ["serve", "WorkerThread", "spawn_worker", "wait_ready"]


def _return_large_buffers_to_the_os() -> None:
    """glibc raises its mmap threshold to the size of every large block freed, after which
    decoding a 1920x1080 frame (a 25 MB float copy, freed at once) is served from the heap, and
    small long-lived allocations above those holes keep them mapped: 96 such frames left the
    process 2.2 GB larger. A fixed 1 MiB threshold (M_MMAP_THRESHOLD = -3) keeps every large
    buffer in its own mapping, unmapped on free. No-op where libc is not glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 1 << 20)
    except (OSError, AttributeError):
        pass


def load_and_freeze(engine, settings: Settings) -> None:
    """`load_engine`, then the loaded process's objects moved out of the cyclic garbage
    collector's reach (`gc.freeze`, as vLLM and SGLang do after loading): the model, its graphs
    and everything imported are never garbage, and every full collection walked them all again,
    holding the interpreter lock meanwhile (on this 2-core machine, a worker serving through Kafka
    spent 8% of its time in such collections on its event-loop thread, stalling the engine thread's
    host work). Only for a process that serves: frozen objects are never collected, so a test
    process loading engine after engine would keep every cycle they leave."""
    load_engine(engine, settings)
    gc.collect()
    gc.freeze()
    logging.getLogger("alpamayo.worker").info("objects frozen for the garbage collector: %d", gc.get_freeze_count())


def serve(settings: Settings) -> int:
    """The ``alpamayo-worker serve`` process body on uvloop."""
    _return_large_buffers_to_the_os()
    service = WorkerService(settings, engine_loader=load_and_freeze)
    code = uvloop.run(service.run())
    if service.engine_busy:     # a drain timeout left the engine thread running: do not wait for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # frozen objects are never collected, so at exit extension modules find instances still alive
    # (Triton's nanobind bindings printed ~30 "leaked" lines after every drained shutdown)
    gc.unfreeze()
    return code


class WorkerThread:
    """The worker on its own event loop in a background thread (in-process use: demo, tests)::

        w = WorkerThread(settings).start(); w.wait_ready(120); ...; code = w.stop()
    """

    def __init__(self, settings: Settings, engine=None, engine_loader=load_engine):
        self.settings = settings
        self.engine = engine
        self.engine_loader = engine_loader
        self.service: WorkerService | None = None
        self.exit_code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="alpamayo-worker", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "WorkerThread":
        self._thread.start()
        return self

    def _main(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self.service = WorkerService(self.settings, self.engine, engine_loader=self.engine_loader,
                                         install_signal_handlers=False, on_ready=lambda _s: self._ready.set())
            return await self.service.run()

        try:
            self.exit_code = uvloop.run(main())
        except BaseException as exc:  # surfaced by wait_ready/stop
            self.error = exc
            self.exit_code = EXIT_FAILED
        finally:
            self._ready.set()

    @property
    def port(self) -> int | None:
        return self.service.port if self.service else None

    def wait_ready(self, timeout: float = 300.0) -> bool:
        """True once ready; False when the worker ended (see exit_code/error) or on timeout."""
        self._ready.wait(timeout)
        return self._ready.is_set() and self.exit_code is None

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM-equivalent: drain and wait for the exit code."""
        if self._loop is not None and self.service is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.service.request_stop)
        self._thread.join(timeout if timeout is not None else self.settings.drain_timeout_s + 30)
        return self.exit_code


def spawn_worker(env: dict[str, str], *, python: str | None = None, cwd: str | os.PathLike | None = None,
                 stdout=None, stderr=None) -> subprocess.Popen:
    """Start ``python -m worker serve`` with ``env`` (merged over os.environ)."""
    root = Path(__file__).resolve().parents[1]
    full = {**os.environ, **env}
    full["PYTHONPATH"] = str(root) + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    return subprocess.Popen([python or sys.executable, "-m", "worker", "serve"], env=full, cwd=cwd or root,
                            stdout=stdout, stderr=stderr)


def stop_worker(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM (the worker drains and exits); SIGKILL after `timeout` seconds. -> exit code."""
    proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def wait_ready(url: str, timeout: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``{url}/v1/health/ready`` until 200. Raises TimeoutError, or RuntimeError if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worker exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/health/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"worker at {url} not ready after {timeout:.0f}s")
