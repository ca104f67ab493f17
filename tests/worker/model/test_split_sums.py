"""A decoder step's products (q/k/v, gate/up, o, down), split over K, leave their fp32 partials for the
kernel that reads them next to sum (the q/k norm + rotary, silu * up, the residual add + RMSNorm;
`stream_gemm.stream_linear(defer_sum=True)`, `fused_ops.SplitSums`, `layers.DEFER_SPLIT_SUMS_MAX_ROWS`): the
same bits as summing them in a kernel of their own, up to four launches a layer fewer. Through Triton's
interpreter on the CPU, in one subprocess (`interpreted.py`)."""

from __future__ import annotations

import pytest

from tests.worker.model.interpreted import run_interpreted

_CASES = r"""
import json
from unittest import mock

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

import worker.model.fp8 as fp8
import worker.model.fused_ops as fused_ops
import worker.model.layers as layers
import worker.model.stream_gemm as stream_gemm
from worker.model.fused_ops import SplitSums, add_rms_norm, qk_norm_rope_write, silu_mul

gen = torch.Generator().manual_seed(5)
out = {"norm": [], "rope": [], "silu": [], "stack": {}}

# the kernel: a SplitSums as the norm's x, against its summed value, every form of the norm
for splits, n, scaled, residual, quantize in [(3, 300, True, True, False), (2, 300, False, True, False),
                                              (4, 5000, True, False, False), (3, 300, True, True, True)]:
    part = torch.randn(splits, 5, n, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.5 if scaled else None
    x = SplitSums(part, scale, (5, n), torch.bfloat16)
    r = torch.randn(5, n, generator=gen).to(torch.bfloat16) if residual else None
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    h, y = add_rms_norm(x, w, 1e-6, residual=r, quantize=quantize)
    rh, ry = add_rms_norm(x.result(), w, 1e-6, residual=r, quantize=quantize)
    if quantize:
        y, ry = torch.cat([y[0].view(torch.uint8).float(), y[1]], 1), torch.cat([ry[0].view(torch.uint8).float(), ry[1]], 1)
    out["norm"].append(dict(case=[splits, n, scaled, residual, quantize], same_h=torch.equal(h, rh),
                            same_y=torch.equal(y, ry), dtype=str(h.dtype)))

# the q/k norm + rotary (K and V into the cache) from a SplitSums, against its summed value
for splits, scaled, (b, t) in [(3, True, (2, 1)), (2, False, (1, 8))]:
    hq, hkv, d = 4, 2, 16
    part = torch.randn(splits, b * t, (hq + 2 * hkv) * d, generator=gen)
    scale = torch.rand((hq + 2 * hkv) * d, generator=gen) + 0.5 if scaled else None
    qkv = SplitSums(part, scale, (b, t, (hq + 2 * hkv) * d), torch.bfloat16)
    qw, kw = (torch.randn(d, generator=gen).to(torch.bfloat16) for _ in range(2))
    start, delta = torch.tensor([5, 2][:b]), torch.tensor([0, 3][:b])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    got = []
    for x in (qkv, qkv.result()):
        kc, vc = (torch.zeros(b, hkv, 32, d, dtype=torch.bfloat16) for _ in range(2))
        q = qk_norm_rope_write(x, hq, hkv, qw, kw, 1e-6, kc, vc, start, delta, inv_freq, 1.0)
        got.append((q, kc, vc))
    out["rope"].append(dict(case=[splits, scaled, b, t], same=all(torch.equal(a, c) for a, c in zip(*got)),
                            written=bool(got[0][1].abs().sum() > 0 and got[0][2].abs().sum() > 0)))

# silu * up from a SplitSums (two column blocks and a ragged one), against its summed value
for splits, n, scaled in [(2, 2500, True), (3, 300, False)]:
    part = torch.randn(splits, 3, 2 * n, generator=gen)
    scale = torch.rand(2 * n, generator=gen) + 0.5 if scaled else None
    gu = SplitSums(part, scale, (3, 2 * n), torch.bfloat16)
    y, ry = silu_mul(gu), silu_mul(gu.result())
    (q, sc), (rq, rs) = silu_mul(gu, quantize=True), silu_mul(gu.result(), quantize=True)
    out["silu"].append(dict(case=[splits, n, scaled], same=torch.equal(y, ry), shape=list(y.shape),
                            same_quantised=torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rs)))

# a 2-layer fp8 stack (weight-only products, as at decode), every product split in 3
conf = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_hidden_layers=2, vocab_size=32)
torch.manual_seed(3)
stack_layers = [Qwen3DecoderLayer(conf, i).eval().requires_grad_(False).to(torch.bfloat16) for i in range(2)]
fp8.quantize_linears(torch.nn.ModuleList(stack_layers))
stack = layers.FusedStack(stack_layers, head_dim=16)

def step(rows, t, capture):
    caches = [(torch.zeros(rows, 2, 64, 16, dtype=torch.bfloat16), torch.zeros(rows, 2, 64, 16, dtype=torch.bfloat16))
              for _ in range(2)]
    x = torch.randn(rows, t, 64, generator=torch.Generator().manual_seed(rows * 100 + t)).to(torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    return stack.run(x, caches, torch.tensor([3, 9][:rows]), torch.zeros(rows, dtype=torch.long), inv_freq, 1.0,
                     causal=True, capture=capture)

def small_blocks(rows, weight_bytes=1):
    # K steps of 16 so that the tiny layer's products split (K = 64: 2 splits of 2 steps; 96: 3)
    return stream_gemm.LaunchConfig(block_m=1 if rows == 1 else 16, block_n=16, block_k=16, warps=4, stages=1)

for rows, t, capture in [(1, 1, ()), (2, 8, (0,))]:
    res = {}
    for defer, max_rows in ((True, 10**6), (False, 0), ("default", layers.DEFER_SPLIT_SUMS_MAX_ROWS)):
        spy = mock.Mock(wraps=fused_ops.sum_splits)
        with mock.patch.object(layers, "DEFER_SPLIT_SUMS_MAX_ROWS", max_rows), \
                mock.patch.object(stream_gemm, "launch_config", side_effect=small_blocks), \
                mock.patch.object(stream_gemm, "split_count", return_value=3), \
                mock.patch.object(fused_ops, "sum_splits", spy), mock.patch.object(stream_gemm, "sum_splits", spy):
            h, hidden = step(rows, t, capture)
        res[defer] = (h, hidden, spy.call_count)
    (h1, c1, n1), (h0, c0, n0) = res[True], res[False]
    out["stack"][f"{rows}x{t}"] = dict(same=torch.equal(h1, h0) and all(torch.equal(c1[i], c0[i]) for i in capture),
                                       sum_launches=[n1, n0], default_sum_launches=res["default"][2])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CASES)


def test_the_norm_sums_a_split_product_as_its_own_kernel_would(interpreted):
    assert len(interpreted["norm"]) == 4
    for c in interpreted["norm"]:
        assert c["same_h"] and c["same_y"] and c["dtype"] == "torch.bfloat16", c


def test_the_qk_norm_and_rotary_sum_a_split_product_as_its_own_kernel_would(interpreted):
    assert len(interpreted["rope"]) == 2
    for c in interpreted["rope"]:
        assert c["same"] and c["written"], c


def test_silu_mul_sums_a_split_product_as_its_own_kernel_would(interpreted):
    assert len(interpreted["silu"]) == 2
    for c in interpreted["silu"]:
        assert c["same"] and c["same_quantised"] and c["shape"] == [3, c["case"][1]], c


def test_decoder_steps_give_the_same_bits_without_summing_launches_of_their_own(interpreted):
    s = interpreted["stack"]
    # 2 layers x 4 split products summed by their own kernels, against only the last layer's down
    # (and a captured layer's) summed where the stack's output needs a tensor
    assert s["1x1"]["same"] and s["1x1"]["sum_launches"] == [1, 8], s
    assert s["2x8"]["same"] and s["2x8"]["sum_launches"] == [2, 8], s


def test_only_one_row_steps_defer_their_split_sums(interpreted):
    # measured on the H200 (layers.DEFER_SPLIT_SUMS_MAX_ROWS): deferred sums gain at one row and
    # cost 1.45x at 8 (a verify step); by default a 1-row step defers, a 16-row step does not
    s = interpreted["stack"]
    assert s["1x1"]["default_sum_launches"] == 1 and s["2x8"]["default_sum_launches"] == 8, s


def test_fp8_products_count_the_rows_of_a_split_product(monkeypatch):
    """`Fp8Linear.takes_fp8` on a `SplitSums` (a norm's input without a residual): its rows, not
    its partials' (it raised AttributeError before)."""
    import torch
    from torch import nn

    from worker.model import fp8
    from worker.model.fused_ops import SplitSums

    monkeypatch.setattr(fp8, "_has_fp8_mm", lambda device: True)
    monkeypatch.setattr(fp8, "available", lambda x: True)
    lin = fp8.Fp8Linear(nn.Linear(32, 16, bias=False))
    few = SplitSums(torch.zeros(4, 64, 32), None, (1, 64, 32), torch.bfloat16)       # 4 x 64 partial rows
    many = SplitSums(torch.zeros(2, 65, 32), None, (5, 13, 32), torch.bfloat16)
    assert not lin.takes_fp8(few) and lin.takes_fp8(many)
