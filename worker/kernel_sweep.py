"""GPU timings of the serving path's kernels and their alternatives: `python -m worker.kernel_check
--sweep [--fp8-only] [--rows M,M] [--prefill | --small | --libraries]` (after the checks of
`worker.kernel_check`; GPU only, prints tables, chooses nothing). What the tables decided is in
docs/benchmarks.md and next to each choice (`stream_gemm.LAUNCH_CONFIGS`, `layers.GEMV_MAX_ROWS`,
`fp8.WEIGHT_ONLY_MAX_ROWS`, `fp8.FAST_ACCUM`, `fused_ops.row_warps`)."""

from __future__ import annotations

import contextlib

import torch

from worker.kernel_check import SHAPES, rel_err
from worker.model.attention import cache_attention
from worker.model.fp8 import WEIGHT_ONLY_MAX_ROWS, quantize_rows, quantize_weight, scaled_mm_linear
from worker.model.fused_ops import add_rms_norm, silu_mul
from worker.model.layers import GEMV_MAX_ROWS
from worker.model.stream_gemm import LaunchConfig, launch_config, stream_linear


def run(dev, gen, fp8_only: bool, rows: str | None, prefill: bool, small: bool = False,
        libraries: bool = False) -> None:
    """The sweeps `python -m worker.kernel_check --sweep` asks for."""
    if libraries:
        sweep_libraries(dev, gen)
        return
    if small:
        sweep_small_products(dev, gen)
        return
    if not fp8_only:
        sweep_decode_attention(dev, gen, copy_bandwidth(dev))
        sweep_expert_attention(dev, gen)
        sweep_weight_gemms(dev, gen)
    sweep_fp8_linear(dev, gen, {int(m) for m in rows.split(",")} if rows else None)
    if prefill:
        sweep_fp8_prefill(dev, gen)
        sweep_prefill_attention(dev, gen)


def sweep_expert_attention(dev, gen) -> None:
    """Times the expert's attention (T = 64, 16/8 heads, 4,751 live keys of 8,192) at 1, 2, 3, 4 and 8 rows
    under the split plan and fixed split counts, 64 and 128 keys a step, in CUDA graphs, K/V read
    from memory (copies cycled past the L2 cache, as the expert's 64 layers read theirs) (GPU only;
    prints a table, chooses nothing; `attention.tiled_splits` decided from it)."""
    t, hq, hkv, d, cap, live_len = 64, 16, 8, 128, 8192, 4751
    print("\n| expert attention | rows | keys a step | plan us | unsplit | 4 splits | 8 | 16 |\n" + "|---" * 8 + "|")
    for rows in (1, 2, 3, 4, 8):
        q = torch.randn(rows, t, hq, d, device=dev, generator=gen).to(torch.bfloat16)
        k = torch.randn(rows, hkv, cap, d, device=dev, generator=gen).to(torch.bfloat16)
        v = torch.randn_like(k)
        live = torch.full((rows,), live_len, device=dev)
        for block_n in (64, 128):
            cells = []
            for splits in (None, 1, 4, 8, 16):
                fn = lambda k_, v_, sp=splits, bn=block_n: cache_attention(q, k_, v_, live, False, block_n=bn,  # noqa: E731
                                                                          splits=sp)
                cells.append(f"{_bench_streamed_us(fn, k, v):.1f}")
            print(f"| | {rows} | {block_n} | " + " | ".join(cells) + " |", flush=True)


def sweep_decode_attention(dev, gen, bw: float) -> None:
    """Times the decoder's attention over a 24-image prompt's cache (4,623 live keys of a 8,192
    capacity, 64/8 heads of 128, bf16) at decode (T = 1) and verify (T = 8), 1 and 16 rows, under
    the split plan, fixed split counts and (one split) 3 or 4 K/V tiles in flight, in CUDA graphs,
    K/V read from memory (copies cycled past the L2 cache, as a step's 64 layers read theirs),
    against its K/V bytes at copy bandwidth `bw` (GPU only; prints a table, chooses nothing;
    `attention.split_plan` and `attention.pipeline_stages` decided from it)."""
    hq, hkv, d = SHAPES["32b"]["decode"][0][2:5]
    cap, live_len = 8192, PREFILL_ROWS          # the worker's default row capacity; a 24-image prompt
    print(f"\n| decode attention (live {live_len} of {cap}, {hq}/{hkv} heads of {d}) | rows | T | K/V floor us "
          "| plan us | 8 splits | 16 | 32 | 64 | one split, 3 / 4 stages |\n" + "|---" * 10 + "|")
    for rows, t in ((1, 1), (1, 8), (4, 8), (16, 1), (16, 8)):
        q = torch.randn(rows, t, hq, d, device=dev, generator=gen).to(torch.bfloat16)
        k = torch.randn(rows, hkv, cap, d, device=dev, generator=gen).to(torch.bfloat16)
        v = torch.randn_like(k)
        live = torch.full((rows,), live_len, device=dev)
        cells = []
        for splits, stages in ((None, None), (8, None), (16, None), (32, None), (64, None), (1, 3), (1, 4)):
            fn = lambda k_, v_, sp=splits, st=stages: cache_attention(q, k_, v_, live, t > 1, splits=sp,  # noqa: E731
                                                                      num_stages=st)
            try:
                fn(k, v)
                cells.append(f"{_bench_streamed_us(fn, k, v):.1f}")
            except Exception as e:              # a split count this shape cannot take
                cells.append(type(e).__name__)
        cells[-2:] = [f"{cells[-2]} / {cells[-1]}"]
        floor = 2 * rows * hkv * live_len * d * 2 / bw * 1e6
        print(f"| | {rows} | {t} | {floor:.1f} | " + " | ".join(cells) + " |", flush=True)


def copy_bandwidth(dev) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    import triton.testing

    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = triton.testing.do_bench(lambda: big.clone(), warmup=5, rep=50, return_mode="median")
    return 2 * big.numel() / (copy_ms * 1e-3)


def sweep_weight_gemms(dev, gen) -> None:
    """Times the 32B layer's weight products at M = 1, 8, 32, 128, 256 rows in four forms: F.linear
    on the (N, K) weight, the same through cuBLASLt, x @ W^T stored (K, N) contiguous, and (up to
    `layers.GEMV_MAX_ROWS` rows) the Triton weight-streaming product on the (N, K) weight, with the
    microseconds each matrix's bytes take at the copy bandwidth measured here (GPU only; prints a
    table, chooses nothing)."""
    import triton.testing

    n_hidden, n_inter, n_qkv = 5120, 25600, (64 + 16) * 128
    shapes = {"gate/up": (2 * n_inter, n_hidden), "down": (n_hidden, n_inter), "qkv": (n_qkv, n_hidden),
              "o": (n_hidden, 64 * 128)}
    bw = copy_bandwidth(dev)
    print(f"| weight product (copy bandwidth {bw / 1e12:.2f} TB/s) | M | bytes floor us | F.linear us "
          f"| cuBLASLt us | x @ W^T (K, N) us | stream_linear (N, K) us |\n|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=gen).to(torch.bfloat16)
        wt = w.t().contiguous()
        for m in (1, 8, 32, 128, 256):
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            times = []
            for form in ("linear", "lt", "kn"):
                fn = (lambda: torch.matmul(x, wt)) if form == "kn" else (lambda: torch.nn.functional.linear(x, w))
                prev = torch.backends.cuda.preferred_blas_library()
                if form == "lt":
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    times.append(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3)
                finally:
                    torch.backends.cuda.preferred_blas_library(prev)
            stream = (triton.testing.do_bench(lambda w=w, x=x: stream_linear(x, w, None), warmup=10, rep=100,
                                              return_mode="median") * 1e3) if m <= GEMV_MAX_ROWS else None
            print(f"| {name} ({n}x{k}) | {m} | {w.numel() * 2 / bw * 1e6:.1f} | "
                  + " | ".join(f"{t:.1f}" for t in times) + f" | {'-' if stream is None else f'{stream:.1f}'} |",
                  flush=True)
        del w, wt

# alternatives to LAUNCH_CONFIGS' entry per row count: (block_m, block_n, block_k, warps, stages[, swap_ab])
FP8_SWEEP_CONFIGS = {
    1: [LaunchConfig(1, bn, bk, w, 2) for bn, bk in ((8, 512), (8, 1024), (16, 256), (16, 512), (16, 1024), (32, 128),
                                                     (32, 256), (32, 512), (64, 128)) for w in (4, 8)],
    8: [LaunchConfig(16, bn, bk, w, st, f16=True) for bn, bk, w, st in ((64, 128, 4, 4), (128, 128, 2, 3),
                                                                         (128, 256, 4, 3), (256, 128, 8, 3))],
    32: [LaunchConfig(32, bn, bk, w, st) for bn, bk, w, st in ((32, 128, 4, 4), (64, 64, 4, 4), (64, 256, 4, 3),
                                                                (128, 128, 4, 3), (128, 128, 8, 3))]
        + [LaunchConfig(32, bn, 128, 4, st, f16=True, f16_rows=True) for bn, st in ((128, 3), (64, 4))],
    64: [LaunchConfig(64, bn, bk, w, st, sw) for bn, bk, w, st, sw in ((64, 128, 4, 3, False), (64, 128, 4, 3, True),
                                                                       (128, 64, 4, 4, True), (64, 256, 4, 3, True))],
}
PREFILL_ROWS = 4623                    # one 24-image scene's prompt (docs/benchmarks.md)


STREAMED_BYTES = 256 << 20             # weight copies cycled per timing: more than the L2 cache holds


def _cycled_us(calls: list) -> float:
    """Microseconds of one call replayed in a CUDA graph, taking `calls` (each over its own copy of
    the operands) in turn."""
    import itertools

    import triton.testing

    turn = itertools.count()
    return triton.testing.do_bench_cudagraph(lambda: calls[next(turn) % len(calls)](), return_mode="median") * 1e3


def _bench_streamed_us(fn, weight: torch.Tensor, *rest: torch.Tensor) -> float:
    """Microseconds of fn(weight, *rest) replayed in a CUDA graph, cycling through copies of the
    weight (and `rest`, its companions) that together exceed the L2 cache, so each call reads
    its weight from memory as a decode step does."""
    copies = [(weight, *rest)] + [(weight.clone(), *(r.clone() for r in rest))
                                  for _ in range(-(-STREAMED_BYTES // (weight.numel() * weight.element_size())) - 1)]
    return _cycled_us([lambda c=c: fn(*c) for c in copies])


def sweep_fp8_prefill(dev, gen, rows: int = PREFILL_ROWS) -> None:
    """Times the forms of an fp8 x fp8 product for a prompt's `rows` tokens at the 32B weight
    shapes: bf16 F.linear; the activation quantisation alone (`quantize_rows`); `_scaled_mm` with
    row-wise scales (what `scaled_mm_linear` runs after it) and with fast accumulation; with
    one scale per tensor, with and without fast accumulation. TFLOP/s in brackets (GPU only). The
    last column: the row-wise product's relative error against the fp32 product of the same
    quantised operands, without / with fast accumulation (what `fp8.FAST_ACCUM` adds). Then the op
    that makes the product's input (norm, silu * up) with quantize_rows after it, against it
    handing its output over quantised (`layers.norm_project`, `layers.silu_project`)."""
    print(f"\n| prefill product ({rows} rows) | bf16 F.linear us | quantize_rows us | _scaled_mm row-wise us "
          "| row-wise, fast accum | per-tensor | per-tensor, fast accum | rel err exact / fast "
          "| op before + quantize_rows / handing over us |\n" + "|---" * 9 + "|")
    for name, n, k in SHAPES["32b"]["linear"]:
        w8, scale = quantize_weight(torch.randn(n, k, device=dev, generator=gen))
        x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
        xq, x_scale = quantize_rows(x)
        one = torch.ones((), device=dev)
        flop = 2 * rows * n * k

        def form(fn, *args, flop=flop) -> str:
            try:
                us = _bench_streamed_us(fn, *args)
            except Exception as e:              # a form this torch / device does not offer
                return type(e).__name__
            return f"{us:.0f} ({flop / us / 1e6:.0f})" if flop else f"{us:.0f}"

        def mm(w, a_scale, b_scale, fast):
            return torch._scaled_mm(xq, w.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)

        w16 = w8.to(torch.bfloat16)
        cells = [form(lambda w: torch.nn.functional.linear(x, w), w16),
                 form(lambda w: quantize_rows(x), w8),
                 form(lambda w: mm(w, x_scale, scale[None, :], False), w8),
                 form(lambda w: mm(w, x_scale, scale[None, :], True), w8),
                 form(lambda w: mm(w, one, one, False), w8),
                 form(lambda w: mm(w, one, one, True), w8)]
        exact = (xq.float() * x_scale) @ (w8.float() * scale[:, None]).t()
        cells.append(" / ".join(f"{rel_err(mm(w8, x_scale, scale[None, :], fast), exact)[0]:.2e}"
                                for fast in (False, True)))
        wn = torch.randn(k, device=dev, generator=gen).to(torch.bfloat16)
        norm = lambda a, q: add_rms_norm(a, wn, 1e-6, a, quantize=q)[1]  # noqa: E731
        before = {"qkv": norm, "gate/up": norm, "down": lambda a, q: silu_mul(a, quantize=q)}.get(name)
        src = x if name != "down" else torch.randn(rows, 2 * k, device=dev, generator=gen).to(torch.bfloat16)
        cells.append(f"{form(lambda a: quantize_rows(before(a, False)), src, flop=0)} / "
                     f"{form(lambda a: before(a, True), src, flop=0)}" if before else "-")
        print(f"| {name} ({n}x{k}) | " + " | ".join(cells) + " |", flush=True)


SMALL_ROWS = (630, 4623, 17280)       # a demo prompt, a 24-image 32B prompt, its vision tower's patches


def sweep_small_products(dev, gen) -> None:
    """Where fp8 x fp8 stops paying for many rows (`fp8.FP8_MM_MIN_FEATURES`): weights of d x d,
    4d x d and d x 4d for d from 128 (the demo checkpoint's widths) to 2,048 (the 32B vision tower's
    1,152 among them) at SMALL_ROWS rows, bf16 activations in: the dequantised weight's F.linear
    (what smaller weights take) against `quantize_rows` + `_scaled_mm` (`scaled_mm_linear`) and
    `_scaled_mm` alone (its input handed over quantised); graph replays (kernel time) and eager
    calls (launches included), us."""
    import triton.testing

    from worker.model.stream_gemm import stream_linear_reference

    print("\n| weight (N x K) | rows | dequantised F.linear | quantize + _scaled_mm | _scaled_mm alone "
          "| eager: dequantised / quantize + _scaled_mm |\n" + "|---" * 6 + "|")
    for d in (128, 256, 512, 768, 1024, 1152, 2048):
        for n, k in ((d, d), (4 * d, d), (d, 4 * d)):
            w8, scale = quantize_weight(torch.randn(n, k, device=dev, generator=gen))
            for rows in SMALL_ROWS:
                x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
                xq, x_scale = quantize_rows(x)
                forms = (lambda: stream_linear_reference(x, w8, scale),
                         lambda: scaled_mm_linear(x, w8, scale),
                         lambda: torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=scale[None, :],
                                                  out_dtype=torch.bfloat16, use_fast_accum=True))
                graphed = [triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3 for f in forms]
                eager = [triton.testing.do_bench(f, return_mode="median") * 1e3 for f in forms[:2]]
                print(f"| {n} x {k} | {rows} | " + " | ".join(f"{us:.1f}" for us in graphed)
                      + f" | {eager[0]:.1f} / {eager[1]:.1f} |", flush=True)


def sweep_prefill_attention(dev, gen, rows: int = PREFILL_ROWS) -> None:
    """Times one layer's causal attention over a prompt of `rows` tokens (the 32B heads, bf16) as
    `FusedStack.prefill_layer` calls it (torch SDPA, grouped-query heads), under each SDPA backend
    alone, and with K/V expanded to every query head first (for backends without grouped-query
    support); TFLOP/s of the causal half in brackets (GPU only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = SHAPES["32b"]["decode"][0][2:5]
    q = torch.randn(1, hq, rows, d, device=dev, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, hkv, rows, d, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
    flop = 2 * 2 * hq * rows * rows * d / 2
    print(f"\n| prefill attention ({rows} tokens, {hq}/{hkv} heads of {d}) | grouped-query us | K/V expanded first us |"
          "\n|---|---|---|")

    def timed(fn) -> str:
        try:
            fn()
            us = _bench_streamed_us(lambda _: fn(), q)
        except Exception as e:                  # a backend this torch / device / shape does not offer
            return type(e).__name__
        return f"{us:.0f} ({flop / us / 1e6:.0f})"

    rep = hq // hkv
    for name in ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        ctx = (lambda: contextlib.nullcontext()) if name == "default" else (lambda: sdpa_kernel(getattr(SDPBackend, name)))

        def gqa():
            with ctx():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def expanded():
            with ctx():
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        print(f"| {name} | {timed(gqa)} | {timed(expanded)} |", flush=True)


def sweep_fp8_linear(dev, gen, only_rows: set[int] | None = None) -> None:
    """Times the weight-only fp8 product (the launch-config table's choice) against fp8 x fp8
    `_scaled_mm` and bf16 F.linear at the 32B weight shapes and several row counts, then the
    alternatives in FP8_SWEEP_CONFIGS (with the split rule and without splitting) on the text
    layer's shapes. Each form is captured in a CUDA graph (as the serving path runs it) and reads
    its weight from memory, not from L2 (GPU only; prints tables; Fp8Linear uses weight-only up to
    WEIGHT_ONLY_MAX_ROWS)."""
    bw = copy_bandwidth(dev)
    print(f"\n| fp8 product (copy bandwidth {bw / 1e12:.2f} TB/s) | M | fp8 bytes floor us | weight-only us "
          "| _scaled_mm us | bf16 F.linear us | bf16 / weight-only | Fp8Linear uses |\n" + "|---" * 8 + "|")
    weights = {}
    for name, n, k in SHAPES["32b"]["linear"]:
        w8, scale = quantize_weight(torch.randn(n, k, device=dev, generator=gen))
        w16 = torch.randn(n, k, device=dev, generator=gen).to(torch.bfloat16)
        weights[name] = (w8, scale)
        for m in [m for m in (1, 8, 32, 64, 128, 256) if only_rows is None or m in only_rows]:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ours = _bench_streamed_us(lambda w, s: stream_linear(x, w, s), w8, scale)
            scaled = _bench_streamed_us(lambda w, s: scaled_mm_linear(x, w, s), w8, scale)
            bf16 = _bench_streamed_us(lambda w: torch.nn.functional.linear(x, w), w16)
            uses = "weight-only" if m <= WEIGHT_ONLY_MAX_ROWS else "_scaled_mm"
            print(f"| {name} ({n}x{k}) | {m} | {n * k / bw * 1e6:.1f} | {ours:.1f} | {scaled:.1f} | {bf16:.1f} "
                  f"| {bf16 / ours:.2f} | {uses} |", flush=True)
        del w16
        torch.cuda.empty_cache()
    print("\n| fp8 weight-only config (block_m, block_n, block_k, warps, stages) | M | shape | us, split rule "
          "| us, no split | table's choice |\n|---|---|---|---|---|---|")
    for m, configs in [(m, c) for m, c in FP8_SWEEP_CONFIGS.items() if only_rows is None or m in only_rows]:
        for name in ("qkv", "o", "gate/up", "down"):
            w8, scale = weights[name]
            x = torch.randn(m, w8.shape[1], device=dev, generator=gen).to(torch.bfloat16)
            for c in [launch_config(m, 1, True)] + [c for c in configs if c != launch_config(m, 1, True)]:
                try:
                    times = [_bench_streamed_us(lambda w, s: stream_linear(x, w, s, config=c, splits=sp), w8, scale)
                             for sp in (None, 1)]
                except Exception as e:          # a config over the shared-memory or register limit
                    print(f"| {c} | {m} | {name} | {type(e).__name__} | - | |")
                    continue
                print(f"| {c.block_m}, {c.block_n}, {c.block_k}, {c.warps}, {c.stages}{', swapped' * c.swap_ab} | {m} | {name} "
                      f"| {times[0]:.1f} | {times[1]:.1f} | {'yes' if c == launch_config(m, 1, True) else ''} |", flush=True)


LIBRARY_ROWS = (1, 8, 16, 32)          # weight-only: decode, verify(8) at batch 1 and 2, decode at 32


def sweep_libraries(dev, gen) -> None:
    """Kept libraries' fp8 products against this project's at the 32B text layer's four shapes, each
    where it is installed (the candidates to `stream_linear` and `_scaled_mm`; none is a dependency):
    weight-only (bf16 rows, e4m3 weight) at LIBRARY_ROWS rows: `stream_linear`, gemlite's A16W8_FP8
    (its own autotuning, split-K summed by atomic adds), FBGEMM gen-ai's `bf16fp8bf16_fast_gemv`
    (one scale per tensor), torchao's Float8WeightOnlyConfig (eager); fp8 x fp8 at a prompt's
    PREFILL_ROWS rows: `scaled_mm_linear` (quantize_rows + `_scaled_mm`), `quantize_rows` + FBGEMM's
    `f8f8bf16_rowwise`, gemlite's A8W8_FP8_dynamic (its own quantisation). Each cell: us a call
    in CUDA graphs, the weight read from memory (copies cycled past L2); then the relative error
    against the dequantised product and `=` where a second call gave the same bits (`~` where not)."""
    import importlib

    from worker.model.stream_gemm import stream_linear_reference

    libs = {}
    for name, module in (("gemlite", "gemlite.helper"), ("fbgemm", "fbgemm_gpu.experimental.gen_ai"),
                         ("torchao", "torchao.quantization")):
        try:
            libs[name] = importlib.import_module(module)
        except Exception as e:                  # not installed, or built for another torch
            print(f"{name}: not measured ({type(e).__name__}: {str(e)[:120]})")

    def cell(make, n_bytes, ref) -> str:
        """make() -> a call over its own weight copy; enough copies to exceed STREAMED_BYTES."""
        try:
            calls = [make() for _ in range(-(-STREAMED_BYTES // n_bytes))]
            first = calls[0]()
            same = torch.equal(first, calls[0]())
            err = rel_err(first.float().reshape(ref.shape), ref)[0]
            for c in calls[1:]:
                c()                                 # autotuning and compilation outside the capture
            us = _cycled_us(calls)
        except Exception as e:                      # a form this library, torch or row count lacks
            return f"{type(e).__name__}: {str(e)[:60]}".replace("|", "/")
        return f"{us:.1f} ({err:.1e} {'=' if same else '~'})"

    def gemlite_a16w8(w8, scale):
        return libs["gemlite"].A16W8_FP8(device=str(dev), dtype=torch.bfloat16).from_weights(
            w8.clone(), scales=scale[:, None].clone())

    def torchao_linear(w8, scale):
        ao = libs["torchao"]
        lin = torch.nn.Linear(w8.shape[1], w8.shape[0], bias=False, device=dev, dtype=torch.bfloat16)
        lin.weight.data = (w8.float() * scale[:, None]).to(torch.bfloat16)
        ao.quantize_(lin, ao.Float8WeightOnlyConfig())
        return lin

    print("\n| weight-only product | M | stream_linear | gemlite A16W8_FP8 | FBGEMM bf16fp8bf16_fast_gemv "
          "| torchao Float8WeightOnly |\n" + "|---" * 6 + "|")
    weights = {}
    for name, n, k in SHAPES["32b"]["linear"][:4]:
        w8, scale = quantize_weight(torch.randn(n, k, device=dev, generator=gen))
        weights[name] = (w8, scale)
        for m in LIBRARY_ROWS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = stream_linear_reference(x, w8, scale).float()
            # FBGEMM's gemv takes one scale per tensor: its error is against the unscaled weight
            unscaled = stream_linear_reference(x, w8, torch.ones_like(scale)).float()
            one = torch.ones(1, device=dev)
            forms = [  # (make, reference) per column; make None where the library is missing
                (lambda: (lambda w=w8.clone(), s=scale.clone(): stream_linear(x, w, s)), ref),
                ((lambda: (lambda g=gemlite_a16w8(w8, scale): g(x))) if "gemlite" in libs else None, ref),
                ((lambda: (lambda w=w8.clone(): torch.ops.fbgemm.bf16fp8bf16_fast_gemv(x, w, one)))
                 if "fbgemm" in libs else None, unscaled),
                ((lambda: (lambda lin=torchao_linear(w8, scale): lin(x))) if "torchao" in libs else None, ref)]
            print(f"| {name} ({n}x{k}) | {m} | " + " | ".join("-" if make is None else cell(make, n * k, r)
                                                             for make, r in forms) + " |", flush=True)
    print(f"\n| fp8 x fp8 product ({PREFILL_ROWS} rows) | scaled_mm_linear | quantize_rows + FBGEMM "
          "f8f8bf16_rowwise | gemlite A8W8_FP8_dynamic |\n" + "|---" * 4 + "|")
    for name, (w8, scale) in weights.items():
        n, k = w8.shape
        x = torch.randn(PREFILL_ROWS, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = stream_linear_reference(x, w8, scale).float()

        def fbgemm_rowwise(w, s):
            xq, x_scale = quantize_rows(x)
            return torch.ops.fbgemm.f8f8bf16_rowwise(xq, w, x_scale.view(-1), s, use_fast_accum=True)

        forms = [lambda: (lambda w=w8.clone(), s=scale.clone(): scaled_mm_linear(x, w, s)),
                 (lambda: (lambda w=w8.clone(), s=scale.clone(): fbgemm_rowwise(w, s))) if "fbgemm" in libs else None,
                 (lambda: (lambda g=libs["gemlite"].A8W8_FP8_dynamic(device=str(dev), dtype=torch.bfloat16)
                           .from_weights((w8.float() * scale[:, None]).to(torch.bfloat16)): g(x)))
                 if "gemlite" in libs else None]
        print(f"| {name} ({n}x{k}) | " + " | ".join("-" if make is None else cell(make, n * k, ref) for make in forms)
              + " |", flush=True)
