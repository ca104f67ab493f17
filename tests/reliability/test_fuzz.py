"""Fuzzed input (``python -m producer_tools.chaos fuzz``): generated bad messages interleaved with
good ones through a real worker on the session's Kafka.

The worker must stay up, answer every bad message with a dead letter whose code is one its
category allows (and whose ``error-code`` header matches), every good one with a result, and its
resident memory (``/proc/PID/status``) must stay bounded. Short run here (1,000 bad + 20 good);
10,000 bad is opt-in (``ALPAMAYO_LONG_TESTS=1`` or the CLI).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter, defaultdict

import pytest

import schemas as S
from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import format_table
from producer_tools.chaos.fuzz import FUZZ_GENERATORS, _Base, fuzz_cases, png_bytes, prepare_claim_root
from producer_tools.chaos.pipeline import Pipeline
from producer_tools.chaos.processes import peak_rss_bytes, rss_bytes
from producer_tools.chaos.scenarios import run_fuzz

LONG = os.environ.get("ALPAMAYO_LONG_TESTS") == "1"

# what the issue names, mapped to the generator categories that produce it
NAMED = {
    "truncated msgpack": "truncated_msgpack", "wrong types": "wrong_type", "huge arrays": "huge_array",
    "bad base64": "bad_base64", "bad JPEG": "bad_image", "decompression bombs": "decompression_bomb",
    "NaN/inf egomotion": "nonfinite_egomotion", "wrong image counts": "image_count",
    "unknown schema versions": "schema_version", "oversize": "oversize",
}


def test_generators_cover_every_named_kind_and_their_codes_hold_in_intake(tmp_path):
    """The fuzz expectations themselves, in process: every category yields only its allowed codes
    (so a wrong code through Kafka is the worker's fault, not the harness's)."""
    from worker.config import load_settings
    from worker.engine import default_seed
    from worker.intake import Intake, Job, RawRecord

    assert set(NAMED.values()) <= set(FUZZ_GENERATORS)
    root = prepare_claim_root(tmp_path / "claims")
    s = load_settings({"ALPAMAYO_CLAIM_CHECK_ROOTS": f"file://{root}/", "ALPAMAYO_MAX_REQUEST_BYTES": str(256 << 10),
                       "ALPAMAYO_WORKER_ID": "fz"})
    intake = Intake(s, default_seed)
    seen: dict[str, Counter] = defaultdict(Counter)
    wrong = []
    for i, c in enumerate(fuzz_cases(3000, 10, seed=5, claim_root=root)):
        out = intake.process(RawRecord("t", 0, i, c.value, c.key, tuple(c.headers)))
        if c.good:
            assert isinstance(out, Job), (c.category, getattr(out, "error_message", ""))
            continue
        assert isinstance(out, S.DeadLetter), c.category
        seen[c.category][out.error_code.value] += 1
        if out.error_code.value not in c.expected:
            wrong.append((c.category, out.error_code.value, out.error_field, out.error_message[:120]))
    assert wrong == []
    assert set(seen) == set(FUZZ_GENERATORS), set(FUZZ_GENERATORS) - set(seen)
    # the bombs are refused as oversize (pixel bounds), never decoded
    assert set(seen["decompression_bomb"]) == {"oversize"}
    assert set(seen["nonfinite_egomotion"]) == {"bad_egomotion"}


def assert_fuzz(fig, bad: int, good: int) -> None:
    print("\n" + format_table([fig]))
    per_cat = fig.extra["_per_category"]
    assert fig.published == bad + good
    assert fig.lost == 0 and fig.duplicated == 0
    assert fig.dead_letters == bad and fig.results == good
    assert fig.extra["_wrong"] == []
    assert set(per_cat) == set(FUZZ_GENERATORS) | {"good"}
    assert fig.unplanned_exits == 0 and fig.worker_restarts == 0          # the worker stayed up
    assert fig.rss_end_mb - fig.rss_start_mb < 200, fig.extra.get("RSS growth")
    assert fig.final_exit_code == 0
    assert fig.ok, fig.failures


async def test_fuzz_1000_bad_20_good_through_a_real_worker(kafka_bootstrap, tmp_path):
    fig = await run_fuzz(Broker(kafka_bootstrap), bad=1000, good=20, seed=3, work=tmp_path, timeout=300)
    assert_fuzz(fig, 1000, 20)


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="10,000 bad messages: ALPAMAYO_LONG_TESTS=1")
async def test_fuzz_10000_bad_through_a_real_worker(kafka_bootstrap, tmp_path):
    fig = await run_fuzz(Broker(kafka_bootstrap), bad=10_000, good=200, seed=0, work=tmp_path, timeout=1200)
    assert_fuzz(fig, 10_000, 200)


async def test_legal_but_huge_images_keep_worker_memory_bounded(kafka_bootstrap, tmp_path):
    """Requests that pass every limit but carry 24 large frames (a uniform 1920x1080 PNG
    compresses to ~8 KB, so one message is ~200 KB): the worker's RSS must not grow with the
    number of such jobs in flight (intake keeps each frame at the model's target size; before it
    did, 4 such requests took +1.9 GB)."""
    from aiokafka import AIOKafkaProducer
    import msgspec

    async with Pipeline(Broker(kafka_bootstrap), scenario="bigframes", guarantee="at_least_once", work=tmp_path,
                        sink=False, batch_size=4) as pl:
        await pl.start_worker()
        base = _Base()
        blob = png_bytes(1920, 1080, fill=120)
        rss0 = rss_bytes(pl.worker.pid)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=2 << 20)
        await producer.start()
        try:
            for i in range(4):
                d = base.copy(f"big-{i}")
                d["images"] = [blob] * 24
                await producer.send_and_wait(pl.topics.req, msgspec.msgpack.encode(d), key=f"big-{i}".encode())
        finally:
            await producer.stop()
        peak = rss0
        for _ in range(600):
            peak = max(peak, rss_bytes(pl.worker.pid) or 0)
            if pl.monitor.answered >= 4:
                break
            await asyncio.sleep(0.1)
        assert pl.monitor.results == 4
        peak = max(peak, peak_rss_bytes(pl.worker.pid) or 0)          # the high-water mark, not a sample
        growth_mb = (peak - rss0) / (1 << 20)
        print(f"\nRSS {rss0 >> 20} MB -> peak {peak >> 20} MB (+{growth_mb:.0f} MB) for 4 requests of 24 x 1920x1080")
        assert growth_mb < 400
