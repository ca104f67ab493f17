"""producer_tools.lake: segment file names and partition directories, the deduplicating read."""

from pathlib import Path

import pytest

from producer_tools import lake as LK
from producer_tools.common import ToolError

from tests.producer_tools.sink_harness import FakeConsumer, Rec, result_records, sink_pass


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


async def test_dedupe_read_keeps_the_earliest_record_of_each_request(tmp_path):
    """At-least-once re-deliveries (a second result record for a request, later in the log) are
    kept by the sink as the Kafka records they are, and removed by read_lake(dedupe=True)."""
    first = result_records(6)
    again = [first[1], first[4]]               # re-delivered later: same key and value, new offsets
    recs = first + [Rec(r.topic, r.partition, 6 + i, r.timestamp + 60_000, r.key, r.value, r.headers)
                    for i, r in enumerate(again)]
    await sink_pass(tmp_path, recs, FakeConsumer(), rotate_rows=3)
    raw = LK.read_lake(tmp_path, "results", columns=["request_id", "kafka_offset"]).to_pylist()
    assert len(raw) == 8
    deduped = LK.read_lake(tmp_path, "results", columns=["request_id", "kafka_offset"], dedupe=True).to_pylist()
    assert sorted(r["request_id"] for r in deduped) == sorted({r.key.decode() for r in first})
    assert {r["request_id"]: r["kafka_offset"] for r in deduped} == {r.key.decode(): r.offset for r in first}
    one_run = LK.read_lake(tmp_path, "results", run_id="runB", dedupe=True)
    assert one_run.num_rows == 2 and "run_id" in one_run.column_names


def test_range_index_ignores_and_repairs_an_append_torn_by_a_crash(tmp_path):
    assert LK.read_range_index(tmp_path, "res", 0) is None
    LK.append_range(tmp_path, "res", 0, 0, 3)
    LK.append_range(tmp_path, "res", 0, 4, 9)
    path = LK.range_index_path(tmp_path, "res", 0)
    path.write_text(path.read_text() + "10 1")              # killed mid-append: no file of it exists
    assert LK.read_range_index(tmp_path, "res", 0) == [(0, 3), (4, 9)]
    assert LK.read_range_index(tmp_path, "res", 0, repair=True) == [(0, 3), (4, 9)]
    LK.append_range(tmp_path, "res", 0, 10, 12)
    assert path.read_text() == "0 3\n4 9\n10 12\n"
    path.write_text("0 3\nx\n")
    with pytest.raises(ToolError, match="line 2"):
        LK.read_range_index(tmp_path, "res", 0)
