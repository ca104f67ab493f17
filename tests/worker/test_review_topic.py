"""The review topic against a real Apache Kafka (the conftest's local broker): under exactly_once,
a worker with ALPAMAYO_REVIEW_TOPIC publishes exactly the results whose uncertainty reaches the
threshold there too, each once, byte for byte the result's record, read_committed."""

from __future__ import annotations

import asyncio

import pytest

import schemas as S
from worker.config import load_settings
from worker.scenes.request import build_request

from tests.worker.kafka_harness import collect, free_port, produce, request_item, worker_env

pytestmark = pytest.mark.kafka
THRESHOLD = 0.5


async def _read_all(bootstrap: str, topic: str, partitions: int) -> list:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends, out = await c.end_offsets(tps), []
        while any([await c.position(tp) < ends[tp] for tp in tps]):
            for recs in (await c.getmany(timeout_ms=300)).values():
                out += recs
        return out
    finally:
        await c.stop()


async def test_exactly_the_doubtful_results_land_in_the_review_topic(kafka_bootstrap, topic_factory, tiny, scene,
                                                                    tmp_path):
    from worker.process import WorkerThread

    ckpt, _ = tiny
    req_t, res_t, dl_t, rev_t = [await topic_factory(2, prefix=p) for p in ("req", "res", "dl", "rev")]
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, "g-review", "w-review", free_port(), ckpt,
                     NIM_ALPAMAYO_TRAJ_SAMPLES="1,2,3", ALPAMAYO_PROCESSING_GUARANTEE="exactly_once",
                     ALPAMAYO_REVIEW_TOPIC=rev_t, ALPAMAYO_REVIEW_THRESHOLD=str(THRESHOLD),
                     ALPAMAYO_MAX_BATCH_SIZE="4")
    w = WorkerThread(load_settings(env)).start()
    try:
        assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
        reqs = [build_request(scene, "trajectory", 1, request_id=f"traj-k1-{i}") for i in range(2)]
        reqs += [build_request(scene, "trajectory", k, request_id=f"traj-k{k}-{i}", temperature=0.3 + 0.4 * i,
                               seed=i) for k in (2, 3) for i in range(3)]
        reqs += [build_request(scene, "meta_action", 2, request_id=f"meta-k2-{i}", temperature=0.7, seed=i,
                               max_tokens=4) for i in range(2)]
        await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs])
        out = await collect(kafka_bootstrap, res_t, dl_t, [r.request_id for r in reqs], partitions=2, timeout=200)
        results = {i: v[0] for i, v in out.by_id.items()}
        assert all(isinstance(r, S.InferResult) for r in results.values()) and len(results) == len(reqs)
        assert all((r.uncertainty is None) == (r.num_samples == 1) for i, r in results.items()
                   if r.task == "trajectory")
        doubtful = {i for i, r in results.items() if r.uncertainty is not None and r.uncertainty.uncertainty >= THRESHOLD}
        assert doubtful and set(results) - doubtful, {i: r.uncertainty for i, r in results.items()}

        review = await _read_all(kafka_bootstrap, rev_t, 2)
        ids = [S.decode_result(r.value, r.headers).request_id for r in review]
        assert sorted(ids) == sorted(doubtful)                      # exactly those, each once
        raw = {r.key: r.value for r in await _read_all(kafka_bootstrap, res_t, 2)}
        assert all(raw[r.key] == r.value for r in review)           # the result's own record
    finally:
        code = await asyncio.to_thread(w.stop, 90)
    assert code == 0
