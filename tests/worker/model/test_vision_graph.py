"""The vision tower replayed as a CUDA graph per image grid (`fast_vision._graphed_tower`), its
wiring checked on the CPU with graphs that replay there (tests/worker/graph_replay.py)."""

import torch

from tests.worker.graph_replay import ReplayingGraphs
from worker.bench import build_model, make_runtime
from worker.bench_throughput import scenes
from worker.model import fast_vision
from worker.model.fast_vision import fast_vision_paths


def features(model, p, pixels, graphs=None):
    with torch.inference_mode(), fast_vision_paths(model, prompt_ids=p.input_ids, graphs=graphs):
        out = model.vlm.model.get_image_features(pixels, p.grid)
    return torch.cat(list(out.pooler_output)), [torch.cat(list(f)) for f in out.deepstack_features]


def test_the_tower_replays_per_grid_with_each_scenes_pixels(monkeypatch):
    model, cfg, tok = build_model("tiny", torch.device("cpu"), torch.float32)
    rt = make_runtime(model, cfg, tok, torch.device("cpu"), torch.float32)
    graphs = ReplayingGraphs()
    a, b = (rt._prepare(s) for s in scenes(2, 1, (64, 64), "vision-graph"))
    c = rt._prepare(scenes(1, 1, (96, 64), "vision-graph-tall")[0])
    for p in (a, b, a, c):                            # captured at a, replayed over b's and a's pixels
        got, got_deep = features(model, p, p.pixel_values, graphs)
        want, want_deep = features(model, p, p.pixel_values)
        assert torch.equal(got, want) and all(torch.equal(x, y) for x, y in zip(got_deep, want_deep))
    assert graphs.count("vision") == 2 and graphs.captures == 2 and graphs.replays == 4
    # the memo's grid tensors the graphs read stay alive when the memo is cleared
    kept = model.vlm.model.visual.__dict__["_graph_memo"]
    assert len(kept) == 2 and all(len(v) > 0 for v in kept.values())
    # past VISION_GRAPHS grids the tower runs plainly
    monkeypatch.setattr(fast_vision, "VISION_GRAPHS", 2)
    d = rt._prepare(scenes(1, 1, (64, 96), "vision-graph-wide")[0])
    got, _ = features(model, d, d.pixel_values, graphs)
    assert torch.equal(got, features(model, d, d.pixel_values)[0]) and graphs.count("vision") == 2
