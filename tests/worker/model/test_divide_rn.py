"""`fused_ops.divide_rn`, the division by a row's scale inside the fp8 quantising kernels (norm,
silu * up and `quantize_rows` hand `_scaled_mm` e4m3 rows that must be `quantize_rows_reference`'s
bits): a product by the scale's reciprocal and Markstein's FMA correction, instead of IEEE division
(div.rn.f32). Through Triton's interpreter (its FMA rounds once, as the GPU's does), against
torch's fp32 division: every finite bf16 value over scales of many decades, and wide-range fp32
rows, each value at most its row's largest magnitude (amax = 448 scale). (On the GPU:
`python -m worker.kernel_check`, the "same bits" rows.)"""

from __future__ import annotations

import pytest

from tests.worker.model.interpreted import run_interpreted

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from worker.model.fused_ops import divide_rn  # noqa: E402


@triton.jit
def _divide_kernel(X, S, Y, n, BLOCK: tl.constexpr):
    """Y[r, c] = divide_rn(X[r, c], S[r])."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0)
    scale = tl.load(S + row)
    tl.store(Y + row * n + cols, divide_rn(x, scale, tl.math.div_rn(1.0, scale)), mask=mask)


_CASES = r"""
import json
import torch
import triton
from tests.worker.model.test_divide_rn import _divide_kernel

gen = torch.Generator().manual_seed(5)
amax = torch.cat([torch.rand(36, generator=gen) * 10.0 ** torch.arange(-9, 9, 0.5),
                  torch.tensor([448.0, 1.0, 3.0, 0.0])])
xb = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
xb = xb[xb.isfinite()].expand(len(amax), -1)                 # every finite bf16 value, both zeros, in each row
xb = torch.where(xb.abs() <= amax[:, None], xb, 0.0).contiguous()      # none above its row's amax
xf = torch.randn(40, 20000, generator=gen) * 10.0 ** torch.randint(-12, 12, (40, 1), generator=gen)
xf = (xf * torch.exp(torch.randn(xf.shape, generator=gen) * 4)).contiguous()   # wide range within a row
out = {}
for name, x in [("bf16", xb), ("fp32", xf)]:
    m, n = x.shape
    scales = (x.abs().amax(1) * (1.0 / 448.0)).clamp(min=1e-12)   # row_scale's arithmetic
    y = torch.empty(m, n)
    _divide_kernel[(m, triton.cdiv(n, 8192))](x, scales, y, n, BLOCK=8192)
    ieee = x / scales[:, None]
    plain = x * (1.0 / scales)[:, None]
    ok = x.abs() >= 2.0 ** -100
    out[name] = dict(
        values=y.numel(), normal=int(ok.sum()),
        differ=int(((y.view(torch.int32) != ieee.view(torch.int32)) & ok).sum()),
        sign_differs=int((torch.signbit(y) != torch.signbit(ieee)).sum()),
        largest_below=float(y[~ok].abs().max()) if (~ok).any() else 0.0,
        plain_product_differs=int(((plain.view(torch.int32) != ieee.view(torch.int32)) & ok).sum()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def divided():
    return run_interpreted(_CASES)


@pytest.mark.parametrize("values", ["bf16", "fp32"])
def test_divide_rn_gives_ieee_divisions_bits(divided, values):
    c = divided[values]
    assert c["normal"] >= 500_000 and (values == "fp32" or c["values"] > c["normal"]), c   # bf16: tiny ones too
    assert c["differ"] == 0 and c["sign_differs"] == 0, c
    assert c["largest_below"] < 2.0 ** -60, c                  # e4m3 rounds it to a zero of x's sign
    assert c["plain_product_differs"] > 0, c                   # the correction is needed: the check can fail
