"""producer_tools.dlq: dead letters selected from the lake, replayed with lineage headers."""

import json

from producer_tools import dlq as D
from producer_tools.cli import main

from tests.producer_tools.sink_harness import KAFKA, synthetic_lake


async def test_dlq_selection_and_lineage_headers_from_the_lake(tmp_path):
    lake, run, runs = await synthetic_lake(tmp_path)
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


async def test_dlq_list_counts_codes_with_a_sample_retryable_and_replayed(tmp_path, capsys):
    lake, run, runs = await synthetic_lake(tmp_path)
    (runs / "dlq-replays.jsonl").write_text('{"dead_letter": "dlq:0:1"}\n')          # s7 was replayed
    assert main(["dlq", "list", "--lake", str(lake), "--runs-dir", str(runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["code", "count", "retryable", "replayed", "sample", "message"]
    assert lines[1].split() == ["inference_failed", "2", "yes", "1", "boom"]
    assert lines[-1] == "2 dead letters, 1 codes"
    assert main(["dlq", "list", "--lake", str(lake), "--runs-dir", str(runs), "--run-id", "other", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
