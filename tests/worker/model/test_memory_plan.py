"""The GPU memory plan (ALPAMAYO_GPU_MEMORY_FRACTION) and batches larger than the planned rows."""

import pytest
import torch

from worker.demo.layout import write_random_checkpoint
from worker.model.memory_plan import GIB, PREFILL_TOKENS, MemoryPlanError, plan, reserve_bytes
from worker.model.runtime import AlpamayoRuntime

from tests.worker.model.test_runtime import scene

# the 32B shape: 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes per column; 1 draft layer beside it
COLUMN_32B = 2 * 64 * 8 * 128 * 2 + 2 * 1 * 8 * 128 * 2


def test_rows_fill_the_budget_and_no_more():
    p = plan("cuda", 141 * GIB, 0.90, weights=int(71.6e9), bytes_per_column=COLUMN_32B, capacity=8192,
             rows_wanted=64, rows_needed=3)
    free = 0.90 * 141 * GIB - 71.6e9 - reserve_bytes(141 * GIB, COLUMN_32B * 8192)
    assert p.max_rows == int(free // (COLUMN_32B * 8192)) < 64
    assert p.kv_bytes <= free < p.kv_bytes + COLUMN_32B * 8192
    assert p.kv_cache_tokens == p.max_rows * 8192
    d = p.as_dict()
    assert d["max_rows"] == p.max_rows and d["kv_cache_tokens"] == p.kv_cache_tokens
    assert "rows" in p.describe() and "GiB" in p.describe()


def test_rows_capped_at_what_the_batches_need():
    p = plan("cuda", 141 * GIB, 0.90, weights=10 * GIB, bytes_per_column=COLUMN_32B, capacity=4096,
             rows_wanted=8, rows_needed=3)
    assert p.max_rows == 8


def test_the_reserve_holds_a_prefill_pass_of_prefill_tokens_at_short_rows():
    """Scenes of one prompt length prefill together (up to PREFILL_TOKENS tokens a pass): at row
    capacities below it the reserve holds that pass's cache; at the 32B shape's (>= 4,992) one
    scene's at full length, as before."""
    short = plan("cuda", 141 * GIB, 0.90, weights=10 * GIB, bytes_per_column=COLUMN_32B, capacity=1024,
                 rows_wanted=8, rows_needed=1)
    assert short.reserve == reserve_bytes(141 * GIB, COLUMN_32B * PREFILL_TOKENS)
    full = plan("cuda", 141 * GIB, 0.90, weights=10 * GIB, bytes_per_column=COLUMN_32B, capacity=4992,
                rows_wanted=8, rows_needed=1)
    assert PREFILL_TOKENS <= 4992 and full.reserve == reserve_bytes(141 * GIB, COLUMN_32B * 4992)


def test_too_small_fraction_is_refused_in_one_line_naming_the_variable():
    with pytest.raises(MemoryPlanError) as e:
        plan("cuda", 80 * GIB, 0.5, weights=int(71.6e9), bytes_per_column=COLUMN_32B, capacity=8192,
             rows_wanted=24, rows_needed=3)
    msg = str(e.value)
    assert "\n" not in msg and "ALPAMAYO_GPU_MEMORY_FRACTION=0.5" in msg and "K=3" in msg
    assert "raise ALPAMAYO_GPU_MEMORY_FRACTION to at least" in msg


def test_cpu_has_no_budget():
    p = plan("cpu", 0, 0.9, weights=1 << 20, bytes_per_column=1024, capacity=512, rows_wanted=24, rows_needed=3)
    assert p.max_rows == 24 and "no device budget" in p.describe()


def test_batch_larger_than_the_planned_rows_runs_in_chunks_with_the_same_results(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", max_shard_bytes=300_000)
    small = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    big = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    small.enable_graphs(max_rows=2, capacity=512)          # one K=2 scene per chunk
    big.enable_graphs(max_rows=8, capacity=512)
    for r in (small, big):
        r.trajectory_max_new = 8
    reqs = [scene(i, k=2, temperature=0.7, seed=i) for i in range(3)]
    calls = []
    orig = small._generate
    small._generate = lambda task, k, ok, *a: (calls.append(len(ok)), orig(task, k, ok, *a))
    a, b = small.run(reqs), big.run(reqs)
    assert calls == [1, 1, 1]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(x.trajectories.shape == (2, 64, 3) for x in a)


def test_bytes_per_column_counts_every_layer():
    ckpt_rt = AlpamayoRuntime.__new__(AlpamayoRuntime)
    d = torch.nn.Module()
    d.num_layers, d.kv_heads, d.head_dim = 64, 8, 128
    ckpt_rt.decoder, ckpt_rt.dtype, ckpt_rt.speculator = d, torch.bfloat16, None
    assert ckpt_rt.kv_bytes_per_column() == 2 * 64 * 8 * 128 * 2


def test_engine_plans_the_cache_and_shows_it_in_the_models_payload(tmp_path):
    from worker.config import load_settings
    from worker.engine import Engine

    ckpt = write_random_checkpoint(tmp_path / "ckpt", max_shard_bytes=300_000)
    engine = Engine(load_settings({"NIM_FT_CHECKPOINT": str(ckpt), "ALPAMAYO_DEVICE": "cpu",
                                   "NIM_ALPAMAYO_TRAJ_SAMPLES": "1,3", "ALPAMAYO_MAX_BATCH_SIZE": "4"}))
    engine.load(warmup=False)
    model = engine.models_payload()["data"][0]
    assert model["max_rows"] == 12 and model["kv_cache_tokens"] == 12 * 8192
    assert model["memory_plan"]["device"] == "cpu" and model["action_expert_max_batch_size"] == 12
