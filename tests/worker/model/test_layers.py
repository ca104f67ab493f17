"""Weight layout of the fused GPU stack (worker/model/layers.py): o and down projections are
stored (in, out) row-major where the fused path runs, so cuBLAS runs its faster NN product; the
module computes the same function and the CPU reference path and training keep (out, in)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from worker.model.layers import FusedStack, store_transposed


def _linear(requires_grad: bool) -> nn.Linear:
    torch.manual_seed(0)
    m = nn.Linear(48, 80, bias=False)
    m.weight.requires_grad_(requires_grad)
    return m


def test_inference_weight_stored_transposed_where_fused_path_runs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = _linear(False)
    x = torch.randn(3, 48)
    before = m(x)
    store_transposed(m)
    assert m.weight.shape == (80, 48)
    assert m.weight.stride() == (1, 80)            # (in, out) row-major under an (out, in) view
    torch.testing.assert_close(m(x), before)


@pytest.mark.parametrize("interpret, requires_grad", [("0", False), ("1", True)])
def test_layout_kept_off_fused_path_and_for_training(monkeypatch, interpret, requires_grad):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    m = _linear(requires_grad)
    store_transposed(m)
    assert m.weight.stride() == (48, 1)


def test_fused_stack_stores_o_and_down_transposed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    conf = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2, vocab_size=32)
    layers = [Qwen3DecoderLayer(conf, i).eval().requires_grad_(False) for i in range(2)]
    FusedStack(layers, head_dim=16)
    for layer in layers:
        assert layer.self_attn.o_proj.weight.stride() == (1, 64)
        assert layer.mlp.down_proj.weight.stride() == (1, 64)
        assert layer.mlp.gate_proj.weight.stride() == (64, 1)       # gate/up keep (out, in)


@pytest.mark.parametrize("rows, transposed, kernel", [(1, False, True), (8, False, True), (9, False, False),
                                                      (1, True, False)])
def test_few_row_products_of_out_in_weights_stream_through_the_kernel(monkeypatch, rows, transposed, kernel):
    """`project`: up to GEMV_MAX_ROWS rows of an (out, in) weight run the weight-streaming kernel
    (measured faster than cuBLAS there); more rows, or an (in, out) store, run the module."""
    from worker.model import layers

    monkeypatch.setattr(layers, "fused_available", lambda x: True)
    calls = []
    monkeypatch.setattr(layers, "stream_linear", lambda x, w, scale, bias: calls.append((w.stride(), scale)) or
                        torch.nn.functional.linear(x, w, bias))
    m = _linear(False)
    if transposed:
        m.weight = nn.Parameter(m.weight.data.t().contiguous().t(), requires_grad=False)
    x = torch.randn(1, rows, 48)
    torch.testing.assert_close(layers.project(m, x), m(x))
    assert layers.GEMV_MAX_ROWS == 8
    assert calls == ([((48, 1), None)] if kernel else [])


def test_wide_query_tiles_split_keys_for_one_wave():
    """Verify(8) and the draft's block (64 queries a tile) split for one wave of programs, each split
    at least WIDE_SPLIT_KEYS keys (batch 1, 4,864 columns: 16 splits, 12.0 us on the H200 against
    24.2 with the 4 splits of >= 1,024 keys before); decode's 8-query tiles keep about two waves;
    about a program per multiprocessor needs no split."""
    from worker.model.attention import WIDE_SPLIT_KEYS, split_plan

    assert split_plan(1, 8, 1, 4864, 64, query_rows=64) == 16
    assert [split_plan(rows, 8, 1, 4864, 64, query_rows=64) for rows in (2, 4, 8, 16)] == [8, 4, 2, 1]
    splits = split_plan(1, 8, 1, 8256, 64, query_rows=64)
    assert 8256 / splits >= WIDE_SPLIT_KEYS and splits * 8 <= 132
    assert [split_plan(rows, 8, 1, 8256, 64, query_rows=8) for rows in (1, 2, 4, 8, 15, 16)] == [32, 16, 8, 4, 2, 1]
    assert split_plan(32, 8, 1, 4608, 64, query_rows=64) == 1


_SPLITS_CASE = """
import json, torch
from worker.model import attention
parts = []
class Recorder:
    def __getitem__(self, grid):
        return lambda opart, lpart, *a, **kw: parts.append(lpart.clone())
empty = torch.empty
def nan_empty(*shape, **kw):                  # partials a split never writes stay NaN
    return empty(*shape, **kw).fill_(float("nan")) if kw.get("dtype") == torch.float32 else empty(*shape, **kw)
attention._merge_kernel = Recorder()
torch.empty = nan_empty
gen = torch.Generator().manual_seed(0)
q = torch.randn(3, 1, 8, 16, generator=gen)
k, v = (torch.randn(3, 2, 4864, 16, generator=gen) for _ in range(2))
for splits in (4, 32):
    attention.cache_attention(q, k, v, torch.tensor([1000, 700, 4631]), True, splits=splits, block_n=64)
torch.empty = empty
print(json.dumps({"live": [[int(torch.isfinite(lse[r, 0, 0]).sum()) for r in range(3)] for lse in parts]}))
"""


def test_a_rows_splits_divide_its_live_keys_not_the_cache_capacity():
    """The splits of a launch divided the cache's capacity, so past a row's live length they had
    nothing to read: the worker's 8,192 columns held ~4,700 live keys, and of the expert's 8 splits
    at batch 1-3 three were idle. Now each row's 64-key steps are dealt evenly among all its splits:
    in 4 splits of 4,864 columns, rows of 1,000, 700 and 4,631 keys keep all 4 live (before: 1, 1
    and 4); in decode's 32 splits at batch 1, a row of 4,631 keys (73 steps) all 32 (before: 25 of
    192 keys), rows of 16 and 11 steps one split a step."""
    from tests.worker.model.interpreted import run_interpreted

    assert run_interpreted(_SPLITS_CASE)["live"] == [[4, 4, 4], [16, 11, 32]]


def test_the_merge_launches_one_program_per_query_of_each_head(monkeypatch):
    """The merge took 8 of a verify block's queries in turn per program (6.2 us against 2.5 for one
    a program, batch 1, H200): it now launches (rows x heads, T) programs."""
    from worker.model import attention

    grids = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: grids.__setitem__(self.name, (grid, kw))

    monkeypatch.setattr(attention, "available", lambda x: True)
    monkeypatch.setattr(attention, "_split_kernel", Recorder("split"))
    monkeypatch.setattr(attention, "_merge_kernel", Recorder("merge"))
    q = torch.zeros(1, 8, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 4864, 128, dtype=torch.bfloat16)
    attention.cache_attention(q, k, k, torch.tensor([4700]), True)
    assert grids["split"][0] == (8, 16, 1)
    assert grids["merge"][0] == (64, 8) and "TB" not in grids["merge"][1]


def test_unsplit_attention_keeps_four_key_tiles_in_flight(monkeypatch):
    """Launches that read each row's keys in one split (decode and verify at batch 16) ran with 3
    K/V tiles in flight: with 4, 74.7 against 78.4 us (verify(8)) and 72.2 against 75.5 (decode) on
    the H200, K/V streamed from memory. Split tiles and the expert's 128-key steps keep theirs."""
    from worker.model import attention

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kw.get("BLOCK_N"), kw.get("num_stages")))

    monkeypatch.setattr(attention, "available", lambda x: True)
    monkeypatch.setattr(attention, "_split_kernel", Recorder())
    monkeypatch.setattr(attention, "_merge_kernel", Recorder())

    def stages(rows: int, t: int, hq: int, causal: bool = True) -> int:
        launches.clear()
        k = torch.zeros(rows, 8, 4864, 128, dtype=torch.bfloat16)
        attention.cache_attention(torch.zeros(rows, t, hq, 128, dtype=torch.bfloat16), k, k,
                                  torch.full((rows,), 4700), causal)
        return launches[0][1]

    assert stages(16, 8, 64) == 4 and stages(16, 1, 64) == 4          # unsplit, 64-key steps
    assert stages(1, 8, 64) == 3 and stages(1, 1, 64) == 2            # split: as before
    assert stages(8, 64, 16, causal=False) == 3                       # the expert's 128-key steps
    assert stages(1, 64, 16, causal=False) == 3
    assert attention.pipeline_stages(64, 64, True, 4) == 2            # fp32 K/V


def test_the_experts_tiles_split_keys_8_or_4_ways_while_three_programs_a_multiprocessor_hold_them():
    """The expert's attention (64 tokens x 2 heads per KV head: two 64-row tiles) ran unsplit at
    batch 3 and 4 (60 us) and 4 ways at batch 2 (35.5 us); on the H200 8 splits took 30.5 us at
    batch 2 and 35.9 at batch 3, 4 splits 54.7 at batch 4, and batch 8 stays unsplit (2 splits lost)."""
    from worker.model.attention import split_plan, tiled_splits

    assert [split_plan(rows, 8, 2, 8192, 64, query_rows=64) for rows in (1, 2, 3)] == [8, 8, 8]
    assert split_plan(4, 8, 2, 8192, 128, query_rows=64) == 4
    assert split_plan(1, 8, 2, 4864, 64, query_rows=64) == 8
    for rows in (8, 16):
        assert split_plan(rows, 8, 2, 8192, 128, query_rows=64) == 1
    assert [tiled_splits(p) for p in (16, 48, 50, 64, 99, 100)] == [8, 8, 4, 4, 4, 1]


def test_the_expert_at_two_to_four_rows_runs_one_128_row_tile_per_kv_head_for_one_wave(monkeypatch):
    """The expert's 128 queries of a KV head ran as two 64-row tiles split 8 ways at 2-3 rows and 4
    at 4 (at 3 rows 48 x 8 programs, three waves: 45.2 us on the H200); one 128-row tile split for
    one wave, 8 / 5 / 4 ways, took 25.2 / 34.2 / 42.5 us against 25.6 / 45.2 / 43.9. One row and 8
    rows keep two tiles (18.2 against 19.7, 66.4 against 78.7)."""
    from worker.model import attention

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw.get("BLOCK_M")))

    monkeypatch.setattr(attention, "available", lambda x: True)
    monkeypatch.setattr(attention, "_split_kernel", Recorder())
    monkeypatch.setattr(attention, "_merge_kernel", Recorder())

    def form(rows: int) -> tuple:
        launches.clear()
        k = torch.zeros(rows, 8, 8192, 128, dtype=torch.bfloat16)
        attention.cache_attention(torch.zeros(rows, 64, 16, 128, dtype=torch.bfloat16), k, k,
                                  torch.full((rows,), 4631), False)
        (b_h, splits, tiles), block_m = launches[0]
        return block_m, splits, tiles

    assert [form(rows) for rows in (2, 3, 4)] == [(128, 8, 1), (128, 5, 1), (128, 4, 1)]
    assert form(1) == (64, 8, 2) and form(8) == (64, 1, 2)


def test_kernels_launch_plainly_off_hopper():
    """Programmatic dependent launch only where kernels are compiled for a GPU (never on the CPU
    or under Triton's interpreter)."""
    from worker.model.fused_ops import launch_args

    assert launch_args(torch.zeros(1)) == {"GDC": False}
