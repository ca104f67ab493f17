"""The lake sink in process on the real broker: a replay of a crashed segment cut short (the
SIGTERM path, ``--until-idle``) loses nothing and doubles nothing."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

import schemas as S
from producer_tools import lake as LK
from producer_tools import lake_tables as T
from producer_tools import sink as K
from producer_tools.common import KafkaOptions, atomic_write_bytes

from tests.producer_tools.sink_harness import Rec, lake_offsets, make_result

TS = 1_700_000_000_000
RUNS = ["ra", "rb", "rb", "ra"]          # offsets 0..3: segment 0-3 has one file per run


def _record(topic: str, offset: int) -> Rec:
    rid = f"{RUNS[offset]}:s{offset}:trajectory:k1"
    value, headers = S.encode_result(make_result(rid, RUNS[offset], offset))
    return Rec(topic, 0, offset, TS, rid.encode(), value, tuple(headers))


async def _produce(bootstrap: str, recs: list[Rec]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for r in recs:
            md = await producer.send_and_wait(r.topic, r.value, key=r.key, headers=list(r.headers), timestamp_ms=TS)
            assert md.offset == r.offset
    finally:
        await producer.stop()


async def _committed(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return await c.committed(tp)
    finally:
        await c.stop()


@pytest.mark.parametrize("cut", ["sigterm", "until_idle"])
async def test_a_replay_cut_short_on_the_broker_loses_no_record(kafka_bootstrap, topic_factory, tmp_path, cut):
    """Segment 0-3 crashed after its run-ra file (offsets 0 and 3), before its run-rb file (1, 2).
    A second sink reads offsets 0-1 of the replay (2 and 3 are not in the log yet) and stops; once
    2 and 3 arrive, a third sink must still find the range and write the rb file with both rows."""
    res_t, dl_t = await topic_factory(1, prefix="sres"), await topic_factory(1, prefix="sdl")
    lake, tp, group = tmp_path / "lake", TopicPartition(res_t, 0), f"g-sink-{uuid.uuid4().hex[:8]}"
    recs = [_record(res_t, o) for o in range(4)]
    ra_rows = [T.result_rows(recs[o])[0] for o in (0, 3)]
    atomic_write_bytes(LK.hive_dir(lake, "results", "ra", K._utc_date(TS)) / LK.segment_file_name(res_t, 0, 0, 3),
                       T.table_bytes(T.rows_to_table(ra_rows, "results")))
    await _produce(kafka_bootstrap, recs[:2])
    kafka = KafkaOptions(bootstrap_servers=kafka_bootstrap, request_topic="unused", result_topic=res_t,
                         dead_letter_topic=dl_t)

    def opts(**kw) -> K.SinkOptions:
        return K.SinkOptions(lake=str(lake), group_id=group, session_timeout_ms=6000, progress=False, **kw)

    second = K.LakeSink(kafka, opts(until_idle=2.0 if cut == "until_idle" else None))
    run = asyncio.ensure_future(second.run())
    if cut == "sigterm":
        for _ in range(600):
            if second.stats["records"] >= 2 or run.done():
                break
            await asyncio.sleep(0.05)
        second.stop_event.set()                               # what run_sink's SIGTERM handler does
    stats = await asyncio.wait_for(run, 120)
    assert lake_offsets(lake) == [0, 3]                     # nothing written under the range's name
    assert await _committed(kafka_bootstrap, group, tp) in (None, 0)
    assert stats["records"] == 2 and stats["replays_left"] == 1, stats
    await _produce(kafka_bootstrap, recs[2:])
    third = await asyncio.wait_for(K.LakeSink(kafka, opts(until_idle=3.0)).run(), 120)
    assert lake_offsets(lake) == [0, 1, 2, 3], third          # every record once
    assert third["replayed_segments"] == 1 and third["files_skipped"] == 1
    assert await _committed(kafka_bootstrap, group, tp) == 4
