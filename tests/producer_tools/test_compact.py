"""``lake compact``: many small segment files become few, every row once, only finished ranges
(below the sink group's committed offset), the range index swapped under the sink's index lock so
that a later replay writes nothing twice; a compaction cut short is finished by the next one and
readers never see a row twice meanwhile. On a real broker: test_tools_on_kafka.py (end to end)."""

import pytest

from producer_tools import compact as C
from producer_tools import lake as LK

from tests.producer_tools.sink_harness import Crash, FakeConsumer, lake_offsets, result_records, sink_pass, topic_partition


def _files(lake, table="results"):
    return sorted(p.name for p in (lake / table).rglob("*.parquet"))


async def test_compaction_merges_finished_ranges_and_a_replay_after_it_writes_nothing(tmp_path):
    lake = tmp_path / "lake"
    recs = result_records(30)
    consumer = FakeConsumer()
    await sink_pass(lake, recs[:24], consumer, rotate_rows=3, include_samples=True)
    committed = consumer.committed_offsets[topic_partition()]
    assert committed == 24 and len(_files(lake)) == 8 * 3            # 8 segments x 3 runs
    before = LK.read_lake(lake, "results").sort_by("kafka_offset")
    stats = C.compact_lake(lake, {("res", 0): committed - 3}, target_rows=24)   # last range unfinished
    # ranges 0-20 finished, merged by 24 rows (results + samples): 0-11, 12-20 (+ 21-23 untouched)
    assert LK.read_range_index(lake, "res", 0) == [(0, 11), (12, 20), (21, 23)]
    assert {LK.parse_segment_file_name(n)[2:] for n in _files(lake)} == {(0, 11), (12, 20), (21, 23)}
    assert _files(lake, "samples") and {LK.parse_segment_file_name(n)[2:] for n in _files(lake, "samples")} == \
        {(0, 11), (12, 20), (21, 23)}
    assert stats["files_after"] < stats["files_before"] and stats["ranges_merged"] == 7
    assert LK.read_lake(lake, "results").sort_by("kafka_offset").equals(before)
    assert lake_offsets(lake, "samples") == [o for r in recs[:24] for o in (r.offset,)]
    # a sink with its offsets reset replays every range with its bounds, then goes on: nothing twice
    again = await sink_pass(lake, recs, FakeConsumer(), rotate_rows=3, include_samples=True)
    assert again.stats["files_skipped"] > 0 and lake_offsets(lake) == [r.offset for r in recs]
    assert C.compact_lake(lake, {("res", 0): 30})["ranges_merged"] == 5      # 0-11, 12-20, 21-23, 24-26, 27-29


async def test_a_compaction_cut_short_is_invisible_to_readers_and_finished_by_the_next(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    recs = result_records(12)
    await sink_pass(lake, recs, FakeConsumer(), rotate_rows=2)
    want = lake_offsets(lake)

    def killed(*a, **kw):
        raise Crash("killed before the index swap")

    monkeypatch.setattr(C, "merge_ranges", killed)
    with pytest.raises(Crash):
        C.compact_lake(lake, {("res", 0): 12})
    monkeypatch.undo()
    assert any(LK.parse_segment_file_name(n)[2:] == (0, 11) for n in _files(lake))    # merged, not listed
    assert lake_offsets(lake) == want                                                 # read once anyway
    assert LK.scan_ranges(lake, "results")[("res", 0)] == [(0, 11)]                   # a rebuilt index: no overlap
    stats = C.compact_lake(lake, {("res", 0): 12})
    assert stats["unfinished_merges_removed"] == 3 and stats["ranges_merged"] == 6
    assert LK.read_range_index(lake, "res", 0) == [(0, 11)] and lake_offsets(lake) == want
    assert {LK.parse_segment_file_name(n)[2:] for n in _files(lake)} == {(0, 11)}


def test_no_committed_offset_means_nothing_is_finished(tmp_path):
    LK.append_range(tmp_path, "res", 0, 0, 4)
    assert C.compact_lake(tmp_path, {})["partitions_without_commit"] == 1
