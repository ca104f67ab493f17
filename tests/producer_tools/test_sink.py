"""producer_tools.sink: rows of the fixed schemas, segments rotated by rows and named by offsets,
crash recovery (driven record by record): every record lands exactly once. The sink as a SIGKILLed
subprocess on a real broker: test_tools_on_kafka.py."""

import asyncio
import time

import pytest

import schemas as S
from producer_tools import lake as LK
from producer_tools import lake_tables as T
from producer_tools import sink as K
from producer_tools.common import ToolError

from tests.producer_tools.sink_harness import (KAFKA, Crash, FakeConsumer, Rec, lake_offsets, make_dead_letter, make_result,
                                               result_records, sink_pass, topic_partition)


def test_result_and_dead_letter_rows_fit_the_fixed_schemas():
    rows = []
    for i, task in enumerate(S.TASKS):
        res = make_result(f"r:{task}", "r", i, task=task, k=2)
        v, h = S.encode_result(res)
        [row] = T.result_rows(Rec("res", 0, i, 1_700_000_000_000, b"k", v, tuple(h)))
        assert row["run_id"] == "r" and row["scene_id"] == f"s{i}" and row["decode_error"] is None
        rows.append(row)
    [bad] = T.result_rows(Rec("res", 0, 9, 1_700_000_000_000, b"key-9", b"\xc1", ((S.HEADER_RUN_ID, b"r"),)))
    assert bad["run_id"] == "r" and bad["request_id"] == "key-9" and "undecodable_bytes" in bad["decode_error"]
    tbl = T.rows_to_table(rows + [bad], "results")
    assert tbl.schema == LK.RESULT_SCHEMA
    traj = tbl.column("pred_trajectories")[0].as_py()
    assert len(traj) == 2 and len(traj[0]) == 64 and len(traj[0][0]) == 3
    assert tbl.column("spec_draft_acceptance_rate")[0].as_py() == pytest.approx(20 / 70)
    assert tbl.column("spec_num_spec_tokens").to_pylist()[1:5] == [None] * 4
    assert tbl.column("pred_rotations")[0].as_py()[0][0] == [1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0]
    dl = make_dead_letter("r:x", "r")
    v, h = S.encode_dead_letter(dl)
    t = T.rows_to_table(T.dead_letter_rows(Rec("dlq", 1, 4, 1_700_000_000_000, b"r:x", v, tuple(h))), "dead_letters")
    assert t.schema == LK.DEAD_LETTER_SCHEMA
    assert t.column("error_code")[0].as_py() == "inference_failed" and t.column("retryable")[0].as_py()
    assert t.column("original_value")[0].as_py() == dl.original_value and t.column("run_id")[0].as_py() == "r"


async def test_sink_rotates_by_rows_per_partition_and_names_files_by_offsets(tmp_path):
    recs = result_records(20, gaps=True)
    consumer = FakeConsumer()
    sink = await sink_pass(tmp_path, recs, consumer, rotate_rows=6)
    names = sorted({p.name for p in tmp_path.rglob("*.parquet")},
                   key=lambda n: LK.parse_segment_file_name(n)[2])
    offs = [r.offset for r in recs]
    want = [LK.segment_file_name("res", 0, offs[i], offs[min(i + 5, 19)]) for i in range(0, 20, 6)]
    assert names == want
    assert consumer.committed_offsets[topic_partition()] == offs[-1] + 1
    assert lake_offsets(tmp_path) == offs
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
    tp = topic_partition()
    consumer = FakeConsumer(fail_commit_at=3 if commit_fails else None)
    with pytest.raises(Crash):
        await sink_pass(tmp_path, recs, consumer, rotate_rows=4,
                         crash_after_files=crash_after_files if not commit_fails else None, monkeypatch=monkeypatch)
    before = lake_offsets(tmp_path)
    assert len(before) < 30
    restart = FakeConsumer(committed=consumer.committed_offsets)
    sink = await sink_pass(tmp_path, recs, restart, rotate_rows=7)       # other boundaries on purpose
    after = lake_offsets(tmp_path)
    assert after == [r.offset for r in recs]                              # no duplicate, none missing
    assert restart.committed_offsets[tp] == recs[-1].offset + 1
    ranges = LK.scan_ranges(tmp_path, "results")[("res", 0)]
    LK.check_ranges("res", 0, ranges)                                      # segments never overlap
    if commit_fails:
        assert sink.stats["replayed_segments"] >= 1 and sink.stats["files_skipped"] >= 1
    # a third pass from scratch (offsets lost, e.g. a new group id) still adds nothing
    again = await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=5)
    assert lake_offsets(tmp_path) == after and again.stats["rows_written"] == 0


async def test_sink_ignores_records_delivered_twice_within_an_assignment(tmp_path):
    recs = result_records(10)
    await sink_pass(tmp_path, recs[:6] + recs[3:], FakeConsumer(), rotate_rows=4)   # a stale batch re-fetched
    assert lake_offsets(tmp_path) == list(range(10))


async def test_sink_seeks_back_when_committed_offset_is_inside_a_segment(tmp_path):
    recs = result_records(12)
    await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=12)
    # one run's file lost, offsets reset into the middle of the segment by hand
    victim = next((tmp_path / "results").glob("run_id=runB/*/*.parquet"))
    victim.unlink()
    consumer = FakeConsumer(committed={topic_partition(): 5})
    await sink_pass(tmp_path, recs, consumer, rotate_rows=3)
    assert consumer.seeks[topic_partition()] == 0
    assert lake_offsets(tmp_path) == list(range(12))


async def test_sink_refuses_overlapping_segments(tmp_path):
    recs = result_records(6)
    await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=6)
    f = next(tmp_path.rglob("*.parquet"))
    f.rename(f.with_name(LK.segment_file_name("res", 0, 2, 9)))
    (f.parent / LK.segment_file_name("res", 0, 0, 4)).write_bytes(b"x")
    index = LK.range_index_path(tmp_path, "res", 0)
    index.unlink()                              # files copied in by hand: the index is rebuilt by a scan
    with pytest.raises(ToolError, match="overlapping"):
        await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=6)
    index.write_text("0 4\n2 9\n")
    with pytest.raises(ToolError, match="overlapping"):
        await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=6)


@pytest.mark.parametrize("cut", ["revoked", "shutdown"])
async def test_a_replay_cut_short_writes_and_commits_nothing(tmp_path, cut):
    """Segment 0-11 crashed before its run-B file; the next owner reads 0-4 of it and is revoked
    (or stopped): nothing is written under the range's name, no offset is committed, and a third
    sink finishes the range: every record once."""
    recs = result_records(12)
    tp = topic_partition()
    await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=12)
    next((tmp_path / "results").glob("run_id=runB/*/*.parquet")).unlink()
    second = FakeConsumer(committed={tp: 0})
    sink = K.LakeSink(KAFKA, K.SinkOptions(lake=str(tmp_path), rotate_seconds=1e9, progress=False))
    sink.consumer = second
    await sink.on_assigned([tp])
    for r in recs[:5]:
        await sink._add(tp, sink.parts[tp], r)
    if cut == "revoked":
        await sink.on_revoked([tp])
    else:
        await sink._flush(tp, sink.parts[tp])
        sink._release(sink.parts.pop(tp))
    assert second.committed_offsets[tp] == 0 and sink.stats["replays_left"] == 1
    assert not list((tmp_path / "results").glob("run_id=runB/*/*.parquet"))
    assert lake_offsets(tmp_path) == [o for o in range(12) if o % 3 != 1]
    third = await sink_pass(tmp_path, recs, FakeConsumer(committed=second.committed_offsets), rotate_rows=5)
    assert lake_offsets(tmp_path) == list(range(12)) and third.stats["replayed_segments"] == 1


async def test_assignment_reads_the_range_index_not_the_lake(tmp_path, monkeypatch):
    recs = result_records(12)
    await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=4)
    assert LK.read_range_index(tmp_path, "res", 0) == [(0, 3), (4, 7), (8, 11)]

    def no_scan(*_a):
        raise AssertionError("the lake was scanned on assignment")

    monkeypatch.setattr(K, "scan_ranges", no_scan)
    next((tmp_path / "results").glob("run_id=runC/*/*.parquet")).unlink()     # a lost file is still replayed
    again = await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=5)
    assert lake_offsets(tmp_path) == list(range(12)) and again.stats["replayed_segments"] == 3


async def test_writing_a_large_segment_leaves_the_event_loop_free(tmp_path):
    """Decoding and encoding 600 K=3 rows takes seconds of CPU: a coroutine ticking every 5 ms
    (as aiokafka's heartbeat task does) is never held up for more than half of that (on the loop,
    it would wait for the whole segment)."""
    recs = result_records(600, k=3)
    tp = topic_partition()
    sink = K.LakeSink(KAFKA, K.SinkOptions(lake=str(tmp_path), rotate_rows=10**6, rotate_seconds=1e9,
                                           progress=False))
    sink.consumer = FakeConsumer()
    await sink.on_assigned([tp])
    for r in recs:
        await sink._add(tp, sink.parts[tp], r)
    gaps, writing = [], [True]

    async def heartbeat():
        while writing[0]:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            gaps.append(time.monotonic() - t - 0.005)

    beat = asyncio.ensure_future(heartbeat())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await sink._flush(tp, sink.parts[tp])
    took = time.monotonic() - t0
    writing[0] = False
    await beat
    sink._release(sink.parts.pop(tp))
    assert lake_offsets(tmp_path) == list(range(600))
    print(f"segment written in {took:.2f}s; loop's longest gap {max(gaps) * 1000:.0f} ms over {len(gaps)} ticks")
    assert took > 0.5, "the segment is too small to show anything"
    # on the loop, one gap would span the whole write; off it, the longest gap is what a busy
    # 2-core machine makes of the thread's GIL slices (85 ms idle, 540 ms once under a full suite)
    assert max(gaps) < took / 2
