"""The expert's flow matching replayed as one CUDA graph per Euler step (`ActionExpert._graphed_steps`),
its wiring checked on the CPU with graphs that replay there (tests/worker/graph_replay.py)."""

import torch

from tests.worker.graph_replay import ReplayingGraphs
from worker.bench import build_model, make_runtime
from worker.model.decoder import StaticKVCache
from worker.model.sampling import normal


def test_each_euler_step_replays_one_graph_and_gives_the_whole_loops_action():
    model, cfg, tok = build_model("tiny", torch.device("cpu"), torch.float32)
    rt = make_runtime(model, cfg, tok, torch.device("cpu"), torch.float32)
    expert, conf = rt.expert, model.vlm.config.text_config
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
    cache = StaticKVCache(conf.num_hidden_layers, 2, conf.num_key_value_heads, 256, head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    offset, delta = torch.tensor([40, 71]), torch.tensor([3, -2])
    graphs = ReplayingGraphs()
    with torch.inference_mode():
        for keys in (torch.tensor([5, 6]), torch.tensor([7, 8])):      # captured at the first, replayed for both
            got = expert.sample(cache, offset, delta, keys, steps=4, graphs=graphs)
            want = expert.integrate(normal(keys, (expert.num_waypoints, 2)), cache, offset, delta, cache.capacity, 4)
            assert torch.equal(got, want)
    assert graphs.count("expert") == 1 and graphs.captures == 1 and graphs.replays == 8
