"""fp8 profiles: e4m3 weights with one scale per output channel.

Which product runs, by the number of rows M (tokens) of the input:
  M <= WEIGHT_ONLY_MAX_ROWS, where the Triton kernels run (GPU, or TRITON_INTERPRET=1):
      weight-only fp8 (`stream_gemm.stream_linear`: bf16 activations, the weight widened in registers),
      bound by the weight's bytes like decode, verify, draft and expert steps are
  larger M on GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper): a real fp8
      matrix multiply (`torch._scaled_mm`, activations quantised per token on the fly by one kernel,
      `quantize_rows` below, or handed over quantised by the norm or silu * up kernel that makes
      them: `layers.norm_project`, `layers.silu_project`), bound by arithmetic like prefill is
  elsewhere (and for few rows inside `fused_ops.reference_only()`): the weight dequantised to the
      activation dtype (same numbers, no speed-up), so CPU tests exercise the same quantised weights.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.fused_ops import E4M3_MAX, available
from worker.model.modelopt import is_fp8_weight
from worker.model.stream_gemm import stream_linear, stream_linear_reference

try:                                   # Triton ships with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from worker.model.fused_ops import divide_rn, row_amax, row_scale
except ImportError:                    # pragma: no cover - exercised only on Triton-less installs
    triton = None

# Up to this many rows the weight-only kernel runs (its time is the weight's bytes, about half
# of bf16's); above it fp8 x fp8 `_scaled_mm` (arithmetic-bound: twice bf16's tensor-core rate).
# `python -m worker.kernel_check --sweep` times both forms at M = 1 ... 256 on the GPU.
WEIGHT_ONLY_MAX_ROWS = 64
# `_scaled_mm` with Hopper's fast fp8 accumulation (no periodic promotion to fp32; vLLM's CUTLASS
# fp8 kernels and torchao's fp8 forward do the same): the 32B prefill products at 4,623 rows ran
# 7-11% faster on the H200 (kernel_check --sweep --prefill, 2026-12-01: gate/up 1839 vs 2071 us,
# down 968 vs 1047); the error against the exact product of the same fp8 operands went from
# 1.67e-3 (the bf16 output's rounding) to 2.3e-3 (qkv, gate/up) and 4.4e-3 (down, K = 25,600),
# well under what quantising the activations to e4m3 costs.
FAST_ACCUM = True
# fp8 x fp8 products only for weights at least this wide and tall (the 32B shape's: 1,152 and up);
# smaller ones multiply many rows through the dequantised weight. The demo checkpoint's (128-768
# wide) are bound by their launches: H200, 2026-12-04, 630 rows, eager, 16-22 us a call against
# 21-26 for quantize_rows + _scaled_mm (`python -m worker.kernel_check --sweep --small`), its fp8
# prefill 5.6-5.8 ms a prompt against 6.1-6.3; and bf16 rows keep its fp8 prefill logits at cosine
# 0.99983 of bf16's (e4m3 rows: 0.99553, under the 0.999 bar).
FP8_MM_MIN_FEATURES = 1024


def quantize_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (M, K) -> (e4m3 (M, K), fp32 scale (M, 1)) with x2 ≈ q * scale: one scale per row, its
    largest magnitude mapped to e4m3's largest value (torch ops: five passes, fp32 temporaries)."""
    scale = (x2.abs().amax(dim=1, keepdim=True).float() * (1.0 / E4M3_MAX)).clamp(min=1e-12)
    return (x2.float() / scale).to(torch.float8_e4m3fn), scale


if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(X, Q, S, K, sx, sq, BLOCK: tl.constexpr, E4M3: tl.constexpr):
        row = tl.program_id(0)
        scale = row_scale(row_amax(X, row, sx, K, BLOCK), E4M3)
        tl.store(S + row, scale)
        inv = tl.math.div_rn(1.0, scale)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + cols, mask=cols < K, other=0.0)
            tl.store(Q + row * sq + cols, divide_rn(x.to(tl.float32), scale, inv).to(Q.dtype.element_ty),
                     mask=cols < K)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one kernel (two reads of each row, no temporaries; the same
    bits: the scale by the reciprocal's product, the values divided as IEEE division rounds
    (`fused_ops.divide_rn`), round to nearest even) where the kernels run; the torch ops elsewhere."""
    if not available(x2):
        return quantize_rows_reference(x2)
    m, k = x2.shape
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    _quantize_rows_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), BLOCK=min(4096, triton.next_power_of_2(k)),
                                E4M3=E4M3_MAX, num_warps=8 if k >= 4096 else 4)
    return q, scale


def _has_fp8_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) \
        and hasattr(torch, "_scaled_mm")


def _fast_product(w8: torch.Tensor) -> bool:
    """Whether many rows times the e4m3 weight w8 (out, in) run as `_scaled_mm` (fp8 tensor cores,
    dimensions multiples of 16, both at least FP8_MM_MIN_FEATURES) rather than the dequantised weight."""
    return _has_fp8_mm(w8.device) and all(d % 16 == 0 and d >= FP8_MM_MIN_FEATURES for d in w8.shape)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (its e4m3 values (out, in), fp32 scale per output channel (out,))."""
    w8, scale = quantize_rows_reference(weight.detach().float())
    return w8.contiguous(), scale[:, 0]


class Fp8Linear(nn.Module):
    """y = x W^T + b with W (out, in) stored as e4m3 and scale (out,) fp32: W ≈ W8 * scale[:, None]."""

    weight_only_rows = WEIGHT_ONLY_MAX_ROWS     # weight-only product up to this many rows (a module may set its own)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w8, scale = quantize_weight(linear.weight)
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.fast = _fast_product(w8)

    @classmethod
    def from_parts(cls, weight: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> "Fp8Linear":
        """An Fp8Linear over existing e4m3 weights (out, in) and scales (out,)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.register_buffer("weight", weight)
        m.register_buffer("weight_scale", scale)
        m.bias = None
        m.out_features, m.in_features = weight.shape
        m.compute_dtype = compute_dtype
        m.fast = _fast_product(weight)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.numel() <= self.weight_only_rows * self.in_features
        if few_rows and available(x):
            return stream_linear(x, self.weight, self.weight_scale, self.bias)
        if few_rows or not self.fast:           # few rows without the kernels (CPU, reference_only())
            return stream_linear_reference(x, self.weight, self.weight_scale, self.bias)
        return scaled_mm_linear(x, self.weight, self.weight_scale, self.bias)

    def takes_fp8(self, rows_of: torch.Tensor) -> bool:
        """True where `forward` would quantise an input with as many rows as `rows_of` (..., any)
        for `_scaled_mm` with the kernels on: then the op that makes the input hands it over
        quantised instead (`fused_ops`' quantize=True), for `forward_fp8`."""
        return self.fast and rows_of.numel() > self.weight_only_rows * rows_of.shape[-1] and available(rows_of)

    def forward_fp8(self, xq: torch.Tensor, x_scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`forward(x)` from x's M rows already quantised ((xq, x_scale) = `quantize_rows(x)`);
        like (..., any): M rows in x's dtype, whose leading dimensions the output (..., N) takes."""
        return fp8_product(xq, x_scale, self.weight, self.weight_scale, self.bias, like)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 x fp8 product on the tensor cores: x quantised to e4m3 per row, then `torch._scaled_mm`
    with both scales (GPUs with compute capability >= 8.9, dimensions multiples of 16)."""
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return fp8_product(xq, x_scale, weight, scale, bias, x)


def fp8_product(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """xq (M, K) e4m3 rows with scales x_scale (M, 1) times weight (N, K) e4m3 with scale (N,)
    -> (..., N) in like's dtype; like (..., any) has M rows. CUDA's kernel writes bf16 for fp32 rows
    and takes a bias only in its output dtype."""
    out_dtype = like.dtype if like.dtype != torch.float32 else torch.bfloat16
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale[None, :],
                         bias=None if bias is None else bias.to(out_dtype), use_fast_accum=FAST_ACCUM,
                         out_dtype=out_dtype)
    return y.to(like.dtype).reshape(*like.shape[:-1], weight.shape[0])


def quantize_linears(module: nn.Module, prefix: str = "", keep=None) -> int:
    """Replace every nn.Linear under `module` with an Fp8Linear; with `keep` (state-dict name of
    the weight, its shape -> bool) only those it keeps; prefix: `module`'s own name. -> how many."""
    n = 0
    for name, child in list(module.named_children()):
        full = prefix + name
        if isinstance(child, nn.Linear):
            if keep is None or keep(full + ".weight", child.weight.shape):
                setattr(module, name, Fp8Linear(child))
                n += 1
        else:
            n += quantize_linears(child, full + ".", keep)
    return n


def quantize_model_fp8(model) -> int:
    """fp8 for the linear layers `modelopt.is_fp8_weight` names (the decoder layers of the text
    stack and of the expert, the vision tower's blocks and mergers) that are not in fp8 already
    (a ModelOpt export's are); the rest stays in the compute dtype."""
    return quantize_linears(model, keep=is_fp8_weight)
