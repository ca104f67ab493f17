"""The serving path: `alpamayo-worker serve` imports no training, benchmark, chaos, demo-building
or producer-tool code; startup refusals are recognised by their base class."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

from worker.config import ConfigError, Settings
from worker.dflash.head import HeadError
from worker.errors import Refusal
from worker.model.config import CheckpointError
import worker.service as service_module
from worker.service import EXIT_FAILED, EXIT_REFUSED, WorkerService

from tests import REPO_ROOT


# what `alpamayo-worker serve` imports before it loads a model: the CLI, the process entry, the
# service (Kafka clients, intake, publisher) and the engine with everything it loads and warms
SERVE_MODULES = ("worker.cli", "worker.process", "worker.service", "worker.kafka_clients", "worker.engine",
                 "worker.demo_cache", "worker.model.runtime", "worker.dflash.loop")


def test_serve_path_imports_no_training_benchmark_chaos_or_tool_code():
    code = (f"import importlib, json, sys\nfor m in {SERVE_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout)
    assert set(SERVE_MODULES) <= set(loaded)
    ours = [m for m in loaded if m.split(".")[0] in ("worker", "schemas", "producer_tools", "deploy")]
    bad = [m for m in ours if any(w in m for w in ("train", "bench", "chaos")) or m == "worker.demo.build"
           or m.startswith(("producer_tools", "deploy"))]
    assert not bad, f"the serving path imports {bad}"


def test_refusals_share_one_base_class():
    for cls in (ConfigError, CheckpointError, HeadError):
        assert issubclass(cls, Refusal), cls
    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, ValueError)


class _Engine:
    """The parts of worker.engine.Engine the service touches before the model is loaded."""

    def models_payload(self) -> dict:
        return {"object": "list", "data": []}


def _serve_with_loader(loader, monkeypatch) -> int:
    # no broker: the preflight is passed over here (tests/worker/test_kafka_clients.py tests it)
    async def reachable(settings):
        return None
    monkeypatch.setattr(service_module, "kafka_preflight", reachable)
    settings = Settings(bootstrap_servers="127.0.0.1:1", http_host="127.0.0.1", http_port=0, worker_id="t")
    service = WorkerService(settings, _Engine(), engine_loader=loader, install_signal_handlers=False)
    return asyncio.run(service.run())


def test_unreachable_kafka_refuses_before_the_model_loads(capfd):
    """A closed port: exit 2 within the wait, one line naming ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS,
    and the engine loader never ran."""
    loaded = []
    settings = Settings(bootstrap_servers="127.0.0.1:1", http_host="127.0.0.1", http_port=0, worker_id="t",
                        kafka_wait_s=1.0)
    service = WorkerService(settings, _Engine(), engine_loader=lambda e, s: loaded.append(1),
                            install_signal_handlers=False)
    t0 = time.monotonic()
    assert asyncio.run(service.run()) == EXIT_REFUSED
    assert time.monotonic() - t0 < 15 and loaded == []
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS" in last and "127.0.0.1:1" in last


def test_a_refusal_of_any_subclass_exits_2_and_other_load_failures_exit_1(capfd, monkeypatch):
    class LicenceRefused(Refusal):
        pass

    def refuse(engine, settings):
        raise LicenceRefused("the licence file is missing: set LICENCE\nsecond line")

    def crash(engine, settings):
        raise RuntimeError("out of memory")

    assert _serve_with_loader(refuse, monkeypatch) == EXIT_REFUSED
    assert capfd.readouterr().err.strip().splitlines() == ["the licence file is missing: set LICENCE"]
    assert _serve_with_loader(crash, monkeypatch) == EXIT_FAILED


def test_a_side_port_in_use_refuses_in_one_line(capfd):
    """A second worker on the same ALPAMAYO_HTTP_PORT: exit 2 at once, one line naming the variable."""
    loaded = []
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        settings = Settings(bootstrap_servers="127.0.0.1:1", http_host="127.0.0.1", http_port=port, worker_id="t")
        service = WorkerService(settings, _Engine(), engine_loader=lambda e, s: loaded.append(1),
                                install_signal_handlers=False)
        t0 = time.monotonic()
        assert asyncio.run(asyncio.wait_for(service.run(), 15)) == EXIT_REFUSED
    assert time.monotonic() - t0 < 15 and loaded == []
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ALPAMAYO_HTTP_PORT" in err[0] and str(port) in err[0], err


def test_a_drained_serve_exits_without_extension_leak_reports():
    """`serve` freezes the loaded objects out of the garbage collector's reach (`load_and_freeze`);
    after a drained shutdown it unfreezes them, so the interpreter's exit collects them and Triton's
    nanobind bindings print nothing (a frozen process printed ~30 "nanobind: leaked ..." lines
    after every `make demo`)."""
    import pytest

    pytest.importorskip("triton")
    code = ("import gc, sys\nimport worker.model.stream_gemm\nimport worker.process as p\n"
            "class Service:\n    engine_busy = False\n    def __init__(self, *a, **k): pass\n"
            "    async def run(self):\n        gc.collect(); gc.freeze(); return 0\n"
            "p.WorkerService = Service\nsys.exit(p.serve(None))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[:500]
