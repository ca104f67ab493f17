"""Fused element-wise work of a decoder layer, as Triton kernels (GPU path; the reference ops
live in `decoder.py` and run on the CPU).

  add_rms_norm        residual add + RMSNorm in one pass (transformers' Qwen3RMSNorm rounding:
                      normalise in fp32, cast, then scale by the weight)
  qk_norm_rope_write  after the fused q/k/v projection: per-head RMSNorm of q and k, rotary at
                      each token's position, q to a (B, T, Hq, D) buffer, k and v straight into
                      the KV cache at their positions (replaces ~14 small kernels and two scatters)
  silu_mul            silu(gate) * up over the fused gate/up projection's output
  add_layer_norm      add_rms_norm's kernel as torch's LayerNorm (bias), for the vision tower
  gelu_tanh_rows      the vision tower's tanh GELU, only as its fp8 product's quantised input

add_rms_norm, add_layer_norm and silu_mul can also hand their output over quantised for an fp8 x fp8 product
(`quantize=True`: e4m3 values and one fp32 scale per row, the bits `fp8.quantize_rows` gives for
the output they would have written), so a prompt's activations are not read twice more and
written once more by a separate quantising kernel before each of its fp8 products.

Each rounds to the activation dtype where the torch reference does, so bf16 results match the
reference up to the order of fp32 reductions.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:                                   # Triton ships with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:                    # pragma: no cover
    triton = None


_reference_only = False
# e4m3's largest finite value: a row's largest magnitude maps to it when activations are quantised.
E4M3_MAX = 448.0


def available(x: torch.Tensor) -> bool:
    """True where the fused kernels run: tensors on a GPU, or TRITON_INTERPRET=1 (CPU tests),
    unless inside `reference_only()`."""
    return not _reference_only and triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# Programmatic dependent launch (Hopper and later): each kernel below may be launched while the
# previous kernel of the stream is still finishing; its first instruction waits for that kernel's
# completion and memory (`griddepcontrol.wait`), then lets the next kernel launch early. What it
# hides is the launch gap between the many small kernels of a decode step (captured in the same
# CUDA graphs). Off: plain launches. Measured on the H200 (2026-12-01, docs/benchmarks.md): the
# decode step at batch 1 16.97 against 17.21 ms, and 17.85-18.06 against 18.11 ms before the
# one-row products changed.
PDL = True
_capability: dict[int, tuple[int, int]] = {}


def compiled(x: torch.Tensor) -> bool:
    """True where the kernels for x are compiled for its GPU (not run by Triton's interpreter)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def pdl(x: torch.Tensor) -> bool:
    """True where kernels launch with programmatic dependent launch: compiled (not interpreted)
    on a GPU of compute capability 9.0 or later, and `PDL` on."""
    if not (PDL and compiled(x)):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index][0] >= 9


def launch_args(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel with a `GDC` flag (see `PDL`), for tensors like x."""
    return {"GDC": True, "launch_pdl": True} if pdl(x) else {"GDC": False}


@contextlib.contextmanager
def reference_only():
    """Run the reference torch ops instead of the kernels (checks compare the two)."""
    global _reference_only
    prev, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = prev


if triton is not None:
    @triton.jit
    def gdc_enter(GDC: tl.constexpr):
        """A kernel's first step under `PDL`: wait for the previous kernel, let the next launch."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def row_amax(X, row, sx, K, BLOCK: tl.constexpr):
        """The largest magnitude of row `row` of X (K values, row stride sx) in fp32, read in BLOCK
        columns a step."""
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(X + row * sx + cols, mask=cols < K, other=0.0).to(tl.float32)))
        return tl.max(amax, 0)

    @triton.jit
    def row_scale(amax, E4M3: tl.constexpr):
        """A row's e4m3 scale from its largest magnitude, as `fp8.quantize_rows_reference` computes it:
        times the fp32 reciprocal of E4M3, floored at 1e-12. (torch on CUDA turns `amax / 448` into
        that product, on the CPU into a division; a product written out is the same bits on both,
        H200 2026-12-01: the kernels' IEEE division differed from CUDA torch's.)"""
        return tl.maximum(amax * (1.0 / E4M3), 1e-12)

    @triton.jit
    def divide_rn(x, scale, inv):
        """x / scale (fp32, scale > 0; inv = div_rn(1, scale), once per row) with the bits of IEEE
        division in three instructions (div.rn.f32 is a longer sequence with a slow-path branch):
        q = x inv, then Markstein's correction q + (x - q scale) inv, each step an FMA. Exact
        wherever |x| >= 2^-100 (tests/worker/model/test_divide_rn.py checks every finite bf16
        value and wide-range fp32 ones); below that the residual underflows and q itself is
        kept: x's sign and a quotient under 2^-60 (scale >= 1e-12), which e4m3 rounds to zero as
        it does the IEEE quotient."""
        q = x * inv
        return tl.where(tl.abs(x) >= 7.888609052210118e-31, tl.fma(tl.fma(-q, scale, x), inv, q), q)

    @triton.jit
    def store_row_scale(S, row, amax, E4M3: tl.constexpr):
        """A row's e4m3 scale from its largest magnitude (`fp8.quantize_rows`' arithmetic), stored at
        S + row -> (scale, div_rn(1, scale)) for `store_e4m3`."""
        scale = row_scale(amax, E4M3)
        tl.store(S + row, scale)
        return scale, tl.math.div_rn(1.0, scale)

    @triton.jit
    def store_e4m3(Q, cols, n, y, scale, inv):
        """Columns `cols` (< n) of a row's values y (of the activation dtype) as e4m3 at Q + cols,
        divided by the row's scale as IEEE division rounds (`fp8.quantize_rows`' arithmetic)."""
        tl.store(Q + cols, divide_rn(y.to(tl.float32), scale, inv).to(Q.dtype.element_ty), mask=cols < n)

    @triton.jit
    def norm_piece_in(X, R, RO, row, sx, sr, sro, cols, n, HAS_RES: tl.constexpr):
        """Columns `cols` of one row's x (+ residual, written to RO) in the activation dtype (0 past n)."""
        mask = cols < n
        x = tl.load(X + row * sx + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * sr + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(RO + row * sro + cols, x, mask=mask)
        return x

    @triton.jit
    def norm_piece_out(x, W, B, cols, n, mean, rstd, LAYER: tl.constexpr):
        """The normalised columns `cols` of x, in its dtype: torch's LayerNorm ((x - mean) rstd w + b
        in fp32, rounded once) or Qwen3RMSNorm (x rstd rounded, then times w)."""
        mask = cols < n
        xf = x.to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if LAYER:
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            return (tl.where(mask, xf - mean, 0.0) * rstd * w + b).to(x.dtype)
        return ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)

    @triton.jit(do_not_specialize=["quantize"])
    def _add_norm_kernel(X, R, W, B, Y, Q, RO, S, sx, sr, so, sro, n, eps, quantize,
                         HAS_RES: tl.constexpr, LAYER: tl.constexpr, BLOCK: tl.constexpr, B1: tl.constexpr,
                         E4M3: tl.constexpr, GDC: tl.constexpr):
        """One row, held as two power-of-two pieces of BLOCK and B1 columns (`norm_pieces`)."""
        gdc_enter(GDC)
        row = tl.program_id(0)
        c0 = tl.arange(0, BLOCK)
        x0 = norm_piece_in(X, R, RO, row, sx, sr, sro, c0, n, HAS_RES)
        total = tl.sum(x0.to(tl.float32), 0)
        if B1 > 0:
            c1 = BLOCK + tl.arange(0, B1)
            x1 = norm_piece_in(X, R, RO, row, sx, sr, sro, c1, n, HAS_RES)
            total += tl.sum(x1.to(tl.float32), 0)
        mean = total / n if LAYER else 0.0
        d0 = tl.where(c0 < n, x0.to(tl.float32) - mean, 0.0)
        sq = tl.sum(d0 * d0, 0)
        if B1 > 0:
            d1 = tl.where(c1 < n, x1.to(tl.float32) - mean, 0.0)
            sq += tl.sum(d1 * d1, 0)
        rstd = tl.rsqrt(sq / n + eps)
        y0 = norm_piece_out(x0, W, B, c0, n, mean, rstd, LAYER)
        if B1 > 0:
            y1 = norm_piece_out(x1, W, B, c1, n, mean, rstd, LAYER)
        if quantize != 0:                    # e4m3 into Q, row scales into S (a runtime flag: see add_rms_norm)
            amax = tl.max(tl.abs(y0.to(tl.float32)), 0)
            if B1 > 0:
                amax = tl.maximum(amax, tl.max(tl.abs(y1.to(tl.float32)), 0))
            scale, inv = store_row_scale(S, row, amax, E4M3)
            store_e4m3(Q + row * so, c0, n, y0, scale, inv)
            if B1 > 0:
                store_e4m3(Q + row * so, c1, n, y1, scale, inv)
        else:
            tl.store(Y + row * so + c0, y0, mask=c0 < n)
            if B1 > 0:
                tl.store(Y + row * so + c1, y1, mask=c1 < n)

    @triton.jit
    def _qk_norm_rope_write_kernel(QKV, QO, KC, VC, QW, KW, START, DELTA, INV_FREQ, COS, SIN,
                                   s_row, sqo_row, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l,
                                   scaling, eps, T, HQ: tl.constexpr, HKV: tl.constexpr,
                                   D: tl.constexpr, NH: tl.constexpr, TABLE: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)               # b * T + t: every head of one token in one program
        b = row // T
        t = row % T
        half: tl.constexpr = D // 2
        pos = tl.load(START + b) + t         # cache index of this token
        h = tl.arange(0, NH)                 # q heads, then k heads, then v heads (padded to NH)
        d = tl.arange(0, D)
        partner = (d + half) % D
        valid = (h < HQ + 2 * HKV)[:, None] & (d[None, :] < D)
        base = QKV + row * s_row + h[:, None] * D
        x = tl.load(base + d[None, :], mask=valid, other=0.0)
        dt = x.dtype
        xf = x.to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=valid, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
        is_q = (h < HQ)[:, None]
        w = tl.where(is_q, tl.load(QW + d)[None, :], tl.load(KW + d)[None, :]).to(tl.float32)
        wp = tl.where(is_q, tl.load(QW + partner)[None, :], tl.load(KW + partner)[None, :]).to(tl.float32)
        y = ((xf * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        yp = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
        rot = tl.where((d < half)[None, :], -yp, yp)
        if TABLE:                            # the caller's cos/sin rows (multimodal rotary of a prompt)
            cos = tl.load(COS + row * D + d).to(tl.float32)[None, :]
            sin = tl.load(SIN + row * D + d).to(tl.float32)[None, :]
        else:
            freq = (pos + tl.load(DELTA + b)).to(tl.float32) * tl.load(INV_FREQ + d % half).to(tl.float32)
            cos = (tl.cos(freq) * scaling).to(dt).to(tl.float32)[None, :]
            sin = (tl.sin(freq) * scaling).to(dt).to(tl.float32)[None, :]
        out = ((y * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt)
        tl.store(QO + row * sqo_row + h[:, None] * D + d[None, :], out, mask=is_q & valid)
        is_k = ((h >= HQ) & (h < HQ + HKV))[:, None] & valid
        hk = tl.where(h >= HQ, h - HQ, 0)
        tl.store(KC + b * sk_b + hk[:, None] * sk_h + pos * sk_l + d[None, :], out.to(KC.dtype.element_ty),
                 mask=is_k)
        is_v = (h >= HQ + HKV)[:, None] & valid
        hv = tl.where(h >= HQ + HKV, h - HQ - HKV, 0)
        tl.store(VC + b * sv_b + hv[:, None] * sv_h + pos * sv_l + d[None, :], x.to(VC.dtype.element_ty),
                 mask=is_v)

    @triton.jit
    def silu_mul_block(ROW, cols, n):
        """silu(gate) * up at columns `cols` of one gate/up row (0 past n), rounded to
        the activation dtype, in fp32."""
        mask = cols < n
        g = tl.load(ROW + cols, mask=mask, other=0.0)
        u = tl.load(ROW + n + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)

    @triton.jit
    def _silu_mul_kernel(GU, Y, s_row, sy_row, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        y = silu_mul_block(GU + row * s_row, cols, n)
        tl.store(Y + row * sy_row + cols, y.to(Y.dtype.element_ty), mask=cols < n)

    @triton.jit
    def gelu_tanh_block(ROW, cols, n, LIBDEVICE: tl.constexpr):
        """torch's gelu(x, approximate="tanh") = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in
        fp32 as its CUDA kernel writes it, at columns `cols` of one row (0 past n), rounded to the
        activation dtype, in fp32. tanh: libdevice's (CUDA's tanhf, torch's) where compiled;
        Triton's interpreter has no libdevice, so there 1 - 2 / (1 + e^2u) (the same function, its
        last bit may differ)."""
        x = tl.load(ROW + cols, mask=cols < n, other=0.0)
        xf = x.to(tl.float32)
        inner = 0.7978845608028654 * (xf + 0.044715 * (xf * xf * xf))
        if LIBDEVICE:
            t = tl.extra.cuda.libdevice.tanh(inner)
        else:
            t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
        return (0.5 * xf * (1.0 + t)).to(x.dtype).to(tl.float32)

    @triton.jit
    def activation_block(ROW, cols, n, GELU: tl.constexpr, LIBDEVICE: tl.constexpr):
        if GELU:
            return gelu_tanh_block(ROW, cols, n, LIBDEVICE)
        return silu_mul_block(ROW, cols, n)

    @triton.jit
    def _activation_rows_kernel(X, Q, S, s_row, sq_row, n, BLOCK: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                                E4M3: tl.constexpr, GELU: tl.constexpr, ONE_PASS: tl.constexpr,
                                LIBDEVICE: tl.constexpr, GDC: tl.constexpr):
        """One row's activation (GELU of x, or silu(gate) * up of cat(gate, up)) quantised.
        ONE_PASS: the row's values held in registers, as up to three power-of-two pieces of
        BLOCK, B1 and B2 columns (`row_pieces`: 25,600 = 16,384 + 8,192 + 1,024; no lanes spent
        far past n), its input read once. Otherwise a pass over BLOCK-column blocks for the row's
        largest magnitude, then a second that recomputes the values (the input read twice) and
        stores e4m3. The values are never written."""
        gdc_enter(GDC)
        row = tl.program_id(0)
        x_row = X + row * s_row
        q_row = Q + row * sq_row
        if ONE_PASS:
            c0 = tl.arange(0, BLOCK)
            y0 = activation_block(x_row, c0, n, GELU, LIBDEVICE).to(X.dtype.element_ty)   # exact: already rounded
            amax = tl.max(tl.abs(y0.to(tl.float32)), 0)
            if B1 > 0:
                c1 = BLOCK + tl.arange(0, B1)
                y1 = activation_block(x_row, c1, n, GELU, LIBDEVICE).to(X.dtype.element_ty)
                amax = tl.maximum(amax, tl.max(tl.abs(y1.to(tl.float32)), 0))
            if B2 > 0:
                c2 = BLOCK + B1 + tl.arange(0, B2)
                y2 = activation_block(x_row, c2, n, GELU, LIBDEVICE).to(X.dtype.element_ty)
                amax = tl.maximum(amax, tl.max(tl.abs(y2.to(tl.float32)), 0))
            scale, inv = store_row_scale(S, row, amax, E4M3)
            store_e4m3(q_row, c0, n, y0, scale, inv)
            if B1 > 0:
                store_e4m3(q_row, c1, n, y1, scale, inv)
            if B2 > 0:
                store_e4m3(q_row, c2, n, y2, scale, inv)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, n, BLOCK):
                cols = k0 + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(activation_block(x_row, cols, n, GELU, LIBDEVICE)))
            scale, inv = store_row_scale(S, row, tl.max(amax, 0), E4M3)
            for k0 in range(0, n, BLOCK):
                cols = k0 + tl.arange(0, BLOCK)
                store_e4m3(q_row, cols, n, activation_block(x_row, cols, n, GELU, LIBDEVICE), scale, inv)

    @triton.jit
    def _vision_rope_kernel(QKV, Q, K, COS, SIN, s_row, s_cs, H: tl.constexpr, D: tl.constexpr,
                            NH: tl.constexpr, BD: tl.constexpr, GDC: tl.constexpr):
        gdc_enter(GDC)
        row = tl.program_id(0)
        h = tl.arange(0, NH)[:, None]
        d = tl.arange(0, BD)[None, :]
        ok = (h < H) & (d < D)
        half: tl.constexpr = D // 2
        rot = tl.where(d < half, d + half, d - half)               # rotate_half's source column
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(COS + row * s_cs + d, mask=d < D, other=0.0).to(tl.float32)
        sin = tl.load(SIN + row * s_cs + d, mask=d < D, other=0.0).to(tl.float32)
        for part in tl.static_range(2):                             # q, then k
            src = QKV + row * s_row + part * H * D + h * D
            x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
            xr = tl.load(src + rot, mask=ok, other=0.0).to(tl.float32) * sign
            y = x * cos + xr * sin
            if part == 0:
                tl.store(Q + row * H * D + h * D + d, y.to(Q.dtype.element_ty), mask=ok)
            else:
                tl.store(K + row * H * D + h * D + d, y.to(K.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 quantize: bool = False):
    """-> (h, norm(h) * weight) with h = x + residual (or x). x, residual (..., N).
    quantize: -> (h, (e4m3 (M, N), fp32 scale (M, 1))) of norm(h) * weight's M = x.numel() / N rows,
    the bits `quantize_rows` gives of the plain output: both forms run one compiled kernel (the
    form is a runtime flag), since compiled apart the compiler summed the variance in another
    order in each (H200, 2026-12-01/02: 5-7 of 23.7 M e4m3 values one step off). Both outputs
    are written (M, N) contiguous, row stride N: one stride argument, so the stride of the output
    a form does not write (a (1, 1) stand-in, stride 1, which Triton would specialise as a
    constant) cannot give the two forms two compilations."""
    return _add_norm(x, weight, None, eps, residual, quantize)


def add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, quantize: bool = False):
    """`add_rms_norm` for torch's LayerNorm with its bias (the vision tower's norms): -> (h,
    layer_norm(h) * weight + bias), or quantize: (h, (e4m3 (M, N), fp32 scale (M, 1))). The values
    are torch's up to the order of the mean and variance sums (one rounding to the activation dtype
    each way)."""
    return _add_norm(x, weight, bias, eps, residual, quantize)


def _add_norm(x, weight, bias, eps, residual, quantize):
    x2 = _rows(x)
    m, n = x2.shape
    if quantize:
        q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        y = _unwritten_output(x2, x2.dtype)
    else:
        q, scale = _unwritten_output(x2, torch.float8_e4m3fn), _unwritten_output(x2, torch.float32)
        y = torch.empty(m, n, dtype=x2.dtype, device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else x2
    r2 = _rows(residual) if residual is not None else x2
    b0, b1 = norm_pieces(n)
    _add_norm_kernel[(m,)](
        x2, r2, weight, weight if bias is None else bias, y, q, res_out, scale, x2.stride(0), r2.stride(0), n,
        res_out.stride(0), n, eps, int(quantize), HAS_RES=residual is not None, LAYER=bias is not None,
        BLOCK=b0, B1=b1, E4M3=E4M3_MAX, num_warps=NORM_WARPS if n >= 4096 else 4, **launch_args(x2))
    return res_out.view(x.shape), ((q, scale) if quantize else y.view(x.shape))


# warps of a norm's program for rows of 4,096 columns or more (4 below). H200, 2026-12-02, the 32B
# prefill's residual add + RMSNorm over 4,623 x 5,120 in two pieces: 57 us quantised (4 warps 53;
# the one 8,192 block before 65); the decode step (one row) was measured with 8 only.
NORM_WARPS = 8


def pow2_pieces(n: int, count: int) -> tuple[int, ...]:
    """A row of n columns as `count` power-of-two pieces held in registers: n's highest powers of
    two in turn, the last piece what is left rounded up (0 where nothing is left)."""
    pieces, rest = [], n
    for _ in range(count - 1):
        piece = 1 << (rest.bit_length() - 1) if rest else 0
        pieces.append(piece)
        rest -= piece
    return (*pieces, 1 << (rest - 1).bit_length() if rest else 0)


def norm_pieces(n: int) -> tuple[int, int]:
    """A norm's row in two pieces (5,120 -> 4,096 + 1,024; 1,152 -> 1,024 + 128; 300 -> 256 + 64)."""
    return pow2_pieces(n, 2)


_unwritten_outputs: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _unwritten_output(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (1, 1) tensor standing in for a kernel's output that the launch does not write (its
    pointer is passed, never dereferenced)."""
    key = (str(x.device), dtype)
    if key not in _unwritten_outputs:
        _unwritten_outputs[key] = torch.empty(1, 1, dtype=dtype, device=x.device)
    return _unwritten_outputs[key]


def qk_norm_rope_write(qkv: torch.Tensor, q_heads: int, kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       start: torch.Tensor, rope_delta: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                       scaling: float = 1.0, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """qkv (B, T, (Hq + 2 Hkv) D) -> q (B, T, Hq, D) normed and rotated; k (normed, rotated) and v
    written into k_cache/v_cache (>= B, Hkv, L, D) at positions start[b] + t, rotary position
    start[b] + t + rope_delta[b] (inv_freq, scaling), or, with cos_sin, the rotary of those rows
    (each (B, T, D) contiguous in the activation dtype, scaling included: transformers' rotary
    embedding's output, multimodal positions of a prompt)."""
    b, t, width = qkv.shape
    d = width // (q_heads + 2 * kv_heads)
    q = torch.empty(b, t, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    rows = qkv.reshape(b * t, width)
    heads = q_heads + 2 * kv_heads
    if cos_sin is not None:
        cos, sin = (c.expand(b, t, d).contiguous() for c in cos_sin)
        rope_delta = inv_freq = start
    else:
        cos = sin = rows
    _qk_norm_rope_write_kernel[(b * t,)](
        rows, q, k_cache, v_cache, q_norm_weight, k_norm_weight, start, rope_delta, inv_freq, cos, sin,
        rows.stride(0), q_heads * d, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scaling, eps, t,
        HQ=q_heads, HKV=kv_heads, D=d, NH=triton.next_power_of_2(heads), TABLE=cos_sin is not None,
        num_warps=4 if heads > 32 else 2, **launch_args(rows))
    return q


def silu_mul(gate_up: torch.Tensor, quantize: bool = False):
    """gate_up (..., 2 I) = cat(gate, up) -> silu(gate) * up (..., I).
    quantize: -> (e4m3 (M, I), fp32 scale (M, 1)) of its M = gate_up.numel() / 2 I rows."""
    x2 = _rows(gate_up)
    n = x2.shape[1] // 2
    if quantize:
        return _activation_rows(x2, n, gelu=False)
    y = torch.empty(x2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, SILU_BLOCK))](x2, y, x2.stride(0), y.stride(0), n, BLOCK=SILU_BLOCK,
                                                                num_warps=4, **launch_args(x2))
    return y.view(*gate_up.shape[:-1], n)


def gelu_tanh_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., n) -> (e4m3 (M, n), fp32 scale (M, 1)) of gelu(x, approximate="tanh") over its M
    rows (the vision tower's MLP activation, handed to its fp8 product): `quantize_rows` of the
    values torch's CUDA kernel computes, without writing them."""
    x2 = _rows(x)
    return _activation_rows(x2, x2.shape[1], gelu=True)


def _activation_rows(x2: torch.Tensor, n: int, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x2.shape[0], n, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x2.device)
    pieces = row_pieces(n)
    one_pass = sum(pieces) <= ROW_MAX
    b0, b1, b2 = pieces if one_pass else (4096, 0, 0)
    _activation_rows_kernel[(x2.shape[0],)](x2, q, scale, x2.stride(0), q.stride(0), n, BLOCK=b0, B1=b1, B2=b2,
                                            E4M3=E4M3_MAX, GELU=gelu, ONE_PASS=one_pass, LIBDEVICE=compiled(x2),
                                            num_warps=row_warps(sum(pieces), one_pass), **launch_args(x2))
    return q, scale


SILU_BLOCK = 1024                      # output columns per program of silu_mul
# A quantised activation holds a row of up to this many columns in registers (its input read once);
# wider rows take two passes over 4,096-column blocks.
ROW_MAX = 32768


def row_pieces(n: int) -> tuple[int, int, int]:
    """A quantised activation's row in three pieces (25,600 -> 16,384 + 8,192 + 1,024; 4,304 ->
    4,096 + 128 + 128)."""
    return pow2_pieces(n, 3)


def row_warps(columns: int, one_pass: bool) -> int:
    """Warps of a quantised activation's program: one per 2,048 columns held, rounded up to a power
    of two (4 to 32), 8 for two passes. On the H200 (2026-12-02, the pieces of `row_pieces`): the
    32B MLP's rows of 25,600 with 16 warps 189 us at 4,623 rows (32 warps 247; one 32,768-column
    block 229; two passes 267; silu then `quantize_rows` 316), the vision GELU's 4,304 with 4
    warps 150 us at 17,280 rows (8 warps 153; GELU then `quantize_rows` 174)."""
    return min(32, max(4, triton.next_power_of_2(columns) // 2048)) if one_pass else 8


def vision_rope(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's rotary in one pass: qkv (n, 3 H D), the output of a vision block's qkv
    product; cos, sin (n, D) -> q, k (n, H, D) in qkv's dtype, each x * cos + rotate_half(x) * sin
    in fp32 (transformers' `apply_rotary_pos_emb_vision`, which makes ~10 fp32 passes of each)."""
    n = qkv.shape[0]
    d = qkv.shape[1] // (3 * heads)
    rows = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    _vision_rope_kernel[(n,)](rows, q, k, cos, sin, rows.stride(0), cos.stride(0), H=heads, D=d,
                              NH=triton.next_power_of_2(heads), BD=triton.next_power_of_2(d),
                              num_warps=4, **launch_args(rows))
    return q, k
