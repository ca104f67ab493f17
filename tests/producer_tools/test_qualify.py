"""producer_tools.qualify: baseline against DFlash2 on a tiny random checkpoint and random head (CPU):
the table, the JSON and the plots."""

import json
from pathlib import Path

from PIL import Image

import schemas as S
from producer_tools.qualify import QualifyOptions, qualify
from worker.demo.layout import write_random_checkpoint


def test_qualify_tiny_random_checkpoint_makes_table_and_plots(tmp_path):
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
