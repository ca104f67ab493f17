"""The worker against a real Apache Kafka (the conftest's local KRaft broker), end to end: mixed
requests (5 tasks, K in {1,2,3}, claim check, 7 kinds of invalid) on the dflash2 profile: one
result or dead letter each, shapes, the speculative block, /v1/models, the metrics (spec
counters at 0 first, then equal to the results' sums; lag back to 0) and the stats lines and
dead-letter warnings in the log (worker.stats).

The run is in-process (:class:`worker.process.WorkerThread`): the seed's startup rule refuses a
custom head together with ``NIM_FT_CHECKPOINT`` (our random checkpoint), so the test builds the
Settings directly. Kills, rebalances and drains: test_service_kill_rebalance_drain.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections import defaultdict

import msgspec
import pytest

import schemas as S
from worker.config import load_settings
from worker.scenes.request import build_request

from tests.worker.kafka_harness import (L, collect, free_port, http_get, metric_values, produce, request_item,
                                        unique, worker_env)

pytestmark = pytest.mark.kafka


async def test_mixed_requests_one_answer_each_with_shapes_speculative_block_and_metrics(
        kafka_bootstrap, topic_factory, tiny, scene, tmp_path, caplog):
    from worker.process import WorkerThread

    caplog.set_level(logging.INFO, logger="alpamayo.worker.stats")

    ckpt, head = tiny
    req_t, res_t, dl_t = await topic_factory(2, prefix="req"), await topic_factory(2, prefix="res"), \
        await topic_factory(2, prefix="dl")
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    instance = unique("w-mixed")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, unique("g-mixed"), instance, port, ckpt,
                     NIM_MODEL_PROFILE="bf16-dflash2", NIM_ALPAMAYO_TRAJ_SAMPLES="1,2,3",
                     NIM_ALPAMAYO_SPEC_METRICS="summary", ALPAMAYO_MAX_BATCH_SIZE="4",
                     ALPAMAYO_MAX_BATCH_WAIT_MS="200", ALPAMAYO_CLAIM_CHECK_ROOTS=f"file://{store}/",
                     ALPAMAYO_STATS_INTERVAL_S="1")
    settings = dataclasses.replace(load_settings(env), speculative_model=head)   # head + FT ckpt: see module doc
    started = time.time()
    w = WorkerThread(settings).start()
    try:
        assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
        ready_seen = time.time()
        base = f"http://127.0.0.1:{port}"

        # -- /v1/models and the counters before the first request -----------------------------
        status, body, _ = await http_get(base + "/v1/models")
        model = json.loads(body)["data"][0]
        assert status == 200
        assert (model["profile"], model["speculative_decoding"], model["k_values"], model["speculative_model"]) == (
            "bf16-dflash2", "dflash2", [1, 2, 3], str(head))
        status, body, ctype = await http_get(base + "/v1/metrics")
        text = body.decode()
        assert status == 200 and ctype.startswith("text/plain")
        for name in ("alpamayo_spec_decode_draft_tokens_total", "alpamayo_spec_decode_accepted_tokens_total",
                     "alpamayo_spec_decode_verify_steps_total"):
            assert metric_values(text, name) == {L(method="dflash2"): 0.0}, name
        assert (await http_get(base + "/metrics"))[1].decode().count("alpamayo_spec_decode") == text.count(
            "alpamayo_spec_decode")
        assert metric_values(text, "alpamayo_ready") == {(): 1.0}
        # when it became ready, by its own clock (benchmarks start their runs there)
        assert started < metric_values(text, "alpamayo_ready_since_seconds")[()] <= ready_seen

        # -- the requests ---------------------------------------------------------------------
        cc_images = []
        for i, blob in enumerate(scene.images):
            (store / f"img{i}.png").write_bytes(blob)
            cc_images.append(S.ImageRef(uri=f"file://{store}/img{i}.png", sha256=hashlib.sha256(blob).hexdigest(),
                                        size=len(blob)))
        sr = build_request
        rp = msgspec.structs.replace
        valid = [
            sr(scene, "trajectory", 1, request_id="traj-k1"),
            sr(scene, "trajectory", 2, request_id="traj-k2-a", temperature=0.7, seed=5),
            sr(scene, "trajectory", 2, request_id="traj-k2-b", temperature=0.7, seed=6),
            sr(scene, "trajectory", 3, request_id="traj-k3", temperature=0.8, seed=7),
            rp(sr(scene, "trajectory", 1, request_id="traj-claim-check"), images=cc_images),
            sr(scene, "meta_action", 1, request_id="meta", max_tokens=4),
            sr(scene, "auto_labeling", 1, request_id="autolabel", max_tokens=4),
            sr(scene, "vqa", 1, request_id="vqa", max_tokens=4),
            sr(scene, "grounding", 1, request_id="grounding", max_tokens=4),
        ]
        bad_images = list(scene.images)
        bad_images[5] = b"not an image at all"
        traversal = list(scene.images)
        traversal[0] = S.ImageRef(uri=f"file://{store}/../secret.png", sha256="0" * 64, size=10)
        invalid = {   # request -> (code, field)
            "k-not-served": (sr(scene, "trajectory", 4, request_id="k-not-served", temperature=0.6),
                             ("k_not_served", "$.num_traj_samples")),
            "k2-temp0": (sr(scene, "trajectory", 2, request_id="k2-temp0", temperature=0.0),
                         ("k_requires_temperature", "$.temperature")),
            "no-ego": (rp(sr(scene, "trajectory", 1, request_id="no-ego"), egomotion=None),
                       ("missing_egomotion", "$.egomotion")),
            "bad-image": (rp(sr(scene, "trajectory", 1, request_id="bad-image"), images=bad_images),
                          ("bad_image", "$.images[5]")),
            "traversal": (rp(sr(scene, "trajectory", 1, request_id="traversal"), images=traversal),
                          ("claim_check_failed", "$.images[0]")),
            "schema-99": (rp(sr(scene, "trajectory", 1, request_id="schema-99"), schema_version=99),
                          ("unsupported_schema_version", "$.schema_version")),
        }
        items = [request_item(r) for r in valid] + [request_item(r) for r, _ in invalid.values()]
        items.insert(3, ("garbage", b"garbage", b"\xc1\xc1", []))
        coords = await produce(kafka_bootstrap, req_t, items)
        garbage_id = f"{req_t}:{coords['garbage'][0]}:{coords['garbage'][1]}"
        expected = [r.request_id for r in valid] + list(invalid) + [garbage_id]
        out = await collect(kafka_bootstrap, res_t, dl_t, partitions=2, expected=expected, timeout=150, settle=1.0)

        # -- exactly one answer per request, of the right kind -------------------------------
        assert set(out.by_id) == set(expected)
        assert {i: len(v) for i, v in out.by_id.items() if len(v) != 1} == {}
        for ident, (code_field) in {**{k: v[1] for k, v in invalid.items()},
                                    garbage_id: ("undecodable_bytes", "$")}.items():
            (dl,) = out.by_id[ident]
            assert isinstance(dl, S.DeadLetter), (ident, dl)
            assert (dl.error_code.value, dl.error_field) == code_field, (ident, dl.error_message)
            assert dl.worker_id == instance and dl.source.topic == req_t
        spec_sum = defaultdict(int)
        for r in valid:
            (res,) = out.by_id[r.request_id]
            assert isinstance(res, S.InferResult), (r.request_id, getattr(res, "error_message", ""))
            assert out.keys[r.request_id] == [r.request_id.encode()]                 # keyed by request_id
            assert (res.task, res.num_samples, len(res.outputs)) == (r.task, r.num_traj_samples, r.num_traj_samples)
            assert res.lineage.offset == coords[r.request_id][1] and res.lineage.partition == coords[r.request_id][0]
            assert res.model.speculative_decoding == "dflash2" and res.model.profile == "bf16-dflash2"
            spec = res.metrics.speculative_decoding
            if r.task == "trajectory":
                k = r.num_traj_samples
                assert len(res.pred_trajectories) == k and all(len(t) == 64 and all(len(p) == 3 for p in t)
                                                               for t in res.pred_trajectories)
                assert len(res.pred_rotations) == k and all(len(m) == 64 and len(m[0]) == 3 and len(m[0][0]) == 3
                                                            for m in res.pred_rotations)
                assert spec is not None and spec.num_spec_tokens == 7 and len(spec.acceptance_histogram) == 8
                assert sum(spec.acceptance_histogram) == spec.num_spec_steps >= k
                assert 0 <= spec.num_accepted_draft_tokens <= spec.num_draft_tokens
                assert spec.draft_acceptance_rate == pytest.approx(
                    spec.num_accepted_draft_tokens / spec.num_draft_tokens)
                assert spec.mean_acceptance_length == pytest.approx(
                    1 + spec.num_accepted_draft_tokens / spec.num_spec_steps)
                assert spec.per_step_accepted is None                                 # summary, not detailed
                spec_sum["draft"] += spec.num_draft_tokens
                spec_sum["accepted"] += spec.num_accepted_draft_tokens
                spec_sum["steps"] += spec.num_spec_steps
            else:
                assert spec is None, r.task                                           # never on other tasks
                assert res.pred_trajectories is None or r.task in ("meta_action", "auto_labeling")
        vqa = out.by_id["vqa"][0]
        assert vqa.answer is not None

        # -- metrics after the run -----------------------------------------------------------
        deadline = time.monotonic() + 10
        while True:
            text = (await http_get(base + "/v1/metrics"))[1].decode()
            lag = metric_values(text, "alpamayo_consumer_lag")
            if (len(lag) == 2 and all(v == 0 for v in lag.values())) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert lag == {L(topic=req_t, partition=p): 0.0 for p in (0, 1)}, lag
        m = lambda name: metric_values(text, name)  # noqa: E731
        assert m("alpamayo_spec_decode_draft_tokens_total") == {L(method="dflash2"): spec_sum["draft"]}
        assert m("alpamayo_spec_decode_accepted_tokens_total") == {L(method="dflash2"): spec_sum["accepted"]}
        assert m("alpamayo_spec_decode_verify_steps_total") == {L(method="dflash2"): spec_sum["steps"]}
        assert spec_sum["draft"] > 0
        results = m("alpamayo_results_total")
        assert results[L(task="trajectory")] == 5 and results[L(task="vqa")] == 1
        assert sum(m("alpamayo_requests_total").values()) == len(valid)
        dls = {k: v for k, v in m("alpamayo_dead_letters_total").items() if v}
        assert dls == {L(code=c): 1 for c in ("k_not_served", "k_requires_temperature", "missing_egomotion",
                                              "bad_image", "claim_check_failed", "unsupported_schema_version",
                                              "undecodable_bytes")}
        batches = m("alpamayo_batch_size_count")
        assert sum(batches.values()) < len(valid)                 # something was batched together
        assert sum(m("alpamayo_batch_size_sum").values()) == len(valid)
        assert m("alpamayo_stage_latency_seconds_count")[L(stage="total", task="trajectory")] == 5
        assert m("alpamayo_gpu_memory_bytes") == {(): 0.0} and m("alpamayo_queue_depth") == {(): 0.0}
        engine = m("alpamayo_engine_seconds_total")
        assert set(engine) == {L(phase="infer"), L(phase="output"), L(phase="prepare")} and engine[L(phase="infer")] > 0
        assert engine[L(phase="prepare")] >= 0                    # > 0 only when a full batch waited behind another

        # -- the log: stats lines whose dead letters add up, one warning per dead-letter code ----
        def logged(prefix):
            return [r.getMessage() for r in caplog.records if r.name == "alpamayo.worker.stats"
                    and r.getMessage().startswith(prefix)]
        deadline = time.monotonic() + 5
        while sum(int(re.search(r"dead letters (\d+)", x)[1]) for x in logged("stats: ")) < 7 \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert sum(int(re.search(r"dead letters (\d+)", x)[1]) for x in logged("stats: ")) == 7, logged("stats: ")
        assert any("results/s" in x and "acceptance rate" in x for x in logged("stats: ")), logged("stats: ")
        assert sorted(x.split()[2] for x in logged("dead letter ")) == sorted(
            [v[1][0] for v in invalid.values()] + ["undecodable_bytes"])
    finally:
        code = await asyncio.to_thread(w.stop, 90)
    assert code == 0
