"""Weight-streaming products for few rows: y = x @ (W * scale[:, None])^T + bias.

x (..., K) in the activation dtype (bf16 on the GPU); W (N, K) either e4m3 as `Fp8Linear` stores
it with scale (N,) fp32 per output channel (the fp8 profiles' weight-only product), or a plain
weight in the activation dtype with no scale (`layers.project`: the bf16 q/k/v and gate/up
products of at most 8 rows); y (..., N) in x's dtype. With few rows (decode 1-32, verify 8 tokens
per row, draft, expert) the product is bound by the weight's bytes, so the kernel streams W once
(an fp8 weight: half the bytes of bf16), widens it to the activation dtype in registers,
accumulates in fp32 and applies the channel scale (and bias) in the epilogue.

Two forms, chosen per number of rows by `LAUNCH_CONFIGS`:
  gemv  one row per program: each program reads a (BLOCK_N, BLOCK_K) slab of W8 per step with
        16-byte loads along K and sums its products with the row's x into BLOCK_N fp32 sums
        (no tensor cores: a matrix-vector product has nothing for them to do; summing every step
        keeps registers low, so more programs, and more loads, are in flight per multiprocessor)
  dot   a (BLOCK_M, BLOCK_N) tile per program through tensor cores (tl.dot, BLOCK_M >= 16); for
        33-64 rows with its operands swapped, (W x^T)^T: the widened weight tile is the wide left
        operand and the rows the narrow right one (vLLM's CUTLASS fp8 kernels swap A and B for few
        rows too). H200, 2026-12-02, 64 rows, each shape's best swapped tile: the 32B layer's
        four products 282 against 380 us unswapped, the expert's 59 against 68 (the table's one
        tile, 128 wide with 8 warps, was the best for gate/up and down, 64 wide for qkv and o);
        at 8-32 rows no faster (0.89-1.04x), not used there. For 2-16 rows (verify(8) at batch 1-2)
        with fp16 operands (`f16_tile_product`): widening e4m3 to bf16 takes three conversions per two
        values (e4m3x2 -> f16x2, then each f16 -> bf16; the bf16 form ran at ~65% of the copy
        bandwidth), to fp16 one. H200, 2026-12-03 (`.run/sweep8b.py`, the 32B layer's four
        products, us): 8 rows 177.3 -> 160.8, 16 rows 182.9 -> 167.6; 32 rows 214 -> 243 and 64
        rows 293 -> 400 (not used there); fp8 verify(8) step, batch 1, 13.47 -> 12.51 ms. Its own
        table (`F16_LAUNCH_CONFIGS`): 128-wide tiles split for ~2.4 programs a multiprocessor.
        For 17-32 rows the rows are made fp16 once, before the product (`_f16_rows_kernel`: one
        power of two per row, not per tile), so each tile's products accumulate in the tensor cores: scaling
        each tile's rows cost more there than the conversions it saves. Bit moves in place of the
        e4m3 -> fp16 conversion (integer ops, or PTX byte permutes as fp8 Marlin does) were slower
        at 8-64 rows (H200, 2026-12-04: 179-271 against 148 us a layer at 8 rows), and a widening
        left out altogether (garbage values, timing only) was not faster: the conversion is not
        what holds the 8-row products at ~79% of the copy bandwidth.
Both split K across programs when the output tiles alone would leave multiprocessors idle
(`split_count`): each split writes an fp32 partial and a second kernel sums the splits in a
fixed order (no atomics), so a second launch gives the same bits. Launch shapes depend only on
(M, N, K) and the device, so a CUDA graph captures them (no host sync; the workspace's size is
fixed by the captured shapes).

Public designs read first (none copied): gemlite's GEMV / split-K kernels (autotuned, split-K
summed with atomic adds: not deterministic), vLLM's Triton w8a16 and FBGEMM's fp8 row-wise
split-K GEMMs. Measured against the libraries themselves (H200, 2026-12-04, `python -m
worker.kernel_check --fp8-only --sweep --libraries`, the 32B layer's four products at 1 / 8 / 16 /
32 rows): this kernel 123.6 / 146.4 / 147.6 / 204.4 us, gemlite's A16W8_FP8 140.5 / 165.7 / 164.5 /
228.5 (other bits on a second call at 8-32 rows), FBGEMM gen-ai's fp8 gemv 276.3 at one row (wrong
at more), torchao's fp8 weight-only config ~3,830 (it dequantises the weight every call).

Elsewhere (no Triton, or inside `fused_ops.reference_only()`) `stream_linear_reference` is the
(dequantised) product. Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU for
tests; its tl.dot mishandles bf16 operands (Triton 3.9), so there the dot form widens both to fp32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.fused_ops import launch_args

try:                                   # Triton ships with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl

    from worker.model.fused_ops import gdc_enter, row_amax
except ImportError:                    # pragma: no cover - exercised only on Triton-less installs
    triton = None


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int                       # 1 = gemv form (one row per program), else tl.dot tiles (>= 16)
    block_n: int
    block_k: int
    warps: int
    stages: int
    swap_ab: bool = False              # dot form as (W x^T)^T: the widened weight tile is the product's
                                       # left operand, the few rows its narrow right one
    f16: bool = False                  # dot form with fp16 operands for e4m3 weights and bf16 / fp16 rows
                                       # (`f16_tile_product`: e4m3 -> fp16 is one conversion per two values,
                                       # -> bf16 three)
    f16_rows: bool = False             # ... with the rows made fp16 once, before the product
                                       # (`_f16_rows_kernel`: one power of two per row), so the tiles
                                       # accumulate in the tensor cores (not swapped)
    programs_per_sm: float | None = None   # `split_count`'s target (None: PROGRAMS_PER_SM, 1 for 2-byte weights)


# (most rows, config): the first entry whose row count covers M; the last covers any larger M.
LAUNCH_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(block_m=1, block_n=16, block_k=1024, warps=4, stages=2)),
    (16, LaunchConfig(block_m=16, block_n=64, block_k=128, warps=4, stages=4)),
    (32, LaunchConfig(block_m=32, block_n=64, block_k=128, warps=4, stages=4)),
    (64, LaunchConfig(block_m=64, block_n=128, block_k=128, warps=8, stages=3, swap_ab=True)),
    (256, LaunchConfig(block_m=64, block_n=128, block_k=64, warps=8, stages=3)),
)
# ... for e4m3 weights and bf16 / fp16 rows (`f16_operands`), looked up first: the fp16 dot form. H200,
# 2026-12-03 (`.run/sweep8.py`, the 32B layer's four products, us a layer at 2 / 8 / 16 rows): 64-wide
# tiles under the general split rule (7-16 splits) 153.7 / 160.1 / 166.4; 128-wide tiles split for
# about 2.4 programs a multiprocessor (qkv 4 splits, o 8, gate/up 1, down 8) 144.7 / 145.5 / 148.7,
# within 0.4 of the best tile and split count of each product; fp8 verify(8), batch 1, 12.56 -> 11.70 ms
# 17-32 rows (verify(8) at batch 3-4 and at K=3, decode at batch 17-32): the rows made fp16 before the
# product. H200, 2026-12-04 (`.run/conv24.py`, the 32B layer's four products, us a layer at 24 / 32 rows,
# the rows' kernels included): 205.1 / 209.9 against 221.0 / 218.9 for the bf16 dot form and 233.6 / 233.1
# for rows scaled tile by tile; at 8 / 16 rows 181.0 / 185.5 against the tile form's 148.2 / 151.3
F16_LAUNCH_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (16, LaunchConfig(block_m=16, block_n=128, block_k=128, warps=4, stages=3, f16=True, programs_per_sm=2.4)),
    (32, LaunchConfig(block_m=32, block_n=128, block_k=128, warps=4, stages=4, f16=True, f16_rows=True,
                      programs_per_sm=2.4)),
)
PROGRAMS_PER_SM = 8                    # split K until about this many programs per multiprocessor (the gemv
                                       # form at 61 registers x 128 threads fits 8); 2-byte weights: 1 (their
                                       # tiles stream twice the bytes; the H200 sweep of 2026-12-01 measured
                                       # the 32B qkv and gate/up products fastest unsplit at 1-8 rows)
MIN_STEPS_PER_SPLIT = 4                # ... while each split still streams this many BLOCK_K steps
L2_PARTIAL_BYTES = 8 << 20             # fp32 partials this small (written and read once) stay in the L2 cache:
                                       # allowed however they compare to the weight. H200, 2026-12-02, the
                                       # expert's 64-row products (K 1,536-6,144), us unsplit / split: qkv
                                       # 16.3 / 9.2 (3), o 21.0 / 8.1 (4), down 19.8 (3) / 11.1 (8)
MAX_SPLITS = 16
REDUCE_BLOCK = 1024                    # output columns per program of the split-sum kernel
F16_ROWS_BLOCK = 2048                  # columns per step of `_f16_rows_kernel` (H200: 2.3 / 6.8 us for 24 rows
                                       # of 5,120 / 25,600)
SMS_WITHOUT_CUDA = 132                 # the interpreter's stand-in for a device's multiprocessor count
# Triton chooses interpreter or compiler when the kernels below are defined (module import)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"




def launch_config(rows: int, weight_bytes: int = 1, f16: bool = False) -> LaunchConfig:
    """The table's entry for `rows` (F16_LAUNCH_CONFIGS' first where `f16`, the operands `f16_operands`
    allows, and more than one row); one row streams 1 KiB of each of 16 weight rows per step
    whatever the weight's width (fp8: 1024 inputs, bf16: 512). H200 sweeps of 2026-12-01 on the
    32B layer at one row: fp8 130.8 us a layer against 136.4 with 32 x 256; bf16 (N, K) qkv and
    gate/up 25.8 / 119.0 us against cuBLAS's 28.1 / 130.6."""
    if rows == 1 and weight_bytes != 1:
        c = LAUNCH_CONFIGS[0][1]
        return LaunchConfig(c.block_m, c.block_n, c.block_k // weight_bytes, c.warps, c.stages)
    if f16 and rows > 1:
        for most, config in F16_LAUNCH_CONFIGS:
            if rows <= most:
                return config
    for most, config in LAUNCH_CONFIGS:
        if rows <= most:
            return config
    return LAUNCH_CONFIGS[-1][1]


_sm_counts: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return SMS_WITHOUT_CUDA
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def split_count(rows: int, n: int, k: int, config: LaunchConfig, sms: int, weight_bytes: int = 1) -> int:
    """How many K splits: enough programs for the config's programs_per_sm per multiprocessor
    (default PROGRAMS_PER_SM, one for 2-byte weights), each split at least MIN_STEPS_PER_SPLIT steps
    of BLOCK_K, at most MAX_SPLITS, and the fp32 partials (written, then read back: 8 bytes x splits
    x rows x N) under a quarter of the weight's N x K or under L2_PARTIAL_BYTES."""
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    per_sm = config.programs_per_sm or (PROGRAMS_PER_SM if weight_bytes == 1 else 1)
    want = math.ceil(per_sm * sms / tiles)
    steps = -(-k // config.block_k)
    partials = max(k // (32 * rows), L2_PARTIAL_BYTES // (8 * rows * n))
    return max(1, min(want, steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS, partials))


def f16_operands(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether both operands convert to fp16 exactly (e4m3 weights; bf16 / fp16 rows, scaled by
    `f16_tile_product`)."""
    return weight_dtype == torch.float8_e4m3fn and x_dtype in (torch.bfloat16, torch.float16)


def takes_f16(config: LaunchConfig, weight_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether a launch of `config` runs the fp16 dot form."""
    return config.f16 and config.block_m > 1 and f16_operands(weight_dtype, x_dtype)


def stream_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The (dequantised) product in x's dtype (what the kernels compute, up to summation order)."""
    if scale is None:
        return F.linear(x, weight.to(x.dtype), bias)
    w = (weight.to(torch.float32) * scale[:, None].to(torch.float32)).to(x.dtype)
    return F.linear(x, w, bias)


if triton is not None:
    @triton.jit
    def f16_scales(amax):
        """The powers of two (up, down) that put a row's largest magnitude `amax` in [2^14, 2^15) and
        back (fp32; all-zero rows: any scale)."""
        ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141
        ex = tl.minimum(tl.maximum(ex, -100), 100)
        return ((127 - ex) << 23).to(tl.float32, bitcast=True), ((127 + ex) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def f16_tile_product(x, w, SWAP_AB: tl.constexpr):
        """x (BLOCK_M, BLOCK_K) bf16 times w (BLOCK_N, BLOCK_K) e4m3, transposed, in fp32 through fp16
        tensor-core operands: w widened to fp16 (exact, one conversion per two values), each row of x
        scaled by a power of two that puts its largest magnitude in [2^14, 2^15) (exact for bf16
        values: no overflow past fp16's 65,504, no loss to its subnormals above 2^-28 of the row's
        largest), the tile's product scaled back. (BLOCK_M, BLOCK_N), or (BLOCK_N, BLOCK_M) with SWAP_AB."""
        xf = x.to(tl.float32)
        up, down = f16_scales(tl.max(tl.abs(xf), axis=1))
        xs = (xf * up[:, None]).to(tl.float16)
        if SWAP_AB:
            y = tl.dot(w.to(tl.float16), tl.trans(xs)) * down[None, :]
        else:
            y = tl.dot(xs, tl.trans(w.to(tl.float16))) * down[:, None]
        return y

    @triton.jit
    def _f16_rows_kernel(X, X16, DOWN, K, sx, BLOCK: tl.constexpr, GDC: tl.constexpr):
        """One program a row: X16 = the row times the power of two `f16_scales` gives for its largest
        magnitude, in fp16 (exact for bf16 values down to 2^-31 of it); DOWN = the power back."""
        gdc_enter(GDC)
        row = tl.program_id(0)
        up, down = f16_scales(row_amax(X, row, sx, K, BLOCK))
        tl.store(DOWN + row, down)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + cols, mask=cols < K, other=0.0).to(tl.float32)
            tl.store(X16 + row * K + cols, (x * up).to(tl.float16), mask=cols < K)

    @triton.jit
    def _stream_kernel(X, W, SCALE, BIAS, Y, PART, DOWN, M, N, K, sx_m, sw_n, sw_k, sy_m, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr, F16: tl.constexpr, F16_ROWS: tl.constexpr,
                   GDC: tl.constexpr):
        gdc_enter(GDC)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_start = pid_k * k_per_split
        k_stop = tl.minimum(k_start + k_per_split, K)
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < K
                x = tl.load(X + offs_m[:, None] * sx_m + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k, mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0)
            if BLOCK_M == 1:                                    # gemv: x (1, BLOCK_K) against each row of W
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
            elif F16_ROWS:                                      # x: fp16 rows of `_f16_rows_kernel`
                acc = tl.dot(x, tl.trans(w.to(tl.float16)), acc)
            elif F16:                                           # fp16 operands, x's rows scaled by powers of two
                acc += f16_tile_product(x, w, SWAP_AB)
            elif SWAP_AB and DOT_FP32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
            elif SWAP_AB:                                       # (BLOCK_N, BLOCK_K) x (BLOCK_K, BLOCK_M)
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
            elif DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if SWAP_AB:
            acc = tl.trans(acc)
        if F16_ROWS:
            acc = acc * tl.load(DOWN + offs_m, mask=m_ok, other=1.0)[:, None]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            y = acc
            if HAS_SCALE:
                y = y * tl.load(SCALE + offs_n, mask=n_ok, other=0.0)[None, :]
            if HAS_BIAS:
                y += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + offs_m[:, None] * sy_m + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(PART + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)

    @triton.jit
    def _sum_splits_kernel(PART, SCALE, BIAS, Y, M, N, sy_m, SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):                        # fixed order: the same bits every launch
            acc += tl.load(PART + (s * M + row) * N + cols, mask=ok, other=0.0)
        y = acc
        if HAS_SCALE:
            y = y * tl.load(SCALE + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(BIAS + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * sy_m + cols, y.to(Y.dtype.element_ty), mask=ok)


def stream_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: LaunchConfig | None = None,
                  splits: int | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K) e4m3 (or, with scale None, in x's dtype: a plain product), scale (N,)
    fp32 or None, bias (N,) or None -> (..., N) in x's dtype (written into `out`, contiguous
    (..., N), when given). The weight may be any (N, K) view with one unit stride (a transposed
    (K, N) store too). `config` / `splits` override the table and the split rule (the GPU sweep
    compares them)."""
    n, k = weight.shape
    if 1 not in weight.stride():
        raise ValueError(f"stream_linear: weight must be contiguous along N or K (strides {tuple(weight.stride())})")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    config = config or launch_config(rows, weight.element_size(), f16_operands(weight.dtype, x2.dtype))
    if splits is None:
        splits = split_count(rows, n, k, config, _multiprocessors(x.device), weight.element_size())
    steps = -(-k // config.block_k)
    k_per_split = -(-steps // splits) * config.block_k
    splits = -(-k // k_per_split)                   # no empty split
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out.view(rows, n)
    part = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    s = scale if scale is not None else y
    b = bias if bias is not None else s
    f16 = takes_f16(config, weight.dtype, x2.dtype)
    f16_rows = f16 and config.f16_rows and not config.swap_ab
    down = y
    if f16_rows:
        x16 = torch.empty(rows, k, dtype=torch.float16, device=x.device)
        down = torch.empty(rows, dtype=torch.float32, device=x.device)
        _f16_rows_kernel[(rows,)](x2, x16, down, k, x2.stride(0), BLOCK=F16_ROWS_BLOCK, num_warps=4, **launch_args(x2))
        x2 = x16
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, config.block_m), splits)
    _stream_kernel[grid](x2, weight, s, b, y, part, down, rows, n, k, x2.stride(0), weight.stride(0), weight.stride(1),
                     y.stride(0), k_per_split, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                     BLOCK_K=config.block_k, SPLIT=splits, EVEN_K=k % config.block_k == 0,
                     HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, DOT_FP32=_INTERPRETED,
                     SWAP_AB=config.swap_ab and config.block_m > 1, F16=f16, F16_ROWS=f16_rows,
                     num_warps=config.warps, num_stages=config.stages, **launch_args(x2))
    if splits > 1:
        _sum_splits_kernel[(rows, triton.cdiv(n, REDUCE_BLOCK))](
            part, s, b, y, rows, n, y.stride(0), SPLIT=splits, HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4, **launch_args(x2))
    return y.view(*x.shape[:-1], n)
