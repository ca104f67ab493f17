"""Producer tools without a broker: request building, claim check, run manifests, the lake sink's
segmenting and crash recovery (driven record by record), audit, dlq selection, report, qualify.

The Kafka round trips (publish -> broker -> consume, the sink as a SIGKILLed subprocess, the
worker end to end) are in tests/test_producer_kafka.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import schemas as S
from producer_tools import audit as A
from producer_tools import claim_check as CC
from producer_tools import dlq as D
from producer_tools import lake as LK
from producer_tools import publish as P
from producer_tools import sink as K
from producer_tools.common import KafkaOptions, ToolError, parse_size
from producer_tools.run_manifest import RunManifest
from producer_tools.scene_sources import iter_manifest
from worker.scenes import generate_scene
from worker.scenes.request import scene_item

KAFKA = KafkaOptions(bootstrap_servers="127.0.0.1:1", request_topic="req", result_topic="res",
                     dead_letter_topic="dlq")


# --------------------------------------------------------------------------------------------
# builders shared with test_producer_kafka.py
# --------------------------------------------------------------------------------------------


def make_result(rid: str, run_id: str | None, i: int = 0, task: str = "trajectory", k: int = 1,
                spec: bool = True) -> S.InferResult:
    traj = [[[0.1 * t + j, 0.01 * t * (i % 5), 0.0] for t in range(64)] for j in range(k)] \
        if task in ("trajectory", "meta_action", "auto_labeling") else None
    rot = [[[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]] for _ in range(64)] for _ in range(k)] if traj else None
    acc = 20 + i % 7
    sd = S.SpeculativeDecoding(num_spec_tokens=7, num_spec_steps=10, num_draft_tokens=70, num_accepted_draft_tokens=acc,
                               draft_acceptance_rate=acc / 70, mean_acceptance_length=1 + acc / 10,
                               acceptance_histogram=[2, 2, 1, 1, 1, 1, 1, 1]) if spec and task == "trajectory" else None
    return S.InferResult(
        request_id=rid, run_id=run_id, task=task, labels={"scene_id": f"s{i}"}, num_samples=k,
        pred_trajectories=traj, pred_rotations=rot, answer="yes" if task == "vqa" else None,
        outputs=[S.SampleOutput(text=f"text {rid} {j}", cot="because",
                                meta_action=S.MetaAction(longitudinal="Keep speed") if task == "meta_action" else None,
                                boxes=[S.GroundingBox(bbox_2d=[1, 2, 3, 4], label="car")] if task == "grounding" else None)
                 for j in range(k)],
        metrics=S.ResultMetrics(reasoning_texts=["because"] * k, generated_tokens=[5] * k,
                                timings=S.StageTimings(total_ms=10.0 + i, decode_ms=5.0 + i % 3),
                                speculative_decoding=sd),
        model=S.ModelIdentity(id="nvidia/alpamayo-2-super", profile="bf16-dflash2", precision="bf16",
                              checkpoint_hash="abc", speculative_decoding="dflash2"),
        lineage=S.Lineage(topic="req", partition=0, offset=i, worker_id="w1"), completed_at=time.time())


def make_dead_letter(rid: str, run_id: str, code: S.ErrorCode = S.ErrorCode.INFERENCE_FAILED, i: int = 0,
                     attempt: int = 1) -> S.DeadLetter:
    value = f"original-bytes-{rid}".encode()
    return S.DeadLetter(request_id=rid, run_id=run_id, error_code=code, error_field="$", error_message="boom",
                        original_value=value, original_size=len(value), original_key=rid.encode(),
                        original_headers=[("content-type", b"application/msgpack"), ("attempt", b"7")],
                        source=S.SourceCoordinates(topic="req", partition=0, offset=i), attempt=attempt,
                        worker_id="w1", failed_at=time.time())


@dataclass
class Rec:
    """What the sink reads of an aiokafka ConsumerRecord."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes
    headers: tuple


def result_records(n: int, topic: str = "res", partition: int = 0, runs=("runA", "runB", "runC"),
                   gaps: bool = False) -> list[Rec]:
    out, off = [], 0
    for i in range(n):
        run = runs[i % len(runs)]
        rid = f"{run}:s{i}:trajectory:k1"
        v, h = S.encode_result(make_result(rid, run, i))
        out.append(Rec(topic, partition, off, 1_700_000_000_000 + i * 1000, rid.encode(), v, tuple(h)))
        off += 2 if gaps and i % 4 == 3 else 1       # transaction markers leave offset gaps
    return out


class FakeConsumer:
    """Stands in for AIOKafkaConsumer in the sink's record-level tests (commit/committed/seek)."""

    def __init__(self, committed: dict | None = None, fail_commit_at: int | None = None):
        self.committed_offsets = dict(committed or {})
        self.seeks: dict = {}
        self.commits = 0
        self.fail_commit_at = fail_commit_at

    async def commit(self, offsets):
        self.commits += 1
        if self.fail_commit_at is not None and self.commits >= self.fail_commit_at:
            raise Crash("killed before commit")
        self.committed_offsets.update(offsets)

    async def committed(self, tp):
        return self.committed_offsets.get(tp)

    def seek(self, tp, offset):
        self.seeks[tp] = offset

    async def position(self, tp):
        return 0


class Crash(BaseException):
    """A simulated SIGKILL (BaseException: nothing in the sink may swallow it)."""


def _tp(topic="res", partition=0):
    from aiokafka import TopicPartition

    return TopicPartition(topic, partition)


async def _sink_pass(lake: Path, records: list[Rec], consumer: FakeConsumer, rotate_rows: int,
                     crash_after_files: int | None = None, monkeypatch=None) -> K.LakeSink:
    """One sink process lifetime: assignment, records from the committed/seeked position, final flush."""
    sink = K.LakeSink(KAFKA, K.SinkOptions(lake=str(lake), rotate_rows=rotate_rows, rotate_seconds=1e9,
                                           progress=False))
    sink.consumer = consumer
    tp = _tp(records[0].topic, records[0].partition)
    written = [0]
    if crash_after_files is not None:
        real = K.atomic_write_bytes

        def counting(path, data):
            if written[0] >= crash_after_files:
                raise Crash("killed while writing")
            written[0] += 1
            return real(path, data)

        monkeypatch.setattr(K, "atomic_write_bytes", counting)
    try:
        await sink.on_assigned([tp])
        start = consumer.seeks.get(tp, consumer.committed_offsets.get(tp, 0))
        for r in records:
            if r.offset >= start:
                await sink._add(tp, sink.parts[tp], r)
        await sink._flush(tp, sink.parts[tp])
    finally:
        for p in sink.parts.values():
            sink._release(p)
        sink.parts.clear()
        if crash_after_files is not None:
            monkeypatch.setattr(K, "atomic_write_bytes", real)
    return sink


def _lake_offsets(lake: Path, table: str = "results") -> list[int]:
    return sorted(LK.read_lake(lake, table, columns=["kafka_offset"]).column("kafka_offset").to_pylist())


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scene():
    return generate_scene(7)


@pytest.mark.parametrize("task", S.TASKS)
def test_build_request_per_task_is_valid(scene, task):
    item = scene_item(scene)
    req = P.run_request(item, task, 1, "run-x", max_tokens=8)
    S.validate_request(req)
    assert req.request_id == f"run-x:{scene.scene_id}:{task}:k1"
    assert req.run_id == "run-x" and req.labels["scene_id"] == scene.scene_id
    assert req.temperature == 0.0 and req.num_traj_samples == 1
    if task == "vqa":
        assert req.images == scene.vqa_images and req.camera_order == scene.vqa_camera_order
        assert req.question == scene.text.vqa_question
    else:
        assert req.images == scene.images and req.camera_order == scene.camera_order
    assert (req.egomotion is not None) == (task in S.TASKS_NEEDING_EGOMOTION)
    assert (req.future_egomotion is not None) == (task == "auto_labeling")
    assert req.max_tokens == (None if task == "trajectory" else 8)
    value, headers = S.encode_request(req)
    back = S.decode_request(value, headers, k_values=[1])
    assert back.request_id == req.request_id
    assert S.request_warnings(back) == []


def test_build_request_k_and_sampling(scene):
    req = P.run_request(scene_item(scene), "trajectory", 3, "r", seed=5)
    assert req.num_traj_samples == 3 and req.temperature == 0.6 and req.seed == 5
    S.validate_request(req, k_values=[1, 3])


def test_request_ids_are_stable_and_checked():
    assert P.request_id_for("run-1", "synth-00000001", "vqa", 2) == "run-1:synth-00000001:vqa:k2"
    with pytest.raises(ToolError):
        P.request_id_for("run 1", "s", "vqa", 1)
    with pytest.raises(ToolError):
        P.request_id_for("r" * 120, "s" * 20, "trajectory", 1)


def test_plan_requests_mixes(scene):
    items = [scene_item(generate_scene(i)) for i in range(3)]
    allp = [(it.scene_id, t) for it, t in P.plan_requests(items, ["trajectory", "vqa"], "all")]
    assert len(allp) == 6 and allp[:2] == [(items[0].scene_id, "trajectory"), (items[0].scene_id, "vqa")]
    rr = [t for _, t in P.plan_requests(items, ["trajectory", "vqa"], "round-robin")]
    assert rr == ["trajectory", "vqa", "trajectory"]


def test_manifest_sources(tmp_path, scene):
    from worker.scenes import write_scene

    write_scene(scene, tmp_path / "a.msgpack")
    imgs = []
    for i, b in enumerate(scene.images):
        (tmp_path / f"img{i}.png").write_bytes(b)
        imgs.append(f"img{i}.png" if i % 2 else (tmp_path / f"img{i}.png").as_uri())
    rows = [{"scene_path": "a.msgpack", "task": ["trajectory", "vqa"]},
            {"scene_id": "raw-1", "images": imgs, "camera_order": scene.camera_order,
             "ego_history_xyz": scene.ego_history_xyz, "ego_history_rot": scene.ego_history_rot,
             "labels": {"city": "x"}, "task": "trajectory"}]
    man = tmp_path / "m.jsonl"
    man.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    n, items = iter_manifest(man)
    pairs = list(P.plan_requests(items, ["grounding"]))
    assert n == 2 and [t for _, t in pairs] == ["trajectory", "vqa", "trajectory"]
    raw = P.run_request(pairs[2][0], "trajectory", 1, "r")
    S.validate_request(raw)
    assert raw.images == scene.images and raw.labels == {"scene_id": "raw-1", "city": "x"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"scene_path": str(tmp_path / "a.msgpack")}]), tmp_path / "m.parquet")
    n, items = iter_manifest(tmp_path / "m.parquet")
    assert n == 1 and next(items).scene_id == scene.scene_id


# --------------------------------------------------------------------------------------------
# claim check
# --------------------------------------------------------------------------------------------


def test_claim_check_below_threshold_stays_inline(scene, tmp_path):
    req = P.run_request(scene_item(scene), "trajectory", 1, "r")
    value, headers, sent, moved = CC.encode_with_claim_check(req, 1 << 20, CC.ObjectStore(tmp_path))
    assert moved == 0 and sent is req and not any(tmp_path.rglob("*.png"))


def test_claim_check_threshold_and_sha(scene, tmp_path):
    req = P.run_request(scene_item(scene), "auto_labeling", 1, "r")
    full = len(S.encode_request(req)[0])
    threshold = full - sum(map(len, req.images)) // 3                  # about a third of the images must move
    store = CC.ObjectStore(f"file://{tmp_path}/store")
    value, headers, sent, moved = CC.encode_with_claim_check(req, threshold, store)
    size = len(value) + len(S.request_key(req)) + sum(len(k) + len(v) for k, v in headers)
    assert size <= threshold < full
    refs = [im for im in sent.images if isinstance(im, S.ImageRef)]
    assert len(refs) == moved > 0 and len(refs) < len(sent.images)        # only as many as needed
    for i, im in enumerate(sent.images):
        if isinstance(im, S.ImageRef):
            data = Path(im.uri[len("file://"):]).read_bytes()
            assert data == req.images[i] and im.size == len(data)
            assert im.sha256 == hashlib.sha256(data).hexdigest() and im.content_type == "image/png"
            assert im.uri.startswith(f"file://{tmp_path}/store/sha256/{im.sha256[:2]}/")
        else:
            assert im == req.images[i]
    decoded = S.decode_request(value, headers)
    assert CC.resolve_images(decoded) == list(req.images)
    # content addressed and idempotent: a second pass writes nothing new
    files = sorted(p.name for p in tmp_path.rglob("*.png"))
    CC.encode_with_claim_check(req, threshold, store)
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == files
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_claim_check_needs_a_store_and_detects_tampering(scene, tmp_path):
    req = P.run_request(scene_item(scene), "trajectory", 1, "r")
    with pytest.raises(ToolError, match="object-store"):
        CC.encode_with_claim_check(req, 1000, None)
    _, _, sent, _ = CC.encode_with_claim_check(req, 10_000, CC.ObjectStore(tmp_path))
    ref = next(im for im in sent.images if isinstance(im, S.ImageRef))
    Path(ref.uri[len("file://"):]).write_bytes(b"\x89PNG tampered")
    with pytest.raises(S.ContractError) as ei:
        CC.resolve_images(sent)
    assert ei.value.code == S.ErrorCode.CLAIM_CHECK_FAILED
    with pytest.raises(ToolError, match="still above"):
        CC.encode_with_claim_check(req, 100, CC.ObjectStore(tmp_path))


def test_parse_size():
    assert parse_size("900KiB") == 921600 and parse_size("1MiB") == 1 << 20 and parse_size("123") == 123


# --------------------------------------------------------------------------------------------
# run manifest
# --------------------------------------------------------------------------------------------


def test_run_manifest_resume_and_torn_line(tmp_path):
    m = RunManifest.for_run(tmp_path, "run-1")
    assert not m.exists
    m.open({"run_id": "run-1"})
    for i in range(3):
        m.append({"request_id": f"run-1:s{i}:trajectory:k1", "partition": 0, "offset": i})
    m.close()
    with open(m.path, "a") as f:
        f.write('{"kind":"published","request_id":"run-1:s9')        # crash mid-line
    m2 = RunManifest.for_run(tmp_path, "run-1")
    assert m2.exists and m2.run_id == "run-1"
    assert m2.published_ids() == {f"run-1:s{i}:trajectory:k1" for i in range(3)}
    m2.open({"run_id": "ignored"})
    m2.append({"request_id": "run-1:s3:trajectory:k1", "partition": 0, "offset": 3})
    m2.close()
    m3 = RunManifest.for_run(tmp_path, "run-1")
    assert len(m3.published_ids()) == 4
    assert sum(1 for line in m3.path.read_text().splitlines() if '"session"' in line) == 2


# --------------------------------------------------------------------------------------------
# sink: names, rows, segmenting, crash recovery
# --------------------------------------------------------------------------------------------


def test_segment_file_names_are_deterministic():
    name = LK.segment_file_name("alpamayo.results", 3, 120, 239)
    assert name == "alpamayo.results+3+120-239.parquet"
    assert LK.parse_segment_file_name(name) == ("alpamayo.results", 3, 120, 239)
    assert LK.parse_segment_file_name(".alpamayo.results+3+1-2.parquet.tmp-1-ab") is None
    assert LK.parse_segment_file_name("x+1+5.parquet") is None
    with pytest.raises(ValueError):
        LK.segment_file_name("a/b", 0, 1, 2)
    with pytest.raises(ValueError):
        LK.segment_file_name("t", 0, 5, 4)
    assert LK.hive_dir("/lake", "results", "run-1:a", "2025-01-02") == \
        Path("/lake/results/run_id=run-1%3Aa/date=2025-01-02")
    assert LK.hive_dir("/lake", "results", None, "2025-01-02").parent.name == f"run_id={LK.NULL_PARTITION}"


def test_result_and_dead_letter_rows_fit_the_fixed_schemas():
    rows = []
    for i, task in enumerate(S.TASKS):
        res = make_result(f"r:{task}", "r", i, task=task, k=2)
        v, h = S.encode_result(res)
        run, row = K.result_row(Rec("res", 0, i, 1_700_000_000_000, b"k", v, tuple(h)))
        assert run == "r" and row["decode_error"] is None
        rows.append(row)
    run, bad = K.result_row(Rec("res", 0, 9, 1_700_000_000_000, b"key-9", b"\xc1", ((S.HEADER_RUN_ID, b"r"),)))
    assert run == "r" and bad["request_id"] == "key-9" and "undecodable_bytes" in bad["decode_error"]
    tbl = K.rows_to_table(rows + [bad], "results")
    assert tbl.schema == LK.RESULT_SCHEMA
    traj = tbl.column("pred_trajectories")[0].as_py()
    assert len(traj) == 2 and len(traj[0]) == 64 and len(traj[0][0]) == 3
    assert tbl.column("spec_draft_acceptance_rate")[0].as_py() == pytest.approx(20 / 70)
    assert tbl.column("spec_num_spec_tokens").to_pylist()[1:5] == [None] * 4
    assert tbl.column("pred_rotations")[0].as_py()[0][0] == [1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0]
    dl = make_dead_letter("r:x", "r")
    v, h = S.encode_dead_letter(dl)
    run, row = K.dead_letter_row(Rec("dlq", 1, 4, 1_700_000_000_000, b"r:x", v, tuple(h)))
    t = K.rows_to_table([row], "dead_letters")
    assert t.schema == LK.DEAD_LETTER_SCHEMA
    assert t.column("error_code")[0].as_py() == "inference_failed" and t.column("retryable")[0].as_py()
    assert t.column("original_value")[0].as_py() == dl.original_value


async def test_sink_rotates_by_rows_per_partition_and_names_files_by_offsets(tmp_path):
    recs = result_records(20, gaps=True)
    consumer = FakeConsumer()
    sink = await _sink_pass(tmp_path, recs, consumer, rotate_rows=6)
    names = sorted({p.name for p in tmp_path.rglob("*.parquet")},
                   key=lambda n: LK.parse_segment_file_name(n)[2])
    offs = [r.offset for r in recs]
    want = [LK.segment_file_name("res", 0, offs[i], offs[min(i + 5, 19)]) for i in range(0, 20, 6)]
    assert names == want
    assert consumer.committed_offsets[_tp()] == offs[-1] + 1
    assert _lake_offsets(tmp_path) == offs
    assert sink.stats["rows_written"] == 20 and sink.stats["files_written"] == 3 * 3 + 2   # 3 runs per segment, 2 in the last
    t = LK.read_lake(tmp_path, "results", run_id="runB")
    assert t.num_rows == 7 and set(t.column("run_id").to_pylist()) == {"runB"}


@pytest.mark.parametrize("crash_after_files", [0, 1, 2, 3, 4, 5, 7, 8, 11])
@pytest.mark.parametrize("commit_fails", [False, True])
async def test_sink_crash_and_restart_never_duplicates_or_loses_rows(tmp_path, monkeypatch, crash_after_files,
                                                                     commit_fails):
    """Kill the sink after any number of data files (mid-segment, or files complete but offsets not
    committed), restart with DIFFERENT rotation boundaries: every record lands exactly once."""
    recs = result_records(30, gaps=True)
    tp = _tp()
    consumer = FakeConsumer(fail_commit_at=3 if commit_fails else None)
    with pytest.raises(Crash):
        await _sink_pass(tmp_path, recs, consumer, rotate_rows=4,
                         crash_after_files=crash_after_files if not commit_fails else None, monkeypatch=monkeypatch)
    before = _lake_offsets(tmp_path)
    assert len(before) < 30
    restart = FakeConsumer(committed=consumer.committed_offsets)
    sink = await _sink_pass(tmp_path, recs, restart, rotate_rows=7)       # other boundaries on purpose
    after = _lake_offsets(tmp_path)
    assert after == [r.offset for r in recs]                              # no duplicate, none missing
    assert restart.committed_offsets[tp] == recs[-1].offset + 1
    ranges = LK.scan_ranges(tmp_path, "results")[("res", 0)]
    LK.check_ranges("res", 0, ranges)                                      # segments never overlap
    if commit_fails:
        assert sink.stats["replayed_segments"] >= 1 and sink.stats["files_skipped"] >= 1
    # a third pass from scratch (offsets lost, e.g. a new group id) still adds nothing
    again = await _sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=5)
    assert _lake_offsets(tmp_path) == after and again.stats["rows_written"] == 0


async def test_sink_ignores_records_delivered_twice_within_an_assignment(tmp_path):
    recs = result_records(10)
    await _sink_pass(tmp_path, recs[:6] + recs[3:], FakeConsumer(), rotate_rows=4)   # a stale batch re-fetched
    assert _lake_offsets(tmp_path) == list(range(10))


async def test_sink_seeks_back_when_committed_offset_is_inside_a_segment(tmp_path):
    recs = result_records(12)
    await _sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=12)
    # one run's file lost, offsets reset into the middle of the segment by hand
    victim = next((tmp_path / "results").glob("run_id=runB/*/*.parquet"))
    victim.unlink()
    consumer = FakeConsumer(committed={_tp(): 5})
    await _sink_pass(tmp_path, recs, consumer, rotate_rows=3)
    assert consumer.seeks[_tp()] == 0
    assert _lake_offsets(tmp_path) == list(range(12))


async def test_sink_refuses_overlapping_segments(tmp_path):
    recs = result_records(6)
    await _sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=6)
    f = next(tmp_path.rglob("*.parquet"))
    f.rename(f.with_name(LK.segment_file_name("res", 0, 2, 9)))
    (f.parent / LK.segment_file_name("res", 0, 0, 4)).write_bytes(b"x")
    with pytest.raises(ToolError, match="overlapping"):
        await _sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=6)


# --------------------------------------------------------------------------------------------
# audit
# --------------------------------------------------------------------------------------------


async def _synthetic_lake(tmp_path: Path) -> tuple[Path, str, Path]:
    """Run 'aud' publishes 10 ids: s0..s5 have results (s2 twice: a redelivery), s6 and s7 are
    dead-lettered (s7 later replayed and succeeded), s8 and s9 never landed."""
    run = "aud"
    lake = tmp_path / "lake"
    ids = [f"{run}:s{i}:trajectory:k1" for i in range(10)]
    recs, off = [], 0
    for i in [0, 1, 2, 3, 4, 5, 2, 7]:
        v, h = S.encode_result(make_result(ids[i], run, i))
        recs.append(Rec("res", 0, off, 1_700_000_000_000 + off, ids[i].encode(), v, tuple(h)))
        off += 1
    v, h = S.encode_result(make_result("other:s0:trajectory:k1", "other", 0))
    recs.append(Rec("res", 0, off, 1_700_000_000_000, b"x", v, tuple(h)))
    await _sink_pass(lake, recs, FakeConsumer(), rotate_rows=4)
    dls = []
    for j, i in enumerate([6, 7]):
        v, h = S.encode_dead_letter(make_dead_letter(ids[i], run, S.ErrorCode.INFERENCE_FAILED, i))
        dls.append(Rec("dlq", 0, j, 1_700_000_000_000, ids[i].encode(), v, tuple(h)))
    await _sink_pass(lake, dls, FakeConsumer(), rotate_rows=4)
    m = RunManifest.for_run(tmp_path / "runs", run)
    m.open({"run_id": run})
    for i, rid in enumerate(ids):
        m.append({"request_id": rid, "partition": 0, "offset": i})
    m.close()
    return lake, run, tmp_path / "runs"


async def test_audit_reports_missing_failed_duplicated(tmp_path):
    lake, run, runs = await _synthetic_lake(tmp_path)
    rep = A.audit_run(run, str(lake), runs_dir=str(runs))
    assert rep.published == 10 and rep.landed == 8
    assert rep.missing == [f"{run}:s8:trajectory:k1", f"{run}:s9:trajectory:k1"]
    assert rep.failed == [f"{run}:s6:trajectory:k1"] and rep.failed_codes == {"inference_failed": 1}
    assert rep.recovered == [f"{run}:s7:trajectory:k1"]
    assert rep.duplicated == {f"{run}:s2:trajectory:k1": 2}
    assert rep.lake_duplicates == [] and rep.unexpected == []
    assert not rep.complete and rep.exit_code() == 1
    text = A.format_report(rep)
    assert "INCOMPLETE" in text and "missing   2" in text
    from producer_tools.cli import main

    assert main(["audit", run, "--lake", str(lake), "--runs-dir", str(runs)]) == 1
    # complete once the missing ids are not in the manifest; strict also fails on failures
    m = RunManifest.for_run(runs, run)
    keep = [r["request_id"] for r in m.records if not r["request_id"].endswith(("s8:trajectory:k1", "s9:trajectory:k1"))]
    results = LK.read_lake(lake, "results", run_id=run).to_pylist()
    dls = LK.read_lake(lake, "dead_letters", run_id=run).to_pylist()
    ok = A.reconcile(run, keep, results, dls)
    assert ok.complete and ok.exit_code() == 0 and ok.exit_code(strict=True) == 1
    dup = A.reconcile(run, keep, results + results[:1], dls)
    assert not dup.complete and len(dup.lake_duplicates) == 1
    with pytest.raises(ToolError, match="no run manifest"):
        A.audit_run("nope", str(lake), runs_dir=str(runs))


# --------------------------------------------------------------------------------------------
# dlq
# --------------------------------------------------------------------------------------------


async def test_dlq_selection_and_lineage_headers_from_the_lake(tmp_path):
    lake, run, runs = await _synthetic_lake(tmp_path)
    items = D.from_lake(str(lake))
    assert [d.request_id for d in items] == [f"{run}:s6:trajectory:k1", f"{run}:s7:trajectory:k1"]
    d = D.select(items, codes=["inference_failed"], request_ids=[f"{run}:s6:trajectory:k1"])[0]
    assert d.original_value == f"original-bytes-{run}:s6:trajectory:k1".encode() and d.retryable
    hs = dict(D.replay_headers(d))
    assert hs["replay-of"] == b"dlq:0:0" and hs["attempt"] == b"2"          # old attempt header replaced
    assert hs["replay-of-key"] == f"{run}:s6:trajectory:k1".encode()
    assert hs["content-type"] == b"application/msgpack"
    assert D.select(items, codes=["bad_image"]) == [] and len(D.select(items, run_ids=[run], limit=1)) == 1
    dry = await D.replay(KAFKA, items, runs_dir=str(runs), dry_run=True)
    assert dry["replayed"] == 0 and len(dry["records"]) == 2


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


async def test_report_over_a_lake(tmp_path):
    from PIL import Image

    from producer_tools.report import lake_report

    lake, run, _ = await _synthetic_lake(tmp_path)
    s = lake_report(str(lake), str(tmp_path / "rep"))
    assert s["results"] == 9 and s["dead_letters"] == 2 and s["dead_letters_by_code"] == {"inference_failed": 2}
    row = s["per_task"][0]
    assert row["task"] == "trajectory" and row["draft_acceptance_rate"] is not None
    for p in s["plots"].values():
        with Image.open(p) as im:
            assert im.size[0] > 100 and len(im.convert("RGB").getcolors(1 << 20)) > 2


# --------------------------------------------------------------------------------------------
# qualify (tiny random checkpoint, random head, CPU)
# --------------------------------------------------------------------------------------------


def test_qualify_tiny_random_checkpoint_makes_table_and_plots(tmp_path):
    from PIL import Image

    from producer_tools.qualify import QualifyOptions, qualify
    from worker.demo.layout import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "qual"
    s = qualify(QualifyOptions(out=str(out), checkpoint=str(ckpt), random_head=True, device="cpu", scenes=1,
                               tasks=list(S.TASKS), max_tokens=4, trajectory_max_new=10, progress=False))
    assert [r["task"] for r in s["tasks"]] == list(S.TASKS)
    for r in s["tasks"]:
        assert r["n"] == 1 and r["text_agreement"] == 1.0, r     # temperature 0: identical tokens and texts
        assert 0.0 <= r["agreement"] <= 1.0
        assert r["baseline_p50_ms"] > 0 and r["dflash2_p95_ms"] > 0 and r["speedup_p50"] > 0
        assert r["verdict"] in ("dflash2", "baseline")
    traj = s["tasks"][0]
    assert traj["speculative"] and traj["spec_steps"] > 0 and 0.0 <= traj["draft_acceptance_rate"] <= 1.0
    assert traj["mean_acceptance_length"] >= 1.0 and sum(traj["acceptance_histogram"]) == traj["spec_steps"]
    assert all(r["draft_acceptance_rate"] is None for r in s["tasks"][1:])
    assert traj["trajectory_max_diff_m"] is not None and s["tasks"][3]["trajectory_max_diff_m"] is None
    md = (out / "qualification.md").read_text()
    assert "| task | n | baseline p50 ms" in md and "| grounding | 1 |" in md and "Random (untrained) head" in md
    assert set(s["plots"]) == {"latency_cdf", "acceptance_histogram", "bev_trajectories", "bev_baseline"}
    for p in s["plots"].values():
        assert Path(p).stat().st_size > 1000
        with Image.open(p) as im:
            im.load()
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
            assert len(im.convert("RGB").getcolors(1 << 20)) > 2                 # not a blank canvas
    js = json.loads((out / "qualification.json").read_text())
    assert len(js["measurements"]) == 5 and js["meta"]["head_kind"] == "random"
    assert set(js["meta"]["warmup_ms"]) == set(S.TASKS)                          # one untimed warm-up per task


async def test_dedupe_read_keeps_the_earliest_record_of_each_request(tmp_path):
    """At-least-once re-deliveries (a second result record for a request, later in the log) are
    kept by the sink as the Kafka records they are, and removed by read_lake(dedupe=True)."""
    first = result_records(6)
    again = [first[1], first[4]]               # re-delivered later: same key and value, new offsets
    recs = first + [Rec(r.topic, r.partition, 6 + i, r.timestamp + 60_000, r.key, r.value, r.headers)
                    for i, r in enumerate(again)]
    await _sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=3)
    raw = LK.read_lake(tmp_path, "results", columns=["request_id", "kafka_offset"]).to_pylist()
    assert len(raw) == 8
    deduped = LK.read_lake(tmp_path, "results", columns=["request_id", "kafka_offset"], dedupe=True).to_pylist()
    assert sorted(r["request_id"] for r in deduped) == sorted({r.key.decode() for r in first})
    assert {r["request_id"]: r["kafka_offset"] for r in deduped} == {r.key.decode(): r.offset for r in first}
    one_run = LK.read_lake(tmp_path, "results", run_id="runB", dedupe=True)
    assert one_run.num_rows == 2 and "run_id" in one_run.column_names
