"""producer_tools.calibration (``qualify --uncertainty``): AUROC and Spearman against hand-computed
values, and a short run on a tiny random checkpoint (the table, the JSON, the K=1 refusal)."""

import json

import pytest

from producer_tools.calibration import CalibrationOptions, auroc, calibrate, spearman
from producer_tools.cli import main
from producer_tools.common import ToolError
from worker.demo.layout import write_random_checkpoint


def test_auroc_and_spearman():
    assert auroc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [True, False, False]) == 0.5            # ties count half
    assert auroc([0.9, 0.3, 0.5, 0.1], [True, False, True, False]) == 1.0
    assert auroc([0.9, 0.6, 0.5, 0.1], [True, False, True, False]) == 0.75   # 3 of 4 pairs ordered
    assert auroc([0.1, 0.2], [True, True]) is None                      # one class only
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 5]) is None


def test_short_calibration_on_a_tiny_checkpoint(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    s = calibrate(CalibrationOptions(out=str(tmp_path / "cal"), checkpoint=str(ckpt), device="cpu", scenes=4,
                                     ks=(2, 6), progress=False, trajectory_max_new=4))
    assert [r["k"] for r in s["per_k"]] == [2, 6] and all(r["scenes"] == 4 for r in s["per_k"])
    for r in s["per_k"]:
        assert r["auroc"] is None or 0.0 <= r["auroc"] <= 1.0
        assert 0.0 <= r["mean_uncertainty"] <= 1.0 and r["mean_min_ade_m"] >= 0.0
    assert s["per_k"][0]["meets_bar"] is None and s["per_k"][1]["meets_bar"] in (True, False)
    rows = s["scenes"]["6"]
    assert len(rows) == 4 and all(0.0 <= r["uncertainty"] <= 1.0 and r["lateral_spread_m"] >= 0 for r in rows)
    md = (tmp_path / "cal" / "uncertainty_calibration.md").read_text()
    assert "| K | scenes | minADE > 2 m |" in md and "| 6 | 4 |" in md
    assert json.loads((tmp_path / "cal" / "uncertainty_calibration.json").read_text())["meta"]["bar_k"] == 6
    with pytest.raises(ToolError, match="K >= 2"):
        calibrate(CalibrationOptions(out=str(tmp_path / "x"), checkpoint=str(ckpt), ks=(1, 3), progress=False))


def test_cli_prints_the_table_and_fails_below_the_bar(tmp_path, capsys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    code = main(["qualify", "--uncertainty", "--checkpoint", str(ckpt), "--device", "cpu", "--scenes", "3",
                 "--ks", "2", "--trajectory-max-new", "4", "--out", str(tmp_path / "q"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "| 2 | 3 |" in out and "uncertainty_calibration.md" in out     # no K=6 row: no bar
