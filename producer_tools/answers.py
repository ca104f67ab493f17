"""A list of requests to Kafka, and one answer (result or dead letter) read back per request: the
round trip of `make demo` and of the Kafka-path throughput run (`producer_tools.serve_bench`)."""

from __future__ import annotations

import time
from typing import Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

import schemas as S
from producer_tools.common import KafkaOptions, client_kwargs


async def send_requests(opts: KafkaOptions, reqs: Iterable[S.InferRequest]) -> dict[str, float]:
    """Publish each request (acks=all, idempotent) to the request topic -> {request id: sent at}.
    The producer's max_request_size fits the largest encoded request (aiokafka's default, 1 MiB,
    refuses a scene of 24 full-HD JPEG frames); the topic's max.message.bytes must fit it too."""
    encoded = [(req, *S.encode_request(req)) for req in reqs]
    largest = max((len(value) for _, value, _ in encoded), default=0)
    producer = AIOKafkaProducer(acks="all", enable_idempotence=True, max_request_size=max(1 << 20, largest + (64 << 10)),
                                **client_kwargs(opts))
    await producer.start()
    sent_at = {}
    try:
        for req, value, headers in encoded:
            sent_at[req.request_id] = time.time()
            await producer.send_and_wait(opts.request_topic, value, key=req.request_id.encode(), headers=headers)
    finally:
        await producer.stop()
    return sent_at


async def collect_answers(opts: KafkaOptions, want: set[str], timeout_s: float, progress: bool = True):
    """Read the result and dead-letter topics from the start (read_committed) until every id of
    `want` is answered or `timeout_s` passed -> ({id: (InferResult, received at)}, {id: DeadLetter},
    ids unanswered)."""
    consumer = AIOKafkaConsumer(opts.result_topic, opts.dead_letter_topic, group_id=None,
                                auto_offset_reset="earliest", isolation_level="read_committed",
                                **client_kwargs(opts))
    await consumer.start()
    results, dead = {}, {}
    try:
        deadline = time.monotonic() + timeout_s
        last = 0
        while want - results.keys() - dead.keys() and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                for rec in records:
                    if tp.topic == opts.result_topic:
                        r = S.decode_result(rec.value, list(rec.headers or ()))
                        results[r.request_id] = (r, time.time())
                    else:
                        d = S.decode_dead_letter(rec.value, list(rec.headers or ()))
                        dead[d.request_id] = d
            done = len(results) + len(dead)
            if progress and done != last:
                print(f"  answered {done}/{len(want)}", flush=True)
                last = done
    finally:
        await consumer.stop()
    return results, dead, want - results.keys() - dead.keys()
