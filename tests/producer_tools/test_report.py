"""producer_tools.report: per-task figures and plots over a lake."""

from PIL import Image

from producer_tools.report import lake_report

from tests.producer_tools.sink_harness import synthetic_lake


async def test_report_over_a_lake(tmp_path):
    lake, run, _ = await synthetic_lake(tmp_path)
    s = lake_report(str(lake), str(tmp_path / "rep"))
    assert s["results"] == 9 and s["dead_letters"] == 2 and s["dead_letters_by_code"] == {"inference_failed": 2}
    row = s["per_task"][0]
    assert row["task"] == "trajectory" and row["draft_acceptance_rate"] is not None
    for p in s["plots"].values():
        with Image.open(p) as im:
            assert im.size[0] > 100 and len(im.convert("RGB").getcolors(1 << 20)) > 2
