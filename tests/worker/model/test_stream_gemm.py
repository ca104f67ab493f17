"""The weight-streaming product (worker/model/stream_gemm.py) through Triton's interpreter on the CPU:
odd shapes against fp64 of the dequantised product, the same bits on a second launch, and
Fp8Linear choosing it for few rows (in one interpreted subprocess: `interpreted.py`)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.model.interpreted import run_interpreted
from worker.model.stream_gemm import stream_linear

_CASES = r"""
import dataclasses
import json
from unittest import mock

import torch

import worker.model.fp8 as fp8
from worker.model.stream_gemm import LaunchConfig, stream_linear, launch_config, split_count, SMS_WITHOUT_CUDA
from worker.model.fused_ops import reference_only

gen = torch.Generator().manual_seed(7)
out = {"products": [], "dispatch": {}, "quantize_rows": [], "plain": []}
# (rows, N, K, dtype, bias, splits): K and N not multiples of any block; None = the split rule
for m, n, k, dtype, bias, splits in [(1, 37, 300, "float32", True, None), (1, 37, 300, "bfloat16", False, 3),
                                     (3, 37, 300, "float32", False, 3), (3, 45, 129, "bfloat16", True, None),
                                     (17, 70, 300, "float32", True, 2), (17, 70, 300, "bfloat16", False, None),
                                     (1, 40, 8300, "float32", False, None), (300, 20, 40, "float32", False, None)]:
    dt = getattr(torch, dtype)
    w8, scale = fp8.quantize_weight(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    y = stream_linear(x, w8, scale, b, splits=splits)
    ref = x.double() @ (w8.double() * scale.double()[:, None]).t() + (b.double() if bias else 0)
    out["products"].append(dict(
        case=[m, n, k, dtype, bias, splits], dtype=str(y.dtype)[6:], shape=list(y.shape),
        splits_used=splits or split_count(m, n, k, launch_config(m), SMS_WITHOUT_CUDA),
        rel_err=float((y.double() - ref).norm() / ref.norm()), same_bits=torch.equal(y, stream_linear(x, w8, scale, b,
                                                                                                  splits=splits))))
# the dot form with its operands swapped ((W x^T)^T), fp8 and plain weights, split and not
out["swapped"] = []
for m, n, k, dtype, bias, splits, fp8_weight in [(3, 45, 129, "bfloat16", True, 1, True), (17, 70, 300, "float32", True, 2, True),
                                                 (8, 64, 256, "bfloat16", False, 3, False)]:
    dt = getattr(torch, dtype)
    w = torch.randn(n, k, generator=gen)
    w, scale = fp8.quantize_weight(w) if fp8_weight else (w.to(dt), None)
    x = torch.randn(m, k, generator=gen).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    config = LaunchConfig(block_m=16 if m <= 16 else 32, block_n=32, block_k=64, warps=4, stages=2, swap_ab=True)
    y = stream_linear(x, w, scale, b, config=config, splits=splits)
    ref = x.double() @ (w.double() * (scale.double()[:, None] if fp8_weight else 1)).t() + (b.double() if bias else 0)
    out["swapped"].append(dict(case=[m, n, k, dtype], shape=list(y.shape),
                               rel_err=float((y.double() - ref).norm() / ref.norm())))
# plain products (scale None: a bf16 / fp32 weight), stored (N, K) and transposed (K, N)
for m, n, k, dtype, transposed in [(1, 37, 600, "bfloat16", False), (1, 37, 600, "bfloat16", True),
                                   (5, 45, 129, "float32", False), (5, 45, 129, "float32", True)]:
    dt = getattr(torch, dtype)
    w = torch.randn(n, k, generator=gen).to(dt)
    if transposed:
        w = w.t().contiguous().t()
    x = torch.randn(m, k, generator=gen).to(dt)
    y = stream_linear(x, w, None)
    ref = x.double() @ w.double().t()
    out["plain"].append(dict(case=[m, n, k, dtype, transposed], strides=list(w.stride()), shape=list(y.shape),
                             rel_err=float((y.double() - ref).norm() / ref.norm())))
# the fp16 dot form (e4m3 weights, bf16 rows scaled by powers of two) against the bf16 dot form, with
# rows far past fp16's range (1e6), tiny ones and an all-zero row; fp32 rows and bf16 weights do not take it
out["f16"] = []
bf16_form = LaunchConfig(block_m=16, block_n=32, block_k=64, warps=4, stages=2)
f16_form = LaunchConfig(block_m=16, block_n=32, block_k=64, warps=4, stages=2, f16=True)
for m, n, k, dtype, fp8_weight, swap in [(8, 70, 300, "bfloat16", True, False), (5, 45, 129, "bfloat16", True, True),
                                         (8, 70, 300, "float32", True, False), (8, 70, 300, "bfloat16", False, False),
                                         (20, 70, 300, "bfloat16", True, False)]:
    dt = getattr(torch, dtype)
    w = torch.randn(n, k, generator=gen)
    w, scale = fp8.quantize_weight(w) if fp8_weight else (w.to(dt), None)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-6, 6, m)[:, None]).to(dt)
    x[1] = 0.0
    forms = [dataclasses.replace(c, swap_ab=swap, block_m=16 if m <= 16 else 32) for c in (bf16_form, f16_form)]
    forms.append(dataclasses.replace(forms[1], f16_rows=True, swap_ab=False))     # the rows made fp16 first
    ref = x.double() @ (w.double() * (scale.double()[:, None] if fp8_weight else 1)).t()
    y0 = stream_linear(x, w, scale, config=forms[0], splits=2)
    for form, c in zip(("tile", "rows"), forms[1:]):
        y1 = stream_linear(x, w, scale, config=c, splits=2)
        row_err = ((y1.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-300)).tolist()
        out["f16"].append(dict(case=[m, n, k, dtype, fp8_weight, swap], form=form, finite=bool(torch.isfinite(y1).all()),
                               same_bits_as_bf16_form=torch.equal(y0, y1), zero_row=bool((y1[1] == 0).all()),
                               worst_row_rel_err=max(e for i, e in enumerate(row_err) if i != 1)))
# Fp8Linear: which product runs for few rows, many rows, and inside reference_only()
lin = fp8.Fp8Linear(torch.nn.Linear(48, 24, bias=False))
for name, rows, ref_only in [("few", 3, False), ("limit", fp8.WEIGHT_ONLY_MAX_ROWS, False),
                             ("many", fp8.WEIGHT_ONLY_MAX_ROWS + 1, False), ("reference_only", 3, True)]:
    x = torch.randn(rows, 48, generator=gen)
    with mock.patch.object(fp8, "stream_linear", wraps=fp8.stream_linear) as spy:
        if ref_only:
            with reference_only():
                y = lin(x[None])
        else:
            y = lin(x[None])
    ref = fp8.stream_linear_reference(x.double(), lin.weight, lin.weight_scale.double())
    out["dispatch"][name] = dict(kernel_calls=spy.call_count, shape=list(y.shape),
                                 rel_err=float((y[0].double() - ref).norm() / ref.norm()))
# per-row activation quantisation for _scaled_mm: the kernel against the torch ops, bit for bit
from worker.model.fp8 import quantize_rows, quantize_rows_reference
for m, k, dtype in [(5, 300, "bfloat16"), (3, 4100, "bfloat16"), (4, 77, "float32")]:
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]).to(getattr(torch, dtype))
    x[1, 5] = 0.0
    if m > 3:
        x[3] = 0.0                                   # an all-zero row: the scale's floor
    q, s = quantize_rows(x)
    rq, rs = quantize_rows_reference(x)
    diff = q.view(torch.uint8) != rq.view(torch.uint8)
    kq, rqf = q.float()[diff], rq.float()[diff]
    out["quantize_rows"].append(dict(
        case=[m, k, dtype], q_dtype=str(q.dtype), s_shape=list(s.shape), same_s=torch.equal(s, rs),
        same_q_fraction=float(1 - diff.float().mean()),
        # where they differ, the interpreter's fp32 -> e4m3 cast (not the kernel's arithmetic) rounds
        # ties up or drops a carry into the next binade: within a factor of 2, same sign
        within_a_binade=bool(((kq / rqf) >= 0.5).all() and ((kq / rqf) <= 1.25).all())))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CASES)


def test_matches_dequantised_product_at_odd_shapes_and_repeats_bit_for_bit(interpreted):
    for p in interpreted["products"]:
        m, n, k, dtype, _, _ = p["case"]
        assert p["dtype"] == dtype and p["shape"] == [m, n], p
        assert p["rel_err"] <= (1e-6 if dtype == "float32" else 1e-2), p
        assert p["same_bits"], p
    # the split rule splits a long K when the output tiles are few; forced splits ran too
    assert any(p["case"][5] is None and p["splits_used"] > 1 for p in interpreted["products"])
    assert any(p["case"][5] == 3 for p in interpreted["products"])


def test_the_swapped_dot_form_gives_the_product(interpreted):
    cases = interpreted["swapped"]
    assert len(cases) == 3
    for c in cases:
        m, n, _, dtype = c["case"]
        assert c["shape"] == [m, n] and c["rel_err"] <= (1e-6 if dtype == "float32" else 1e-2), c


def test_the_fp16_dot_forms_keep_rows_far_past_fp16s_range_and_run_only_where_exact(interpreted):
    """e4m3 -> fp16 is one conversion per two values (-> bf16 three); bf16 rows are scaled by a power
    of two per tile, or once per row before the product (the 17-32-row form), so none overflows
    fp16 (65,504) or drops into its subnormals: every row, 1e-6 to 1e6, within the bf16 output's
    rounding. fp32 rows and bf16 weights would not convert exactly, so they keep the other form
    (the same bits)."""
    cases = {(*c["case"], c["form"]): c for c in interpreted["f16"]}
    assert {c[-1] for c in cases} == {"tile", "rows"} and len(cases) == 10
    for case, c in cases.items():
        assert c["finite"] and c["zero_row"], c
        assert c["worst_row_rel_err"] <= (1e-6 if case[3] == "float32" else 1e-2), c
    for form in ("tile", "rows"):
        assert cases[(8, 70, 300, "float32", True, False, form)]["same_bits_as_bf16_form"]
        assert cases[(8, 70, 300, "bfloat16", False, False, form)]["same_bits_as_bf16_form"]


def test_fp8_linear_module_uses_the_kernel_for_few_rows_only(interpreted):
    d = interpreted["dispatch"]
    assert d["few"]["kernel_calls"] == 1 and d["limit"]["kernel_calls"] == 1
    assert d["many"]["kernel_calls"] == 0            # CPU: the dequantised reference (GPU: _scaled_mm)
    assert d["reference_only"]["kernel_calls"] == 0
    for case in d.values():
        assert case["shape"][-1] == 24 and case["rel_err"] <= 1e-6, d


def test_only_weights_of_fp8_mm_min_features_multiply_many_rows_in_fp8(monkeypatch):
    """Smaller weights (the demo checkpoint's 128-768 widths) take the dequantised weight at many
    rows, whose bf16 rows keep the demo's fp8 prefill logits within cosine 0.999 of bf16's (e4m3
    rows: 0.9955); the 32B shape's products (1,152 wide and up) keep `_scaled_mm`."""
    from safetensors import safe_open
    from torch import nn

    from worker.demo_cache import shipped_dir
    from worker.model import fp8
    from worker.model.modelopt import is_fp8_weight
    from worker.shapes import SHAPES

    monkeypatch.setattr(fp8, "_has_fp8_mm", lambda device: True)          # as on an fp8 GPU
    assert not fp8.Fp8Linear(nn.Linear(256, 1536, bias=False)).fast
    assert not fp8.Fp8Linear(nn.Linear(768, 256, bias=False)).fast
    assert fp8.Fp8Linear(nn.Linear(1024, 1024, bias=False)).fast
    s = SHAPES["32b"]
    assert min(s["vision_hidden"], s["expert_hidden"], s["hidden"]) >= fp8.FP8_MM_MIN_FEATURES
    shapes = {}
    for f in (shipped_dir() / "checkpoint").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    quantised = [shape for name, shape in shapes.items() if is_fp8_weight(name, shape)]
    assert quantised and all(min(shape) < fp8.FP8_MM_MIN_FEATURES for shape in quantised)


def test_quantize_rows_kernel_gives_the_torch_ops_scales_and_values(interpreted):
    cases = interpreted["quantize_rows"]
    assert [c["case"][1] for c in cases] == [300, 4100, 77]       # one block, several blocks (4096 + 4), fp32
    for c in cases:
        assert c["q_dtype"] == "torch.float8_e4m3fn" and c["s_shape"] == [c["case"][0], 1], c
        assert c["same_s"] and c["same_q_fraction"] > 0.95 and c["within_a_binade"], c
    # (exact bits on the GPU: `python -m worker.kernel_check`, "fp8 activation quantisation")


def test_plain_weights_stored_either_way_give_the_product(interpreted):
    cases = interpreted["plain"]
    assert {tuple(c["strides"]) for c in cases} >= {(600, 1), (1, 37), (129, 1), (1, 45)}   # both layouts ran
    for c in cases:
        m, n, _, dtype, _ = c["case"]
        assert c["shape"] == [m, n] and c["rel_err"] <= (1e-6 if dtype == "float32" else 1e-2), c


def test_refuses_a_weight_without_a_unit_stride():
    w8 = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)[:, ::2]          # (8, 16) with strides (32, 2)
    with pytest.raises(ValueError, match="contiguous along N or K"):
        stream_linear(torch.zeros(1, 16), w8, torch.ones(8))


@pytest.mark.parametrize("weight_bytes", [1, 2, 4])
def test_one_row_streams_a_kibibyte_of_each_weight_row_per_step(weight_bytes):
    from worker.model.stream_gemm import launch_config

    c = launch_config(1, weight_bytes)
    assert c.block_m == 1 and c.block_n == 16 and c.block_k * weight_bytes == 1024
    assert launch_config(8, weight_bytes).block_m == 16          # more rows: tensor-core tiles


def test_small_weights_split_k_while_their_partials_stay_in_l2():
    """The expert's 64-row products (K 1,536-6,144) ran unsplit, their 128-wide tiles leaving most
    multiprocessors idle (H200: qkv 16.3 us unsplit, 9.2 in 3 splits; o 21.0 / 8.1 in 4), because
    the partials were bounded by a quarter of the weight alone; partials under L2_PARTIAL_BYTES are
    allowed. The 32B layer's splits (partials bounded by the weight) stay as they were."""
    from worker.model.stream_gemm import L2_PARTIAL_BYTES, launch_config, split_count

    c = launch_config(64)
    assert [split_count(64, n, k, c, 132) for n, k in ((4096, 1536), (1536, 2048), (12288, 1536), (1536, 6144))] \
        == [3, 4, 1, 10]
    assert [split_count(64, n, k, c, 132) for n, k in ((10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600))] \
        == [2, 4, 2, 12]
    assert 8 * 64 * 1536 * 10 <= L2_PARTIAL_BYTES


def test_fp16_form_tiles_split_for_a_few_programs_per_multiprocessor():
    """The 2-16-row fp8 products with bf16 rows (verify(8) at batch 1-2) ran 64-wide tiles split for
    8 programs a multiprocessor (7-16 splits): H200, the 32B layer's products 160.1 us at 8 rows;
    128-wide tiles split for ~2.4 (qkv 4, o 8, gate/up 1, down 8) took 145.5. fp32 rows and bf16
    weights keep the general table's entry."""
    import torch

    from worker.model.stream_gemm import LAUNCH_CONFIGS, f16_operands, launch_config, split_count

    c = launch_config(8, 1, f16_operands(torch.float8_e4m3fn, torch.bfloat16))
    assert c.f16 and c.block_n == 128 and not c.f16_rows
    assert [split_count(8, n, k, c, 132) for n, k in ((10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600))] \
        == [4, 8, 1, 8]
    assert launch_config(16, 1, True) == c and launch_config(1, 1, True) == LAUNCH_CONFIGS[0][1]
    for w, x in ((torch.float8_e4m3fn, torch.float32), (torch.bfloat16, torch.bfloat16)):
        assert not launch_config(8, w.itemsize, f16_operands(w, x)).f16


def test_17_to_32_rows_make_their_rows_fp16_before_the_product():
    """17-32 rows (verify(8) at batch 3-4 and at K=3): the rows made fp16 once, each tile's products
    accumulated in the tensor cores (H200: the 32B layer 205.1 us at 24 rows against 221.0 for the
    bf16 dot form, 233.6 for rows scaled tile by tile); fp32 rows and bf16 weights keep the general
    table's entry, and 33 rows and more theirs."""
    import torch

    from worker.model.stream_gemm import LAUNCH_CONFIGS, f16_operands, launch_config

    for rows in (17, 24, 32):
        c = launch_config(rows, 1, f16_operands(torch.float8_e4m3fn, torch.bfloat16))
        assert c.f16 and c.f16_rows and c.block_m == 32 and not c.swap_ab, (rows, c)
    assert launch_config(24, 1, False) == launch_config(24, 2, False) == LAUNCH_CONFIGS[2][1]
    assert not launch_config(33, 1, True).f16
