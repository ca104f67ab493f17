"""`python -m producer_tools.serve_bench`: the whole worker through the local Apache Kafka against
the engine alone, on the same records (a tiny random checkpoint on the CPU, bf16)."""

from __future__ import annotations

import re

import pytest

from producer_tools import serve_bench
from worker.demo.layout import write_random_checkpoint

pytestmark = pytest.mark.kafka


def test_serve_bench_answers_every_request_and_compares_with_the_engine_alone(
        kafka_bootstrap, tmp_path, monkeypatch, capsys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    for var in ("NIM_PRECISION", "NIM_ALPAMAYO_SPECULATIVE_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NIM_FT_CHECKPOINT", str(ckpt))
    monkeypatch.setenv("NIM_MODEL_PROFILE", "bf16")
    monkeypatch.setenv("ALPAMAYO_DEVICE", "cpu")
    code = serve_bench.main(["--bootstrap-servers", kafka_bootstrap, "--scenes", "6", "--batch", "3", "--k", "1",
                             "--distinct", "2", "--image-size", "64x64", "--reasoning-tokens", "12", "--timeout", "300",
                             "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "serve_bench.md").read_text()
    assert text in capsys.readouterr().out
    assert "| every request answered with a result | 6 of 6 (0 dead letters) | met |" in text
    # the Kafka path writes what the engine alone writes for the same records
    assert "| reasoning identical to the engine alone's (informational) | 6 of 6 | - |" in text
    found = re.search(r"\| ([\d.]+) / ([\d.]+) scenes/s = ([\d.]+)x \| (met|missed) \|", text)
    kafka_sps, engine_sps, ratio = map(float, found.groups()[:3])
    assert kafka_sps > 0 and engine_sps > 0 and abs(ratio - kafka_sps / engine_sps) < 2e-3
    # the status follows the unrounded ratio (CI once printed 0.950x for a ratio just under the bar)
    if abs(ratio - serve_bench.KAFKA_OVER_ENGINE) > 5e-4:
        assert found.group(4) == ("met" if ratio >= serve_bench.KAFKA_OVER_ENGINE else "missed")
    assert code == (0 if found.group(4) == "met" else 1)
    # where the Kafka path's time goes: engine stages inside the worker against the engine alone
    kafka_prefill, alone_prefill, kafka_mean, alone_mean = map(float, re.search(
        r"prefill (\d+) / (\d+) ms \(mean (\d+) / (\d+)\), decode", text).groups())
    assert min(kafka_prefill, alone_prefill, kafka_mean, alone_mean) > 0
    assert re.search(r"\| first answer after the worker was ready \(informational\) \| [\d.]+ s \|", text)
    # the worker's engine thread, from its Prometheus counters: 2 batches of 3, busy part of the run
    batches, per_batch, infer, output, busy, ahead, alone = re.search(
        r"(\d+) batches of ([\d.]+) scenes on average; infer ([\d.]+) \+ output ([\d.]+) s per batch, busy (\d+)% of the run \(host work of the next batch, "
        r"prepared meanwhile: ([\d.]+) s per batch\); alone: infer ([\d.]+) s per batch", text).groups()
    # (the run's clock starts when the worker became ready, by its own gauge: a clock started when
    # the harness saw readiness, polled, once showed 140%)
    assert float(infer) > 0 and float(alone) > 0 and 0 < int(busy) <= 100 and float(ahead) >= 0
    assert int(batches) >= 2 and abs(int(batches) * float(per_batch) - 6) < 0.1      # 6 scenes in batches of <= 3
    assert re.search(r"infer outside the timed stages -?[\d.]+ / -?[\d.]+ s per batch", text)
    assert re.search(r"\| prefill per scene, mean of each batch in the order they ran, ms \(informational\) \| "
                     r"Kafka path \d+(, \d+)+; alone \d+(, \d+)+ \| - \|", text)       # 2 batches each
    assert re.search(r"\| batch wall, Kafka path, by its answers \(informational\) \| first [\d.]+ s, later median "
                     r"[\d.]+ s \(min [\d.]+, max [\d.]+\); after the first: [\d.]+ scenes/s \| - \|", text)


def test_batch_walls_split_the_first_batch_from_the_later_ones():
    """Answers grouped by their batch (a batch's scenes share its decode time): the first batch's
    wall runs from readiness (the pipeline filling: on the H200 13.8 s against 6.9 for the later
    ones, 2026-12-04), the later ones between successive batches' last answers."""
    from types import SimpleNamespace

    def answer(decode_ms, at):
        return SimpleNamespace(metrics=SimpleNamespace(timings=SimpleNamespace(decode_ms=decode_ms))), at

    results = {f"a{i}": answer(1000.0, 113.8 - 0.1 * (i % 2)) for i in range(4)}
    results |= {f"b{i}": answer(1001.0, 120.7) for i in range(4)}
    results |= {f"c{i}": answer(999.0, 127.4) for i in range(2)}
    assert serve_bench.batch_walls(results, ready=100.0) == \
        "first 13.8 s, later median 6.8 s (min 6.7, max 6.9); after the first: 0.441 scenes/s"
    assert serve_bench.batch_walls({}, ready=100.0) == ""


def test_the_time_outside_the_stages_counts_a_batchs_slow_scenes_as_stage_time():
    """A batch's stages are its scenes' sum: the stage figures behind "infer outside the timed
    stages" are means (with medians, one slow prefill in a batch counted as time outside)."""
    from types import SimpleNamespace

    def kafka(prefill):
        return SimpleNamespace(metrics=SimpleNamespace(timings=SimpleNamespace(
            prefill_ms=prefill, decode_ms=50.0, diffusion_ms=10.0))), 0.0

    results = {i: kafka(p) for i, p in enumerate((100.0, 100.0, 400.0))}
    direct = {i: SimpleNamespace(timings_ms={"prefill": 100.0, "decode": 50.0, "diffusion": 10.0}) for i in range(3)}
    text, kafka_ms, alone_ms = serve_bench.stage_times(results, direct)
    assert kafka_ms["prefill"] == 200.0 and alone_ms["prefill"] == 100.0
    assert serve_bench.batch_stage_s(kafka_ms, 3) == (600.0 + 50.0 + 10.0) / 1e3        # the batch's own sum
    assert text.startswith("prefill 100 / 100 ms (mean 200 / 100), decode 50 / 50 ms")


def test_prefill_by_batch_names_each_batchs_mean_in_the_order_the_batches_ran():
    """A batch's scenes share its decode time: two Kafka batches (decode 50 and 70 ms), the second
    with one slow prefill, against one batch alone."""
    from types import SimpleNamespace

    def kafka(prefill, decode):
        return SimpleNamespace(metrics=SimpleNamespace(timings=SimpleNamespace(
            prefill_ms=prefill, decode_ms=decode))), 0.0

    results = {i: kafka(p, d) for i, (p, d) in enumerate([(100.0, 50.0), (110.0, 50.0), (100.0, 70.0), (400.0, 70.0)])}
    direct = {i: SimpleNamespace(timings_ms={"prefill": 100.0 + i, "decode": 55.0}) for i in range(4)}
    assert serve_bench.prefill_by_batch(results, direct) == "Kafka path 105, 250; alone 102"


def test_send_requests_publishes_a_request_larger_than_the_producer_default(kafka_bootstrap):
    """A scene of 24 full-HD JPEG frames (1.3 MB encoded) is over aiokafka's default
    max_request_size (1 MiB): the first run of serve_bench on the GPU machine failed on it."""
    import asyncio
    import uuid

    from aiokafka import AIOKafkaConsumer

    import schemas as S
    from producer_tools.answers import send_requests
    from producer_tools.common import client_kwargs, kafka_options
    from producer_tools.topics import create_topics, plan_topics

    run = f"big-{uuid.uuid4().hex[:8]}"
    opts = kafka_options({}, bootstrap_servers=kafka_bootstrap, request_topic=f"{run}.requests",
                         result_topic=f"{run}.results", dead_letter_topic=f"{run}.dead-letters")
    asyncio.run(create_topics(opts, plan_topics(opts, partitions=1, max_message_bytes=8 << 20)))
    req = serve_bench.build_requests(run, 1, 1, (1080, 1920), 1)[0]
    size = len(S.encode_request(req)[0])
    assert size > 1 << 20

    async def read_back() -> list[int]:
        consumer = AIOKafkaConsumer(opts.request_topic, group_id=None, auto_offset_reset="earliest",
                                    fetch_max_bytes=16 << 20, max_partition_fetch_bytes=16 << 20,
                                    **client_kwargs(opts))
        await consumer.start()
        try:
            batch = await consumer.getmany(timeout_ms=20_000)
            return [len(m.value) for msgs in batch.values() for m in msgs]
        finally:
            await consumer.stop()

    sent = asyncio.run(send_requests(opts, [req]))
    assert list(sent) == [req.request_id]
    assert asyncio.run(read_back()) == [size]
