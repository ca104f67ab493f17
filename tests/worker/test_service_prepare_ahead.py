"""The next batch's host work runs while the engine runs the current one (issue 17: image
preparation off the critical path), against a real Apache Kafka (the conftest's local broker).

In-process worker (tiny random checkpoint, CPU) whose real engine holds its first batch until
released and records which thread prepared each batch and whether a batch was running then.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import schemas as S
from worker.config import load_settings
from worker.engine import Engine
from worker.model.runtime import PreparedBatch
from worker.process import WorkerThread

from tests.worker.kafka_harness import (collect, free_port, produce, request_item, trajectory_requests, unique,
                                        worker_env)

pytestmark = pytest.mark.kafka


class HeldEngine(Engine):
    def __init__(self, settings):
        super().__init__(settings)
        self.release = threading.Event()
        self.running = threading.Event()
        self.prepared: list[tuple[list[str], bool, str]] = []   # (ids, a batch running meanwhile, thread)
        self.inferred: list[tuple[list[str], bool]] = []         # (ids, arrived prepared)

    def prepare_batch(self, batch):
        self.prepared.append(([s.request_id for s in batch], self.running.is_set(), threading.current_thread().name))
        return super().prepare_batch(batch)

    def infer(self, batch):
        ahead = isinstance(batch, PreparedBatch)
        ids = [s.request_id for s in (batch.requests if ahead else batch)]
        self.inferred.append((ids, ahead))
        self.running.set()
        try:
            if len(self.inferred) == 1:
                self.release.wait(120)
            return super().infer(batch)
        finally:
            self.running.clear()


async def test_the_next_full_batch_is_prepared_while_the_engine_runs_the_current_one(
        kafka_bootstrap, topic_factory, tiny, scene):
    ckpt, _ = tiny
    req_t, res_t, dl_t = [await topic_factory(1, prefix=p) for p in ("req", "res", "dl")]
    name = unique("ahead")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-{name}", name, free_port(), ckpt,
                     ALPAMAYO_MAX_BATCH_SIZE="2", ALPAMAYO_MAX_BATCH_WAIT_MS="5000")
    reqs = trajectory_requests(scene, 4, "ahead")
    ids = [r.request_id for r in reqs]
    settings = load_settings(env)
    engine = HeldEngine(settings)
    w = WorkerThread(settings, engine).start()
    assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
    try:
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs[:2]])
        deadline = time.monotonic() + 60
        while not engine.running.is_set():
            assert time.monotonic() < deadline, "the first batch never reached the engine"
            await asyncio.sleep(0.05)
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs[2:]])
        while not engine.prepared:
            assert time.monotonic() < deadline, "the second batch was not prepared while the first ran"
            await asyncio.sleep(0.05)
        assert w.service.waiting() == 2 and len(w.service.batcher) == 0    # picked ahead, still counted as waiting
        engine.release.set()
        out = await collect(kafka_bootstrap, res_t, dl_t, ids, partitions=1, timeout=120)
    finally:
        engine.release.set()
        code = w.stop()
    # (within a batch, jobs come in the order intake finished them)
    assert [(sorted(p_ids), running) for p_ids, running, _ in engine.prepared] == [(ids[2:], True)]
    assert engine.prepared[0][2].startswith("batch-prep")
    assert [(sorted(i_ids), ahead) for i_ids, ahead in engine.inferred] == [(ids[:2], False), (ids[2:], True)]
    assert all([type(m) for m in out.by_id[i]] == [S.InferResult] for i in ids)
    assert code == 0
