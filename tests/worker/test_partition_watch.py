"""The partition watch (worker.partition_watch) repairs a partition the worker silently stopped
serving, against a real Apache Kafka (the conftest's local broker), in-process workers:

* a lost commit: exactly_once, the partition's last transaction is aborted while the worker is
  told it committed (as a broker that did not keep a transaction would). The worker believes the
  request done; the watch finds the group's committed offset below its own, re-opens the
  partition and answers it: each request exactly once, every offset committed;
* a stalled fetch: the consumer stops fetching a partition behind the worker's back (paused
  outside its flow control); the watch finds the position below the partition's end with nothing
  pending, re-opens the partition and the requests are answered;
* a failed transaction: exactly_once, the partition's transaction fails on a closed connection
  (aiokafka's sender gives up on one under a coordinator lookup); the worker re-opens the
  partition instead of exiting, and answers the request exactly once.

And without a broker: a partition whose transactions keep failing is re-opened at most
REOPEN_LIMIT times in REOPEN_WINDOW_S, then left to stop the worker.

Each of the three fails on the code before the watch: the requests are never answered (the
third: the worker exits).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

import schemas as S
import worker.partition_watch as watch
from worker.config import load_settings
from worker.metrics import WorkerMetrics
from worker.process import WorkerThread

from tests.worker.kafka_harness import (collect, committed_offsets, free_port, produce, request_item,
                                        trajectory_requests, unique, worker_env)

pytestmark = pytest.mark.kafka


async def started(env) -> WorkerThread:
    w = WorkerThread(load_settings(env)).start()
    assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
    deadline = time.monotonic() + 60
    while not w.service.tracker.assigned:
        assert time.monotonic() < deadline, "no partition assigned"
        await asyncio.sleep(0.1)
    return w


def repairs(w: WorkerThread, kind: str) -> float:
    return w.service.metrics.partition_repairs.labels(kind=kind)._value.get()


@pytest.mark.parametrize("fault", ["lost commit", "stalled fetch", "failed transaction"])
async def test_the_watch_reopens_a_partition_the_worker_stopped_serving(kafka_bootstrap, topic_factory, tiny, scene,
                                                                       monkeypatch, fault):
    monkeypatch.setattr(watch, "AUDIT_INTERVAL_S", 1.0)
    ckpt, _ = tiny
    req_t, res_t, dl_t = [await topic_factory(1, prefix=p) for p in ("req", "res", "dl")]
    name = unique("watch")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-{name}", name, free_port(), ckpt,
                     ALPAMAYO_PROCESSING_GUARANTEE="exactly_once")
    reqs = trajectory_requests(scene, 3, name)
    w = await started(env)
    svc, tp = w.service, TopicPartition(req_t, 0)
    try:
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs[:2]])
        await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in reqs[:2]], partitions=1, timeout=90)
        if fault == "lost commit":       # the partition's last transaction: no later one commits past it
            producer = svc.producer.for_partition((req_t, 0))
            commit = producer.commit_transaction

            async def aborted_but_reported_committed():
                producer.commit_transaction = commit
                await producer.abort_transaction()

            producer.commit_transaction = aborted_but_reported_committed
        elif fault == "stalled fetch":
            w._loop.call_soon_threadsafe(svc.consumer.pause, tp)
        else:                            # the broker connection drops under the transaction
            producer = svc.producer.for_partition((req_t, 0))

            async def connection_closed(*a, **kw):
                raise KafkaConnectionError("Connection at 127.0.0.1:9092 closed")

            producer.send_offsets_to_transaction = connection_closed
        await produce(kafka_bootstrap, req_t, [request_item(reqs[2])])
        out = await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in reqs], partitions=1, timeout=90,
                            settle=1.0)
    finally:
        code = w.stop()
    assert {i: [type(m) for m in out.by_id[i]] for i in out.by_id} == {r.request_id: [S.InferResult] for r in reqs}
    assert repairs(w, fault.replace(" ", "_")) >= 1
    assert await committed_offsets(kafka_bootstrap, f"g-{name}", req_t, [0]) == {0: 3}
    assert code == 0


async def test_a_partition_whose_transactions_keep_failing_is_not_reopened_again():
    """At most REOPEN_LIMIT re-opens of one partition in REOPEN_WINDOW_S; the next failure is the
    worker's end (the publisher raises PublishError). Other partitions keep their own count."""
    reopened = []

    async def reopen(tps):
        reopened.append([(tp.topic, tp.partition) for tp in tps])

    metrics = WorkerMetrics(spec_counters=False)
    w = watch.PartitionWatch(None, None, metrics, paused=lambda: False, reopen=reopen)
    error = KafkaConnectionError("Connection at 127.0.0.1:9092 closed")
    assert [w.broken(("req", 0), error) for _ in range(watch.REOPEN_LIMIT + 1)] == [True] * watch.REOPEN_LIMIT + [False]
    assert w.broken(("req", 1), error) is True
    await asyncio.sleep(0.01)
    assert reopened == [[("req", 0)]] * watch.REOPEN_LIMIT + [[("req", 1)]]
    assert metrics.partition_repairs.labels(kind="failed_transaction")._value.get() == watch.REOPEN_LIMIT + 1
