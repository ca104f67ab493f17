"""producer_tools.report: per-task figures and plots over a lake."""

import msgspec
import pytest
from PIL import Image

import schemas as S
from producer_tools.cli import main
from producer_tools.publish import run_request
from producer_tools.report import _min_ade, lake_report
from producer_tools.scene_sources import iter_synthetic
from worker.scenes import generate_scene
from worker.scenes.request import build_request

from tests.producer_tools.sink_harness import FakeConsumer, Rec, make_result, sink_pass, synthetic_lake


async def test_report_over_a_lake(tmp_path):
    lake, run, _ = await synthetic_lake(tmp_path)
    s = lake_report(str(lake), str(tmp_path / "rep"))
    assert s["results"] == 9 and s["dead_letters"] == 2 and s["dead_letters_by_code"] == {"inference_failed": 2}
    row = s["per_task"][0]
    assert row["task"] == "trajectory" and row["draft_acceptance_rate"] is not None
    for p in s["plots"].values():
        with Image.open(p) as im:
            assert im.size[0] > 100 and len(im.convert("RGB").getcolors(1 << 20)) > 2


def test_a_missing_lake_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--lake", str(tmp_path / "typo"), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.count("\n") == 1 and "typo" in err and "--lake" in err
    assert not (tmp_path / "rep").exists()


async def test_an_earlier_report_is_kept_unless_forced(tmp_path, capsys):
    lake, _, _ = await synthetic_lake(tmp_path)
    out = tmp_path / "rep"
    assert main(["report", "--lake", str(lake), "--out", str(out)]) == 0
    (out / "report.md").write_text("earlier")
    with pytest.raises(SystemExit) as e:
        main(["report", "--lake", str(lake), "--out", str(out)])
    assert e.value.code != 0 and "--force" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "earlier"
    assert main(["report", "--lake", str(lake), "--out", str(out), "--force"]) == 0
    assert (out / "report.md").read_text() != "earlier"


async def test_groups_by_task_k_and_temperature_with_queue_apart_and_captions(tmp_path):
    """Greedy K=1 and sampled K=3 results are separate groups (temperature from the requests table),
    queue time apart from compute, every plot captioned in report.md."""
    lake = tmp_path / "lake"
    req_recs, res_recs = [], []
    for i in range(8):
        k, temp = (1, 0.0) if i % 2 else (3, 0.6)
        req = build_request(generate_scene(i, (64, 64)), "trajectory", k, request_id=f"r{i}", run_id="rk",
                            temperature=temp)
        req_recs.append(Rec("req", 0, i, 1_700_000_000_000, req.request_id.encode(), *S.encode_request(req)))
        res = make_result(f"r{i}", "rk", i, k=k)
        timings = msgspec.structs.replace(res.metrics.timings, queue_ms=100.0, total_ms=130.0 + k)
        res = msgspec.structs.replace(res, metrics=msgspec.structs.replace(res.metrics, timings=timings))
        res_recs.append(Rec("res", 0, i, 1_700_000_000_000, req.request_id.encode(), *S.encode_result(res)))
    await sink_pass(lake, req_recs, FakeConsumer(), rotate_rows=10, include_requests=True)
    await sink_pass(lake, res_recs, FakeConsumer(), rotate_rows=10)
    s = lake_report(str(lake), str(tmp_path / "rep"))
    groups = {(r["task"], r["k"], r["temperature"]): r for r in s["per_task"]}
    assert set(groups) == {("trajectory", 1, "0"), ("trajectory", 3, "0.6")}
    assert groups[("trajectory", 1, "0")]["queue_p50_ms"] == 100.0
    assert groups[("trajectory", 3, "0.6")]["compute_p50_ms"] == 33.0
    md = (tmp_path / "rep" / "report.md").read_text()
    for name in s["plots"]:
        assert f"![{name}]({name}.png)" in md and f"*{name}*: " in md
    assert "| trajectory | 3 | 0.6 |" in md


def test_min_ade_is_the_best_of_k_average_displacement():
    truth = [[float(t), 0.0, 0.0] for t in range(64)]
    pred = [[[float(t) + 3.0, 0.0, 0.0] for t in range(64)], [[float(t), 1.0, 5.0] for t in range(64)]]
    assert _min_ade(pred, truth) == 1.0                      # sample 1: 1 m sideways (z ignored)
    assert _min_ade(pred, None) is None and _min_ade(None, truth) is None


async def test_uncertainty_section_and_error_against_uncertainty(tmp_path):
    """Results with K >= 2 carry `uncertainty`: report.md has its per-group p50/p90 and a captioned
    plot of its distribution and of best-of-K ADE against it (ground truth from the requests)."""
    lake = tmp_path / "lake"
    req_recs, res_recs = [], []
    for i, item in enumerate(iter_synthetic(4, seed=3)[1]):
        req = run_request(item, "trajectory", 3, "ru", temperature=0.6, ground_truth=True)
        req_recs.append(Rec("req", 0, i, 1_700_000_000_000, req.request_id.encode(), *S.encode_request(req)))
        res = msgspec.structs.replace(make_result(req.request_id, "ru", i, k=3),
                                      uncertainty=S.Uncertainty(uncertainty=0.2 * (i + 1)))
        res_recs.append(Rec("res", 0, i, 1_700_000_000_000, req.request_id.encode(), *S.encode_result(res)))
    await sink_pass(lake, req_recs, FakeConsumer(), rotate_rows=10, include_requests=True)
    await sink_pass(lake, res_recs, FakeConsumer(), rotate_rows=10)
    s = lake_report(str(lake), str(tmp_path / "rep"))
    [row] = s["per_task"]
    assert row["with_uncertainty"] == 4 and abs(row["uncertainty_p50"] - 0.5) < 1e-9
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Uncertainty (results with K >= 2)" in md and "| trajectory | 3 | 0.6 | bf16-dflash2 | 4 | 0.500 |" in md
    assert "![uncertainty](uncertainty.png)" in md and "*uncertainty*: " in md
    with Image.open(s["plots"]["uncertainty"]) as im:
        assert len(im.convert("RGB").getcolors(1 << 20)) > 2
