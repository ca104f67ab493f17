"""producer_tools.dlq: dead letters selected from the lake, replayed with lineage headers."""

from producer_tools import dlq as D

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
