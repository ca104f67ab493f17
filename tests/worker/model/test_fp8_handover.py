"""A prompt's fp8 x fp8 products take their input already quantised from the kernel before them
(worker/model/fused_ops.py quantize=True; layers.norm_project, layers.silu_project): the RMSNorm
and silu * up kernels write e4m3 rows and scales, the bits `fp8.quantize_rows` gives for the output
they would have written, so the layer's results do not change. Through Triton's interpreter on the
CPU (torch's CPU `_scaled_mm` stands in for the GPU's), in one subprocess (`interpreted.py`)."""

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
from worker.model.fused_ops import add_rms_norm, silu_mul

gen = torch.Generator().manual_seed(11)
out = {"norm": [], "silu": [], "stack": {}}


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)


# the kernels: one block and several (silu: 4096 + 4 columns), with and without the residual add
for m, n, residual in [(5, 300, False), (4, 300, True), (3, 5000, True)]:
    x = (torch.randn(m, n, generator=gen) * 3).to(torch.bfloat16)
    r = torch.randn(m, n, generator=gen).to(torch.bfloat16) if residual else None
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    h, y = add_rms_norm(x, w, 1e-6, residual=r)
    hq, (q, s) = add_rms_norm(x, w, 1e-6, residual=r, quantize=True)
    rq, rs = fp8.quantize_rows(y)
    out["norm"].append(dict(case=[m, n, residual], q_dtype=str(q.dtype), s_shape=list(s.shape),
                            same_h=same(h, hq), same_q=same(q, rq), same_s=same(s, rs)))
import worker.model.fused_ops as fused_ops
for m, n, row_max in [(4, 300, 32768), (3, 4100, 32768), (3, 4100, 4096), (2, 9000, 4096)]:
    fused_ops.ROW_MAX = row_max                  # rows of more columns take the two-pass form
    gu = (torch.randn(m, 2 * n, generator=gen) * 2).to(torch.bfloat16)
    gu[1, :n] = -30.0                                 # a row whose silu is all but zero: the scale's floor
    q, s = silu_mul(gu, quantize=True)
    rq, rs = fp8.quantize_rows(silu_mul(gu))
    out["silu"].append(dict(case=[m, n, row_max], q_dtype=str(q.dtype), s_shape=list(s.shape), same_q=same(q, rq),
                            same_s=same(s, rs)))
fused_ops.ROW_MAX = 32768

# the vision tower's LayerNorm (bias; the residual add) and tanh GELU (one pass and two)
import torch.nn.functional as F
from worker.model.fused_ops import add_layer_norm, gelu_tanh_rows
out["layer_norm"], out["gelu"] = [], []
for m, n, residual in [(5, 300, False), (4, 1152, True)]:
    x = (torch.randn(m, n, generator=gen) * 3 + 1).to(torch.bfloat16)
    r = torch.randn(m, n, generator=gen).to(torch.bfloat16) if residual else None
    w, b = (torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2))
    h, y = add_layer_norm(x, w, b, 1e-6, residual=r)
    hq, (q, s) = add_layer_norm(x, w, b, 1e-6, residual=r, quantize=True)
    rq, rs = fp8.quantize_rows(y)
    want_h = x.float() + (r.float() if residual else 0)
    want = F.layer_norm(want_h, (n,), w.float(), b.float(), 1e-6)
    out["layer_norm"].append(dict(case=[m, n, residual], same_h=same(h, hq), same_q=same(q, rq), same_s=same(s, rs),
                                  h_err=float((h.float() - want_h).abs().max() / want_h.abs().max()),
                                  y_err=float((y.float() - want).norm() / want.norm())))
for m, n, row_max in [(4, 300, 32768), (3, 4304, 32768), (3, 4304, 4096)]:
    fused_ops.ROW_MAX = row_max
    x = (torch.randn(m, n, generator=gen) * 3).to(torch.bfloat16)
    x[1] = -30.0                                      # a row whose GELU is all but zero: the scale's floor
    q, s = gelu_tanh_rows(x)
    rq, rs = fp8.quantize_rows(F.gelu(x, approximate="tanh"))
    got, want = q.float() * s, rq.float() * rs
    out["gelu"].append(dict(case=[m, n, row_max], q_dtype=str(q.dtype), s_shape=list(s.shape), same_s=same(s, rs),
                            same_q_fraction=float((q.view(torch.uint8) == rq.view(torch.uint8)).float().mean()),
                            err=float((got - want).norm() / want.norm())))
fused_ops.ROW_MAX = 32768

# a 2-layer fp8 stack whose products take the fp8 x fp8 path (`fast`, as on an fp8 GPU)
conf = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_hidden_layers=2, vocab_size=32)
torch.manual_seed(3)
layers = [Qwen3DecoderLayer(conf, i).eval().requires_grad_(False).to(torch.bfloat16) for i in range(2)]
from worker.model.layers import FusedStack
with mock.patch.object(fp8, "_has_fp8_mm", return_value=True), mock.patch.object(fp8, "FP8_MM_MIN_FEATURES", 16):
    assert fp8.quantize_linears(torch.nn.ModuleList(layers)) == 14
    stack = FusedStack(layers, head_dim=16)
assert all(isinstance(p[0], fp8.Fp8Linear) and p[0].fast for p in stack.parts)

def run_both(fn):
    # -> (output handed over, output quantised by the products themselves, quantize_rows calls of each)
    res = []
    for handover in (True, False):
        with mock.patch.object(fp8, "quantize_rows", wraps=fp8.quantize_rows) as spy:
            if handover:
                y = fn()
            else:
                with mock.patch.object(fp8.Fp8Linear, "takes_fp8", return_value=False):
                    y = fn()
        res.append((y, spy.call_count))
    return res

# a vision block whose four products multiply in fp8 x fp8: the norms and the GELU hand over
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock
from worker.model.fast_vision import _fp8_block, _vision_block_fp8
vconf = Qwen3VLConfig().vision_config
vconf.hidden_size, vconf.intermediate_size, vconf.num_heads = 64, 160, 4
torch.manual_seed(5)
block = Qwen3VLVisionBlock(vconf).eval().requires_grad_(False).to(torch.bfloat16)
for norm in (block.norm1, block.norm2):
    torch.nn.init.normal_(norm.weight, 1.0, 0.2), torch.nn.init.normal_(norm.bias, 0.0, 0.2)
out["vision_block"] = dict(before=_fp8_block(block))
with mock.patch.object(fp8, "_has_fp8_mm", return_value=True), mock.patch.object(fp8, "FP8_MM_MIN_FEATURES", 16):
    assert fp8.quantize_linears(block) == 4
out["vision_block"]["after"] = _fp8_block(block)
xv = torch.randn(3 * 40, 64, generator=gen).to(torch.bfloat16)      # 3 images of 40 patches
cu = torch.tensor([0, 40, 80, 120], dtype=torch.int32)
angles = torch.randn(120, 8, generator=gen)
pe = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
(a, na), (b, nb) = run_both(lambda: _vision_block_fp8(block, xv, cu, position_embeddings=pe, memo=[None]))
out["vision_block"].update(calls=[na, nb], rel=float((a.float() - b.float()).norm() / b.float().norm()),
                           finite=bool(a.isfinite().all()))

p_tokens = 80
h = torch.randn(1, p_tokens, 64, generator=gen).to(torch.bfloat16)
cos = torch.randn(1, p_tokens, 16, generator=gen).to(torch.bfloat16)
sin = torch.randn(1, p_tokens, 16, generator=gen).to(torch.bfloat16)
(a, na), (b, nb) = run_both(lambda: stack.prefill_layer(0, h, cos, sin, [None]))
out["stack"]["prefill"] = dict(same=torch.equal(a, b), calls=[na, nb], finite=bool(a.isfinite().all()))

def step(rows, t):
    caches = [(torch.zeros(rows, 2, 128, 16, dtype=torch.bfloat16), torch.zeros(rows, 2, 128, 16, dtype=torch.bfloat16))
              for _ in range(2)]
    x = torch.randn(rows, t, 64, generator=torch.Generator().manual_seed(rows * 100 + t)).to(torch.bfloat16)
    start = torch.tensor([3, 9, 0, 5][:rows])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    y, _ = stack.run(x, caches, start, torch.zeros(rows, dtype=torch.long), inv_freq, 1.0, causal=True)
    return y

# a verify-sized step (4 rows of 20 tokens = 80 > WEIGHT_ONLY_MAX_ROWS): handed over; 2 rows of 8: weight-only
(a, na), (b, nb) = run_both(lambda: step(4, 20))
out["stack"]["step80"] = dict(same=torch.equal(a, b), calls=[na, nb])
(a, na), (b, nb) = run_both(lambda: step(2, 8))
out["stack"]["step16"] = dict(same=torch.equal(a, b), calls=[na, nb])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CASES)


def test_norm_hands_over_the_bits_quantize_rows_gives_its_output(interpreted):
    assert [c["case"] for c in interpreted["norm"]] == [[5, 300, False], [4, 300, True], [3, 5000, True]]
    for c in interpreted["norm"]:
        assert c["q_dtype"] == "torch.float8_e4m3fn" and c["s_shape"] == [c["case"][0], 1], c
        assert c["same_h"] and c["same_q"] and c["same_s"], c


def test_silu_mul_hands_over_the_bits_quantize_rows_gives_its_output(interpreted):
    # one pass (the row held in registers), and two over 4,096-column blocks (rows wider than ROW_MAX)
    assert [c["case"] for c in interpreted["silu"]] == [[4, 300, 32768], [3, 4100, 32768], [3, 4100, 4096],
                                                        [2, 9000, 4096]]
    for c in interpreted["silu"]:
        assert c["q_dtype"] == "torch.float8_e4m3fn" and c["s_shape"] == [c["case"][0], 1], c
        assert c["same_q"] and c["same_s"], c


def test_the_vision_layer_norm_hands_over_the_bits_quantize_rows_gives_its_output(interpreted):
    assert [c["case"] for c in interpreted["layer_norm"]] == [[5, 300, False], [4, 1152, True]]
    for c in interpreted["layer_norm"]:
        assert c["same_h"] and c["same_q"] and c["same_s"], c
        # torch's LayerNorm in fp32 (the interpreter rounds to bf16 its own way: no bit check here;
        # `worker.kernel_check` counts the values that differ from torch's on the GPU)
        assert c["h_err"] < 8e-3 and c["y_err"] < 8e-3, c


def test_the_gelu_hands_over_quantize_rows_of_torchs_values(interpreted):
    assert [c["case"] for c in interpreted["gelu"]] == [[4, 300, 32768], [3, 4304, 32768], [3, 4304, 4096]]
    for c in interpreted["gelu"]:
        assert c["q_dtype"] == "torch.float8_e4m3fn" and c["s_shape"] == [c["case"][0], 1], c
        # the interpreter's tanh stand-in and its e4m3 rounding differ from the GPU's in a few values
        assert c["same_s"] and c["same_q_fraction"] > 0.9 and c["err"] < 5e-2, c


def test_an_fp8_vision_block_quantises_one_input_instead_of_four(interpreted):
    v = interpreted["vision_block"]
    assert not v["before"] and v["after"], v            # only fp8 products take the path
    # handed over: only the attention's output is quantised by its product; before, all four inputs
    assert v["calls"] == [1, 4] and v["finite"] and v["rel"] < 3e-2, v


def test_fp8_layers_give_the_same_output_with_one_quantising_pass_instead_of_four(interpreted):
    s = interpreted["stack"]
    # a prompt's layer: only the o projection's input (the attention's output) is still quantised apart
    assert s["prefill"]["same"] and s["prefill"]["finite"] and s["prefill"]["calls"] == [1, 4], s
    # the stack's step over 80 rows (2 layers), likewise; 16 rows stream the weights (nothing quantised)
    assert s["step80"]["same"] and s["step80"]["calls"] == [2, 8], s
    assert s["step16"]["same"] and s["step16"]["calls"] == [0, 0], s


def test_row_scales_are_the_largest_magnitude_times_the_reciprocal_of_e4m3s_largest():
    """torch on CUDA computes `amax / 448` as amax * fp32(1/448) (on the CPU as a division); the
    kernels' IEEE division matched the CPU and missed CUDA torch in every row measured on the H200
    (2026-12-01). The reference now says the product, which is the same bits everywhere."""
    import torch

    from worker.model.fp8 import quantize_rows_reference
    from worker.model.fused_ops import E4M3_MAX

    x = torch.linspace(0.5, 64.0, 4096).to(torch.bfloat16).unique().view(-1, 1)    # one row each
    _, scale = quantize_rows_reference(x)
    product = x.float() * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    assert torch.equal(scale, product.clamp(min=1e-12))
    assert not torch.equal(product, x.float() / E4M3_MAX)     # the two forms differ on these values


def test_an_fp8_product_of_fp32_rows_passes_its_bias_in_the_output_dtype(monkeypatch):
    """CUDA's `_scaled_mm` writes bf16 for fp32 rows and refuses a bias in another dtype ("Bias
    must be BFloat16 or Half"): the GPU kernel check's fp32 fp8 prefill (vision products with
    bias) stopped there. The CPU's kernel accepts it, so its CUDA rule stands in here."""
    import torch

    import worker.model.fp8 as fp8

    real = torch._scaled_mm

    def cuda_rule(a, b, *, bias=None, out_dtype=None, **kw):
        assert bias is None or bias.dtype == out_dtype, f"bias {bias.dtype}, output {out_dtype}"
        return real(a, b, bias=bias, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rule)
    w8, scale = fp8.quantize_weight(torch.randn(32, 64))
    x = torch.randn(16, 64)
    xq, xs = fp8.quantize_rows_reference(x)
    y = fp8.fp8_product(xq, xs, w8, scale, torch.randn(32), x)
    assert y.dtype == torch.float32 and y.shape == (16, 32)
