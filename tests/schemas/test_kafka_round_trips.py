"""Every message type through a real Kafka broker: produce with headers and key, consume, decode.

Fixtures ``kafka_bootstrap`` and ``topic_factory`` come from tests/conftest.py (local KRaft broker).
"""

from __future__ import annotations

import hashlib
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

import schemas as S
from schemas import ContractError, ErrorCode

from tests.schemas.test_contract import IMG, ego, image_ref, request, result  # shared builders

pytestmark = pytest.mark.kafka

CTS = [S.CONTENT_TYPE_MSGPACK, S.CONTENT_TYPE_JSON]


async def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()


async def _consume(bootstrap: str, topic: str, n: int, timeout: float = 30.0):
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < n:
            assert time.monotonic() < deadline, f"only {len(out)}/{n} records on {topic} after {timeout}s"
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                out.extend(records)
    finally:
        await consumer.stop()
    return sorted(out, key=lambda r: r.offset)


@pytest.mark.parametrize("ct", CTS)
async def test_requests_round_trip_through_kafka(kafka_bootstrap: str, topic_factory, ct: str) -> None:
    topic = await topic_factory(partitions=1)
    inline = request(request_id="kafka-inline-1", run_id="run-k", labels={"src": "test"})
    by_ref = request(request_id="kafka-ref-1", task="grounding", question="cars", images=[image_ref(i) for i in range(24)])
    records = []
    for req in (inline, by_ref):
        value, headers = S.encode_request(req, ct, validate=True)
        records.append((S.request_key(req), value, headers))
    await _produce(kafka_bootstrap, topic, records)

    got = await _consume(kafka_bootstrap, topic, 2)
    for rec, want in zip(got, (inline, by_ref)):
        assert rec.key == want.request_id.encode()
        headers = list(rec.headers)
        assert S.header_value(headers, "content-type") == ct
        assert S.header_value(headers, "schema-version") == "1"
        assert S.header_value(headers, "request-id") == want.request_id
        back = S.decode_request(rec.value, headers, k_values=[1])
        assert back == want
    assert got[0].value and isinstance(S.decode_request(got[0].value, list(got[0].headers)).images[0], bytes)
    assert S.decode_request(got[0].value, list(got[0].headers)).images[0] == IMG
    assert isinstance(S.decode_request(got[1].value, list(got[1].headers)).images[0], S.ImageRef)


@pytest.mark.parametrize("ct", CTS)
async def test_result_round_trip_through_kafka(kafka_bootstrap: str, topic_factory, ct: str) -> None:
    topic = await topic_factory(partitions=1)
    res = result()
    value, headers = S.encode_result(res, ct)
    await _produce(kafka_bootstrap, topic, [(S.result_key(res.request_id), value, headers)])
    (rec,) = await _consume(kafka_bootstrap, topic, 1)
    assert rec.key == b"req-0001"
    back = S.decode_result(rec.value, list(rec.headers))
    assert back == res
    assert back.metrics.speculative_decoding is not None and back.metrics.speculative_decoding.per_step_accepted is None


@pytest.mark.parametrize("ct", CTS)
async def test_dead_letter_round_trip_through_kafka(kafka_bootstrap: str, topic_factory, ct: str) -> None:
    """A bad request goes through Kafka, is dead-lettered with its coordinates, and the dead letter
    goes through Kafka and still holds the original bytes and headers (replayable)."""
    req_topic = await topic_factory(partitions=1)
    dlq_topic = await topic_factory(partitions=1)
    bad = request(request_id="kafka-bad-1", egomotion=ego(), temperature=0.0, num_traj_samples=2)
    value, headers = S.encode_request(bad, ct)
    garbage = b"\xc1\x00garbage"
    await _produce(kafka_bootstrap, req_topic, [(b"kafka-bad-1", value, headers), (None, garbage, [])])

    dead = []
    for rec in await _consume(kafka_bootstrap, req_topic, 2):
        with pytest.raises(ContractError) as info:
            S.decode_request(rec.value, list(rec.headers))
        dead.append(
            S.dead_letter_from_error(
                info.value, value=rec.value, key=rec.key, headers=list(rec.headers),
                topic=rec.topic, partition=rec.partition, offset=rec.offset, worker_id="w-test",
            )
        )
    assert [d.error_code for d in dead] == [ErrorCode.K_REQUIRES_TEMPERATURE, ErrorCode.UNDECODABLE_BYTES]
    assert [S.dead_letter_key(d) for d in dead] == [b"kafka-bad-1", f"{req_topic}:0:1".encode()]

    await _produce(kafka_bootstrap, dlq_topic, [(S.dead_letter_key(d), *S.encode_dead_letter(d, ct)) for d in dead])
    got = await _consume(kafka_bootstrap, dlq_topic, 2)
    for rec, want in zip(got, dead):
        assert rec.key == S.dead_letter_key(want)
        assert S.header_value(list(rec.headers), "error-code") == want.error_code.value
        back = S.decode_dead_letter(rec.value, list(rec.headers))
        assert back == want
    first = S.decode_dead_letter(got[0].value, list(got[0].headers))
    assert first.source.topic == req_topic and first.source.offset == 0 and first.request_id == "kafka-bad-1"
    assert hashlib.sha256(first.original_value).digest() == hashlib.sha256(value).digest()
    assert first.original_headers == headers
    with pytest.raises(ContractError) as info:  # the replayed bytes fail the same way
        S.decode_request(first.original_value, first.original_headers)
    assert info.value.code is ErrorCode.K_REQUIRES_TEMPERATURE


async def test_concurrent_round_trips(kafka_bootstrap: str, topic_factory) -> None:
    """Several partitions and many requests: keys route consistently and every message decodes."""
    topic = await topic_factory(partitions=3)
    reqs = [request(request_id=f"bulk-{i:03d}", seed=i) for i in range(30)]
    records = [(S.request_key(r), *S.encode_request(r)) for r in reqs]
    await _produce(kafka_bootstrap, topic, records)
    got = await _consume(kafka_bootstrap, topic, len(reqs))
    decoded = {S.decode_request(r.value, list(r.headers)).request_id: r.partition for r in got}
    assert sorted(decoded) == [r.request_id for r in reqs]
    assert len(set(decoded.values())) > 1  # spread over partitions by key
