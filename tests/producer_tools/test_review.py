"""producer_tools.review: the doubtful results of a lake's run, with the uncertainty the worker
computes, most doubtful first, and a bird's-eye plot each (ground truth when the scene is known)."""

import msgspec
from PIL import Image

import schemas as S
from producer_tools.review import review_run
from worker.uncertainty import uncertainty_block

from tests.producer_tools.sink_harness import FakeConsumer, Rec, make_result, sink_pass

SPREADS = {"synth-00000007": 3.0, "unknown-scene": 1.5, "s2": 0.2, "s3": 0.0}   # lateral metres between samples


def _records() -> list[Rec]:
    out = []
    for i, (scene_id, spread) in enumerate(SPREADS.items()):
        rid = f"rev:{scene_id}:trajectory:k3"
        traj = [[[0.5 * t, spread * j, 0.0] for t in range(64)] for j in range(3)]
        res = msgspec.structs.replace(make_result(rid, "rev", i, k=3), labels={"scene_id": scene_id},
                                      pred_trajectories=traj)
        v, h = S.encode_result(res)
        out.append(Rec("res", 0, i, 1_700_000_000_000 + i, rid.encode(), v, tuple(h)))
    v, h = S.encode_result(make_result("rev:k1:trajectory:k1", "rev", 9, k=1))      # K = 1: never doubtful
    return out + [Rec("res", 0, len(out), 1_700_000_000_100, b"k1", v, tuple(h))]


async def test_review_lists_the_doubtful_results_and_plots_them(tmp_path):
    lake = tmp_path / "lake"
    await sink_pass(lake, _records(), FakeConsumer(), rotate_rows=100)
    s = review_run(str(lake), str(tmp_path / "review"), run_id="rev", threshold=0.5)
    want = {sid: uncertainty_block([[[0.5 * t, sp * j, 0.0] for t in range(64)] for j in range(3)])["uncertainty"]
            for sid, sp in SPREADS.items()}
    doubtful = [sid for sid, u in sorted(want.items(), key=lambda kv: -kv[1]) if u >= 0.5]
    assert doubtful == ["synth-00000007", "unknown-scene"]
    assert [d["scene_id"] for d in s["results"]] == doubtful and s["doubtful"] == 2
    assert [d["uncertainty"] for d in s["results"]] == [want[sid] for sid in doubtful]
    assert [d["ground_truth"] for d in s["results"]] == [True, False]      # synth-<seed> is regenerated
    for d in s["results"]:
        with Image.open(tmp_path / "review" / d["plot"]) as im:
            assert im.size[0] > 100 and len(im.convert("RGB").getcolors(1 << 20)) > 2
    assert "| synth-00000007 |" in (tmp_path / "review" / "review.md").read_text()
    assert review_run(str(lake), str(tmp_path / "all"), run_id="rev", threshold=0.0)["doubtful"] == 4   # K=1: none
