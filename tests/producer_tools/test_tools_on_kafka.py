"""Producer tools against a REAL Apache Kafka (the conftest's local KRaft broker; never a mock).

* topics create/describe through the admin API;
* claim-check round trip of a scene larger than 1 MiB (1280x720 PNG cameras): publish -> consume
  -> resolve every ImageRef -> identical bytes;
* sink exactly-once: results on the broker, the sink subprocess SIGKILLed twice mid-run (while it
  sits between data files / before its offset commit), restarted with other rotation sizes -> no
  duplicate and no missing row;
* a run of mixed scenes (all five tasks, claim-checked and inline images, one request the worker
  must dead-letter) -> ``python -m worker serve`` (``ALPAMAYO_RESULT_FORMAT=json``: every output is
  read by a plain ``json.loads``) -> ``sink`` -> ``audit`` says complete; then ``dlq replay``
  re-publishes the dead letter's original bytes with lineage headers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

import schemas as S
from producer_tools import claim_check as CC
from producer_tools import lake as LK
from producer_tools import publish as P
from producer_tools.common import KafkaOptions
from producer_tools.scene_sources import iter_synthetic
from worker.scenes import generate_scene
from worker.scenes.request import scene_item

from tests import REPO_ROOT
from tests.producer_tools.sink_harness import make_result

pytestmark = pytest.mark.kafka


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "producer_tools", *args], env=_env(), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


async def _consume_all(bootstrap: str, topic: str, n: int, timeout: float = 30.0):
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=8 << 20)
    await consumer.start()
    out = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < n:
            assert time.monotonic() < deadline, f"only {len(out)}/{n} records on {topic} after {timeout}s"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(records)
    finally:
        await consumer.stop()
    return out


# --------------------------------------------------------------------------------------------
# topics
# --------------------------------------------------------------------------------------------


async def test_topics_create_and_describe(kafka_bootstrap):
    from producer_tools.topics import create_topics, describe_topics, plan_topics

    tag = uuid.uuid4().hex[:8]
    kafka = KafkaOptions(bootstrap_servers=kafka_bootstrap, request_topic=f"tq-{tag}", result_topic=f"tr-{tag}",
                         dead_letter_topic=f"td-{tag}")
    plans = plan_topics(kafka, partitions=3, replication_factor=1, max_message_bytes=3 << 20,
                        retention_ms=3_600_000, compact_results=True)
    assert [r["status"] for r in await create_topics(kafka, plans)] == ["created"] * 3
    assert [r["status"] for r in await create_topics(kafka, plans)] == ["exists"] * 3     # idempotent
    rows = {r["name"]: r for r in await describe_topics(kafka)}
    req, res, dl = rows[f"tq-{tag}"], rows[f"tr-{tag}"], rows[f"td-{tag}"]
    assert req["partitions"] == res["partitions"] == dl["partitions"] == 3 and req["replication_factor"] == 1
    assert req["configs"]["max.message.bytes"] == str(3 << 20) and req["configs"]["retention.ms"] == "3600000"
    assert dl["configs"]["max.message.bytes"] == str((3 << 20) + (256 << 10))
    assert dl["configs"]["retention.ms"] == str(30 * 24 * 3600 * 1000)
    assert res["configs"]["cleanup.policy"] == "compact,delete"


# --------------------------------------------------------------------------------------------
# claim check > 1 MiB
# --------------------------------------------------------------------------------------------


async def test_claim_check_round_trip_of_a_scene_larger_than_1mib(kafka_bootstrap, topic_factory, tmp_path):
    topic = await topic_factory(1, prefix="cc")              # broker default max.message.bytes (~1 MiB)
    scene = generate_scene(11, (1280, 720))                  # PNG cameras with sensor noise
    raw = sum(map(len, scene.images))
    assert raw > 1 << 20, raw
    kafka = KafkaOptions(bootstrap_servers=kafka_bootstrap, request_topic=topic, result_topic="unused",
                         dead_letter_topic="unused")
    store = tmp_path / "objects"
    opts = P.PublishOptions(tasks=["trajectory", "vqa"], run_id="cc-run", runs_dir=str(tmp_path / "runs"),
                            object_store=f"file://{store}", progress=False)
    summary = await P.publish(kafka, [scene_item(scene)], opts)
    assert summary["published"] == 2 and summary["claim_checked"] == 2 and summary["image_refs"] > 0
    records = await _consume_all(kafka_bootstrap, topic, 2)
    by_task = {}
    for rec in records:
        assert len(rec.value) <= CC.DEFAULT_CLAIM_CHECK_THRESHOLD
        req = S.decode_request(rec.value, list(rec.headers), k_values=[1])
        assert rec.key == req.request_id.encode() and req.run_id == "cc-run"
        refs = [im for im in req.images if isinstance(im, S.ImageRef)]
        assert refs and all(r.uri.startswith(f"file://{store}/") for r in refs)
        by_task[req.task] = CC.resolve_images(req)                # fetch + size/SHA-256 check
    assert by_task["trajectory"] == scene.images
    assert by_task["vqa"] == scene.vqa_images
    # resumable: the same run again publishes nothing new
    again = await P.publish(kafka, [scene_item(scene)], opts)
    assert again["published"] == 0 and again["skipped"] == 2 and again["resumed"]


# --------------------------------------------------------------------------------------------
# sink: SIGKILL mid-run, restart, exactly once
# --------------------------------------------------------------------------------------------


async def _produce_results(bootstrap: str, topic: str, n: int, runs=("ra", "rb", "rc")) -> dict[str, tuple[int, int]]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    coords = {}
    try:
        futs = []
        for i in range(n):
            run = runs[i % len(runs)]
            rid = f"{run}:s{i}:trajectory:k1"
            value, headers = S.encode_result(make_result(rid, run, i))
            futs.append((rid, await producer.send(topic, value, key=rid.encode(), headers=headers)))
        for rid, fut in futs:
            md = await fut
            coords[rid] = (md.partition, md.offset)
    finally:
        await producer.stop()
    return coords


def _segment_files(lake: Path) -> list[Path]:
    return [p for p in lake.rglob("*.parquet") if LK.parse_segment_file_name(p.name)]


async def _kill_after_files(proc: subprocess.Popen, lake: Path, n_files: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while len(_segment_files(lake)) < n_files:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"sink exited ({proc.returncode}) before the kill:\n{err.decode()[-3000:]}")
        assert time.monotonic() < deadline, "sink wrote too few files"
        await asyncio.sleep(0.01)
    assert proc.poll() is None, "the sink finished before it could be killed mid-run"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    return len(_segment_files(lake))


async def test_sink_sigkill_mid_run_and_restart_lands_every_row_exactly_once(kafka_bootstrap, topic_factory,
                                                                             tmp_path):
    res_t, dl_t = await topic_factory(2, prefix="sres"), await topic_factory(2, prefix="sdl")
    n = 90
    coords = await _produce_results(kafka_bootstrap, res_t, n)
    lake = tmp_path / "lake"
    base = ["sink", "--lake", str(lake), "--bootstrap-servers", kafka_bootstrap, "--result-topic", res_t,
            "--dead-letter-topic", dl_t, "--group-id", f"g-sink-{uuid.uuid4().hex[:6]}", "--session-timeout-ms", "6000", "--no-progress"]
    # 1st run: pauses 0.2 s after every data file; killed right after its 7th file
    p1 = _cli(*base, "--rotate-rows", "5", "--debug-pause", "0.2", "--until-idle", "20")
    files1 = await _kill_after_files(p1, lake, 7)
    # 2nd run: other rotation size; killed again mid-run
    p2 = _cli(*base, "--rotate-rows", "4", "--debug-pause", "0.1", "--until-idle", "20")
    files2 = await _kill_after_files(p2, lake, files1 + 6)
    rows_before = LK.read_lake(lake, "results").num_rows
    assert rows_before < n, "the kills did not land mid-run"
    # 3rd run: to the end
    p3 = _cli(*base, "--rotate-rows", "8", "--until-idle", "3")
    out, err = p3.communicate(timeout=120)
    assert p3.returncode == 0, err.decode()[-3000:]
    stats = json.loads(out)
    tbl = LK.read_lake(lake, "results", columns=["request_id", "kafka_partition", "kafka_offset", "run_id"])
    got = list(zip(tbl.column("kafka_partition").to_pylist(), tbl.column("kafka_offset").to_pylist()))
    assert len(got) == n, f"{len(got)} rows for {n} records"                  # none missing, none twice
    assert sorted(got) == sorted(coords.values())
    assert sorted(tbl.column("request_id").to_pylist()) == sorted(coords)
    assert all(rid.startswith(run + ":") for rid, run in zip(tbl.column("request_id").to_pylist(),
                                                              tbl.column("run_id").to_pylist()))
    for (topic, part), ranges in LK.scan_ranges(lake, "results").items():
        LK.check_ranges(topic, part, ranges)                                     # no overlapping segments
    assert stats["replayed_segments"] >= 1 and stats["files_skipped"] >= 1, stats
    assert not [p for p in lake.rglob("*") if ".tmp-" in p.name]
    assert files2 > files1


# --------------------------------------------------------------------------------------------
# end to end: publish -> worker -> sink -> audit; dlq replay
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from worker.demo.layout import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    if not (REPO_ROOT / "worker" / "service.py").exists():
        pytest.fail("worker/service.py does not exist: the end-to-end producer test needs the worker service "
                    "(python -m worker serve)", pytrace=False)
    from worker.process import spawn_worker

    with open(log, "ab") as f:          # the child keeps its own descriptor
        return spawn_worker(env, stdout=f, stderr=subprocess.STDOUT)


async def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode} before ready:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"worker not ready after {timeout}s:\n{log.read_text()[-4000:]}")


async def test_mixed_run_through_worker_sink_and_audit_is_complete(kafka_bootstrap, topic_factory, tiny_checkpoint,
                                                                   tmp_path):
    from producer_tools.audit import audit_run
    from producer_tools.cli import main

    req_t, res_t, dl_t = (await topic_factory(2, prefix="ereq"), await topic_factory(2, prefix="eres"),
                          await topic_factory(2, prefix="edl"))
    replay_t = await topic_factory(1, prefix="ereplay")
    store = tmp_path / "store"
    store.mkdir()
    port = _free_port()
    log = tmp_path / "worker.log"
    worker = _spawn_worker({
        "NIM_FT_CHECKPOINT": str(tiny_checkpoint), "NIM_MODEL_PROFILE": "bf16", "NIM_ALPAMAYO_TRAJ_SAMPLES": "1",
        "ALPAMAYO_DEVICE": "cpu", "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "ALPAMAYO_REQUEST_TOPIC": req_t, "ALPAMAYO_RESULT_TOPIC": res_t, "ALPAMAYO_DEAD_LETTER_TOPIC": dl_t,
        "ALPAMAYO_GROUP_ID": f"g-e2e-{uuid.uuid4().hex[:6]}", "ALPAMAYO_GROUP_INSTANCE_ID": "w-e2e",
        "ALPAMAYO_HTTP_HOST": "127.0.0.1", "ALPAMAYO_HTTP_PORT": str(port),
        "ALPAMAYO_MAX_REASONING_TOKENS": "4", "ALPAMAYO_MAX_BATCH_SIZE": "4", "ALPAMAYO_MAX_BATCH_WAIT_MS": "50",
        "ALPAMAYO_CLAIM_CHECK_ROOTS": f"file://{store}/", "ALPAMAYO_CACHE": str(tmp_path / "cache"),
        "ALPAMAYO_RESULT_FORMAT": "json", "ALPAMAYO_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}, log)
    try:
        kafka = KafkaOptions(bootstrap_servers=kafka_bootstrap, request_topic=req_t, result_topic=res_t,
                             dead_letter_topic=dl_t)
        run_id = f"e2e-{uuid.uuid4().hex[:6]}"
        runs = tmp_path / "runs"
        n_scenes = 3
        # requests of these 128x128 scenes are 22-33 KB: VQA and grounding (12 images) stay inline,
        # the trajectory-camera tasks (24 images) go through the object store
        opts = P.PublishOptions(tasks=list(S.TASKS), mix="all", run_id=run_id, runs_dir=str(runs), max_tokens=4,
                                object_store=f"file://{store}", claim_check_threshold=28_000, progress=False,
                                ground_truth=True)
        _, items = iter_synthetic(n_scenes, seed=40)
        s1 = await P.publish(kafka, items, opts, total_scenes=n_scenes)
        assert s1["published"] == n_scenes * 5 and 0 < s1["claim_checked"] < s1["published"]
        # a run of one request the deployment cannot serve (K=2, served K is 1) -> dead letter
        bad_run = f"{run_id}-k2"
        _, items = iter_synthetic(1, seed=40)
        s2 = await P.publish(kafka, items, P.PublishOptions(tasks=["trajectory"], k=2, temperature=0.6,
                                                            run_id=bad_run, runs_dir=str(runs), progress=False))
        assert s2["published"] == 1
        bad_id = P.request_id_for(bad_run, "synth-00000040", "trajectory", 2)
        await _wait_ready(f"http://127.0.0.1:{port}", worker, log)

        lake = tmp_path / "lake"
        sink_args = ["sink", "--lake", str(lake), "--bootstrap-servers", kafka_bootstrap, "--result-topic", res_t,
                     "--dead-letter-topic", dl_t, "--group-id", f"g-lake-{run_id}", "--rotate-rows", "4",
                     "--until-idle", "4", "--no-progress", "--samples", "--requests", "--request-topic", req_t]
        deadline = time.monotonic() + 150
        while True:
            p = _cli(*sink_args)
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err.decode()[-3000:]
            rep, bad = (audit_run(r, str(lake), runs_dir=str(runs)) for r in (run_id, bad_run))
            if "INCOMPLETE" not in (rep.verdict, bad.verdict):
                break
            assert worker.poll() is None, f"worker died:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"run incomplete: {rep.missing}\n{log.read_text()[-3000:]}"
        assert rep.published == rep.planned == n_scenes * 5 and rep.landed == rep.published
        assert rep.lake_duplicates == [] and rep.duplicated == {} and rep.unexpected == [] and rep.failed == []
        assert bad.failed == [bad_id] and bad.failed_codes == {"k_not_served": 1}
        assert main(["audit", run_id, "--lake", str(lake), "--runs-dir", str(runs)]) == 0       # COMPLETE
        assert main(["audit", bad_run, "--lake", str(lake), "--runs-dir", str(runs)]) == 1      # FAILED
        # ALPAMAYO_RESULT_FORMAT=json: plain JSON on both output topics, said so by the header
        for topic, n, rid in ((res_t, n_scenes * 5, run_id), (dl_t, 1, bad_run)):
            for rec in await _consume_all(kafka_bootstrap, topic, n):
                assert dict(rec.headers)["content-type"] == b"application/json"
                assert json.loads(rec.value)["run_id"] == rid
        # the requests table (ground truth on every request with ego history), then compaction
        reqs = {r["request_id"]: r for r in LK.read_lake(lake, "requests", run_id=run_id).to_pylist()}
        assert len(reqs) == rep.published
        assert LK.read_lake(lake, "requests", run_id=bad_run).to_pylist()[0]["temperature"] == 0.6
        assert all(len(r["ego_future_xyz"]) == 64 for r in reqs.values() if r["task"] in S.TASKS_NEEDING_EGOMOTION)
        n_files = len(_segment_files(lake))
        p = _cli("lake", "compact", "--lake", str(lake), "--group-id", f"g-lake-{run_id}",
                 "--bootstrap-servers", kafka_bootstrap)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-3000:]
        assert json.loads(out)["ranges_merged"] > 0 and len(_segment_files(lake)) < n_files
        rep = audit_run(run_id, str(lake), runs_dir=str(runs))
        assert rep.complete and rep.lake_duplicates == [] and rep.landed == rep.published
        results = LK.read_lake(lake, "results", run_id=run_id)
        samples = LK.read_lake(lake, "samples", run_id=run_id, columns=["request_id"]).column("request_id")
        assert sorted(set(samples.to_pylist())) == sorted(results.column("request_id").to_pylist())
        assert sorted(set(results.column("task").to_pylist())) == sorted(S.TASKS)
        traj = [r for r in results.to_pylist() if r["task"] == "trajectory"]
        assert all(len(r["pred_trajectories"]) == 1 and len(r["pred_trajectories"][0]) == 64 for r in traj)
        assert all(r["worker_id"] == "w-e2e" and r["request_topic"] == req_t for r in results.to_pylist())
        # the worker echoes each request's submitted_at into its result (a column of the results table)
        assert all(r["submitted_at"] == reqs[r["request_id"]]["submitted_at"] for r in results.to_pylist())
        dls = LK.read_lake(lake, "dead_letters", run_id=bad_run).to_pylist()
        assert [(d["request_id"], d["error_code"], d["error_field"]) for d in dls] == \
            [(bad_id, "k_not_served", "$.num_traj_samples")]

        # dlq replay (to a side topic): the ORIGINAL bytes, original key, lineage headers
        p = _cli("dlq", "replay", "--lake", str(lake), "--code", "k_not_served", "--run-id", bad_run,
                 "--to-topic", replay_t, "--runs-dir", str(runs), "--bootstrap-servers", kafka_bootstrap)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-3000:]
        assert json.loads(out)["replayed"] == 1
        rec = (await _consume_all(kafka_bootstrap, replay_t, 1))[0]
        assert rec.value == dls[0]["original_value"] and rec.key == bad_id.encode()
        hs = dict(rec.headers)
        assert hs["replay-of"] == f"{dl_t}:{dls[0]['kafka_partition']}:{dls[0]['kafka_offset']}".encode()
        assert hs["attempt"] == b"2" and hs["request-id"] == bad_id.encode()
        assert S.decode_request(rec.value, list(rec.headers)).request_id == bad_id
        p = _cli("dlq", "replay", "--from-topic", "--dead-letter-topic", dl_t, "--dry-run", "--runs-dir",
                 str(tmp_path / "other-runs"), "--bootstrap-servers", kafka_bootstrap)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-3000:]
        dry = json.loads(out)
        assert dry["available"] == 1 and [r["dead_letter"] for r in dry["records"]] == [hs["replay-of"].decode()]
        # the ledger keeps a second replay from repeating it
        p = _cli("dlq", "replay", "--lake", str(lake), "--code", "k_not_served", "--to-topic", replay_t,
                 "--runs-dir", str(runs), "--bootstrap-servers", kafka_bootstrap)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and json.loads(out)["already_replayed"] == 1, err.decode()[-3000:]
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
