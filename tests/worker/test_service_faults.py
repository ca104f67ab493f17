"""The worker around faulty parts, against a real Apache Kafka (the conftest's local broker).

In-process workers (:class:`worker.process.WorkerThread`, tiny random checkpoint, CPU) whose real
engine has the faults a GPU has (:class:`FaultyEngine`): a batch that raises, a batch that takes
longer than anyone waits; and whose real consumer meets a commit refused (``CommitFailedError``,
as during a rebalance) and a stop landing while a fetch returns.

* an engine failure becomes an ``inference_failed`` dead letter of the failing scene only; its
  batch-mate is answered and the worker keeps serving;
* backpressure: with ``ALPAMAYO_MAX_INFLIGHT`` records fetched and unfinished the partitions are
  paused (nothing more is fetched), and resumed when the engine frees a slot;
* a drain that times out with the engine busy exits 0 in time, commits up to the busy record
  only, never publishes the busy batch's late output, and the restarted worker answers the rest;
* at_least_once: an offset commit that fails is retried on a timer while the worker is idle (no
  further output arrives to carry it): the group's committed offset catches up within seconds;
* a stop requested while a fetch returns (the fetch loop ends in the same turn as the stop) is a
  drain, exit 0, not a fatal "task fetch ended" (the race fixed in 1bdfe70).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from aiokafka.errors import CommitFailedError

import schemas as S
from worker.config import load_settings
from worker.engine import Engine
from worker.process import WorkerThread
from worker.publisher import COMMIT_RETRY_S
from worker.service import longest_stop_s

from tests.worker.kafka_harness import (collect, committed_offsets, free_port, produce, request_item,
                                        trajectory_requests, unique, worker_env)

pytestmark = pytest.mark.kafka

CUDA_ERROR = "CUDA error: an illegal memory access was encountered"


class FaultyEngine(Engine):
    """The real engine; a batch holding a scene of ``fail`` raises (as a CUDA error would), a batch
    holding a scene of ``hold`` blocks until ``release`` is set. ``calls``: each batch's request ids."""

    def __init__(self, settings, fail=(), hold=()):
        super().__init__(settings)
        self.fail, self.hold = set(fail), set(hold)
        self.release = threading.Event()
        self.calls: list[list[str]] = []

    def infer(self, batch):
        ids = [s.request_id for s in getattr(batch, "requests", batch)]     # a batch prepared ahead, or scenes
        self.calls.append(ids)
        if self.hold & set(ids):
            self.release.wait(120)
        if self.fail & set(ids):
            raise RuntimeError(CUDA_ERROR)
        return super().infer(batch)


async def start(env: dict, **faults) -> tuple[WorkerThread, FaultyEngine]:
    settings = load_settings(env)
    engine = FaultyEngine(settings, **faults)
    w = WorkerThread(settings, engine).start()
    assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
    return w, engine


async def topics(topic_factory, partitions=1) -> tuple[str, str, str]:
    return tuple([await topic_factory(partitions, prefix=p) for p in ("req", "res", "dl")])


async def test_an_engine_failure_is_an_inference_failed_dead_letter_of_that_scene_only(
        kafka_bootstrap, topic_factory, tiny, scene):
    ckpt, _ = tiny
    req_t, res_t, dl_t = await topics(topic_factory)
    name = unique("fail")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-{name}", name, free_port(), ckpt,
                     ALPAMAYO_MAX_BATCH_WAIT_MS="1000")
    boom, mate, after = trajectory_requests(scene, 3, "fail")
    w, engine = await start(env, fail={boom.request_id})
    try:
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in (boom, mate)])
        out = await collect(kafka_bootstrap, res_t, dl_t, [boom.request_id, mate.request_id], partitions=1,
                            timeout=120)
        await produce(kafka_bootstrap, req_t, [request_item(after)])           # the worker still serves
        out = await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in (boom, mate, after)],
                            partitions=1, timeout=120, settle=0.5)
    finally:
        code = w.stop()
    assert sorted(engine.calls[0]) == [boom.request_id, mate.request_id], "the two requests shared one batch"
    (dl,) = out.by_id[boom.request_id]
    assert isinstance(dl, S.DeadLetter)
    assert (dl.error_code, dl.error_field, dl.retryable) == (S.ErrorCode.INFERENCE_FAILED, "$", True)
    assert CUDA_ERROR in dl.error_message and dl.source.offset == 0 and dl.original_value
    assert [type(m) for m in out.by_id[mate.request_id]] == [S.InferResult]
    assert [type(m) for m in out.by_id[after.request_id]] == [S.InferResult]
    assert code == 0


async def test_max_inflight_pauses_fetching_until_the_engine_frees_a_slot(kafka_bootstrap, topic_factory, tiny, scene):
    """MAX_INFLIGHT=2, batches of one, the first batch held on the engine: one record on the engine,
    one queued, the other four not fetched; released, every record is answered (resumed)."""
    ckpt, _ = tiny
    req_t, res_t, dl_t = await topics(topic_factory)
    name = unique("inflight")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-{name}", name, free_port(), ckpt,
                     ALPAMAYO_MAX_INFLIGHT="2", ALPAMAYO_MAX_BATCH_SIZE="1")
    reqs = trajectory_requests(scene, 6, "inflight")
    w, engine = await start(env, hold={r.request_id for r in reqs})     # the first batch blocks
    try:
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs])
        svc = w.service
        deadline = time.monotonic() + 60
        while not (engine.calls and svc.tracker.inflight >= 2 and svc.waiting() >= 1):
            assert time.monotonic() < deadline, "the first request never reached the engine"
            await asyncio.sleep(0.05)
        seen = []
        for _ in range(30):                    # 1.5 s of fetch loops while the engine is held
            seen.append((svc.tracker.inflight, svc.waiting()))
            await asyncio.sleep(0.05)
        assert set(seen) == {(2, 1)}, f"fetched past ALPAMAYO_MAX_INFLIGHT: (in flight, queued) = {set(seen)}"
        assert svc.consumer.paused(), "the partition was not paused"
        engine.release.set()
        out = await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in reqs], partitions=1, timeout=120)
    finally:
        engine.release.set()
        code = w.stop()
    assert {i: len(v) for i, v in out.by_id.items()} == {r.request_id: 1 for r in reqs}
    assert sorted(engine.calls) == [[r.request_id] for r in reqs]
    assert code == 0


async def test_a_drain_timeout_with_the_engine_busy_commits_only_finished_work_and_exits_0(
        kafka_bootstrap, topic_factory, tiny, scene):
    """Drain timeout 2 s while the engine holds one of d-1..d-3 (the other two queued behind it): the
    worker exits 0 well within the pod's grace, offset 1 is committed (d-0 done; d-1..d-3 not), the
    held batch's late output is never published, and a restarted worker answers d-1..d-3 once
    each (d-0 not again)."""
    ckpt, _ = tiny
    req_t, res_t, dl_t = await topics(topic_factory)
    name, group = unique("drain"), unique("g-drain")
    drain_s = 2.0
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, group, name, free_port(), ckpt,
                     ALPAMAYO_MAX_BATCH_SIZE="1", ALPAMAYO_DRAIN_TIMEOUT_S=str(drain_s))
    reqs = trajectory_requests(scene, 4, "drain")
    ids = [r.request_id for r in reqs]
    w, engine = await start(env, hold=set(ids[1:]))
    try:
        await produce(kafka_bootstrap, req_t, [request_item(reqs[0])])
        await collect(kafka_bootstrap, res_t, dl_t, ids[:1], partitions=1, timeout=120)
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs[1:]])
        deadline = time.monotonic() + 60
        while len(engine.calls) < 2 or w.service.tracker.inflight != 3:
            assert time.monotonic() < deadline, f"no batch held on the engine: {engine.calls}"
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        code = await asyncio.to_thread(w.stop, longest_stop_s(drain_s))
        stop_s = time.monotonic() - t0
        print(f"stopped in {stop_s:.1f} s with the engine busy (drain timeout {drain_s:.0f} s)")
        assert code == 0 and stop_s < longest_stop_s(drain_s), (code, stop_s)
        assert stop_s >= drain_s                                   # it did wait for the engine
        assert await committed_offsets(kafka_bootstrap, group, req_t, [0]) == {0: 1}
        engine.release.set()                                       # the held batch finishes after the exit
        await asyncio.sleep(1.0)
        out = await collect(kafka_bootstrap, res_t, dl_t, ids[:1], partitions=1, timeout=10, settle=0.5,
                            isolation="read_uncommitted")
        assert set(out.by_id) == {ids[0]}, "output of work unfinished at the drain timeout was published"
    finally:
        engine.release.set()
        w.stop(5)
    again, _ = await start(env)
    try:
        out = await collect(kafka_bootstrap, res_t, dl_t, ids, partitions=1, timeout=120, settle=1.0)
    finally:
        assert again.stop() == 0
    assert {i: len(v) for i, v in out.by_id.items()} == {i: 1 for i in ids}
    assert await committed_offsets(kafka_bootstrap, group, req_t, [0]) == {0: 4}


async def test_a_failed_commit_is_retried_while_the_worker_is_idle(kafka_bootstrap, topic_factory, tiny, scene):
    """The broker refuses the first two offset commits (CommitFailedError through the real client's
    commit); no request arrives after the three answered: the retry timer alone commits offset 3."""
    ckpt, _ = tiny
    req_t, res_t, dl_t = await topics(topic_factory)
    name, group = unique("commit"), unique("g-commit")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, group, name, free_port(), ckpt)
    reqs = trajectory_requests(scene, 3, "commit")
    w, _ = await start(env)
    consumer = w.service.consumer
    real_commit, refused = consumer.commit, []

    async def refuse_twice(offsets=None):
        if len(refused) < 2:
            refused.append(offsets)
            raise CommitFailedError()
        return await real_commit(offsets)

    consumer.commit = refuse_twice
    try:
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs])
        await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in reqs], partitions=1, timeout=120)
        deadline = time.monotonic() + 10 * COMMIT_RETRY_S + 10
        while (committed := await committed_offsets(kafka_bootstrap, group, req_t, [0])) != {0: 3}:
            assert time.monotonic() < deadline, f"committed {committed} while idle after {len(refused)} refusals"
            await asyncio.sleep(0.2)
        assert len(refused) == 2 and w.service.publisher.commit_failures == 2
    finally:
        assert w.stop() == 0


async def test_a_stop_landing_while_a_fetch_returns_is_a_drain_not_a_failure(
        kafka_bootstrap, topic_factory, tiny, scene, caplog):
    caplog.set_level(logging.INFO, logger="alpamayo.worker")
    ckpt, _ = tiny
    req_t, res_t, dl_t = await topics(topic_factory)
    name = unique("stop")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-{name}", name, free_port(), ckpt)
    w, _ = await start(env)
    service, consumer = w.service, w.service.consumer
    real_getmany = consumer.getmany

    async def getmany_then_stop(*a, **kw):     # the fetch loop sees the stop as soon as getmany returns
        data = await real_getmany(*a, **kw)
        service.request_stop()
        return data

    consumer.getmany = getmany_then_stop
    deadline = time.monotonic() + 60
    while w.exit_code is None:
        assert time.monotonic() < deadline, "the stop requested during a fetch never ended the worker"
        await asyncio.sleep(0.1)
    assert w.exit_code == 0, "a stop during a fetch ended the worker as a failure"
    assert "drained: every fetched record published and committed" in caplog.text
