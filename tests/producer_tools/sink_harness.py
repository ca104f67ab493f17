"""Results, dead letters and Kafka records built by hand, and the lake sink driven through them
record by record (no broker): what the producer tools' tests share.

``sink_pass`` is one sink process lifetime (assignment, records from the committed or seeked
position, final flush), optionally killed (:class:`Crash`) after a number of data files;
``synthetic_lake`` lands a small run with results, a redelivery, dead letters and gaps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka import TopicPartition

import schemas as S
from producer_tools import lake as LK
from producer_tools import sink as K
from producer_tools.common import KafkaOptions
from producer_tools.run_manifest import RunManifest

KAFKA = KafkaOptions(bootstrap_servers="127.0.0.1:1", request_topic="req", result_topic="res",
                     dead_letter_topic="dlq")


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
                   gaps: bool = False, k: int = 1) -> list[Rec]:
    out, off = [], 0
    for i in range(n):
        run = runs[i % len(runs)]
        rid = f"{run}:s{i}:trajectory:k{k}"
        v, h = S.encode_result(make_result(rid, run, i, k=k))
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


def topic_partition(topic="res", partition=0):
    return TopicPartition(topic, partition)


async def sink_pass(lake: Path, records: list[Rec], consumer: FakeConsumer, rotate_rows: int,
                    crash_after_files: int | None = None, monkeypatch=None, **opts) -> K.LakeSink:
    """One sink process lifetime: assignment, records from the committed/seeked position, final flush.
    ``opts``: more SinkOptions (include_samples, include_requests)."""
    sink = K.LakeSink(KAFKA, K.SinkOptions(lake=str(lake), rotate_rows=rotate_rows, rotate_seconds=1e9,
                                           progress=False, **opts))
    sink.consumer = consumer
    tp = topic_partition(records[0].topic, records[0].partition)
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


def lake_offsets(lake: Path, table: str = "results") -> list[int]:
    return sorted(LK.read_lake(lake, table, columns=["kafka_offset"]).column("kafka_offset").to_pylist())


async def synthetic_lake(tmp_path: Path) -> tuple[Path, str, Path]:
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
    await sink_pass(lake, recs, FakeConsumer(), rotate_rows=4)
    dls = []
    for j, i in enumerate([6, 7]):
        v, h = S.encode_dead_letter(make_dead_letter(ids[i], run, S.ErrorCode.INFERENCE_FAILED, i))
        dls.append(Rec("dlq", 0, j, 1_700_000_000_000, ids[i].encode(), v, tuple(h)))
    await sink_pass(lake, dls, FakeConsumer(), rotate_rows=4)
    m = RunManifest.for_run(tmp_path / "runs", run)
    m.open({"run_id": run})
    for i, rid in enumerate(ids):
        m.append({"request_id": rid, "partition": 0, "offset": i})
    m.close()
    return lake, run, tmp_path / "runs"
