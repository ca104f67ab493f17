"""Every Triton kernel of the GPU path compiles for the H200 (sm_90) on this GPU-less machine, with
the argument types and compile-time constants its launcher passes at the 32B shape. Triton's
interpreter (the other kernel tests) runs the kernels' arithmetic in numpy and accepts code the
compiler refuses; this catches that before a device call is spent on it. (The device's Triton
may be older than this machine's: it catches most, not all.)"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import torch  # noqa: E402

from worker.dflash import policy  # noqa: E402
from worker.model import attention, fp8, fused_ops, stream_gemm  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "scaling", "qk_scale", "prior", "decay", "prior_weight"}


def compiled(fn, pointers: dict[str, str], constants: dict, warps: int = 4, stages: int = 3, **options):
    """Compile fn for H200: pointers {arg: '*bf16' | '*fp8e4nv' | ...}, constants {constexpr arg:
    value}; any other argument an i32 (fp32 where named in FLOATS); options: other compile options
    -> the compiled kernel."""
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name in FLOATS else "i32")
    assert set(pointers) <= set(sig) and set(constants) == {n for n, t in sig.items() if t == "constexpr"}, fn
    src = ASTSource(fn=fn, signature=sig, constexprs=constants)
    return triton.compile(src, target=H200, options={"num_warps": warps, "num_stages": stages, **options})


def _cases():
    bf, f8, f32, i64 = "*bf16", "*fp8e4nv", "*fp32", "*i64"
    norm = dict(HAS_RES=True, LAYER=False, BLOCK=4096, B1=1024, E4M3=448.0, GDC=True)
    for name, changes in [("add_rms_norm, plain or quantised", {}), ("add_rms_norm, first layer", dict(HAS_RES=False)),
                          ("add_rms_norm, one piece", dict(B1=0)),
                          ("add_layer_norm (vision, 1,152 wide)", dict(LAYER=True, BLOCK=1024, B1=128)),
                          ("add_layer_norm, no residual", dict(HAS_RES=False, LAYER=True, BLOCK=1024, B1=128))]:
        yield (name, fused_ops._add_norm_kernel,
               dict(X=bf, R=bf, W=bf, B=bf, Y=bf, Q=f8, RO=bf, S=f32), {**norm, **changes}, 8)
    for table in (False, True):
        yield (f"qk_norm_rope_write, table={table}", fused_ops._qk_norm_rope_write_kernel,
               dict(QKV=bf, QO=bf, KC=bf, VC=bf, QW=bf, KW=bf, START=i64, DELTA=i64, INV_FREQ=f32, COS=bf, SIN=bf),
               dict(HQ=64, HKV=8, D=128, NH=128, TABLE=table, GDC=True), 4)
    yield ("silu_mul", fused_ops._silu_mul_kernel, dict(GU=bf, Y=bf), dict(BLOCK=fused_ops.SILU_BLOCK, GDC=True), 4)
    for gelu, one_pass, n in ((False, True, 25600), (False, False, 40000), (True, True, 4304), (True, False, 40000)):
        pieces = fused_ops.row_pieces(n) if one_pass else (4096, 0, 0)
        yield (f"{'gelu_tanh' if gelu else 'silu_mul'} quantised, one pass={one_pass}", fused_ops._activation_rows_kernel,
               dict(X=bf, Q=f8, S=f32), dict(BLOCK=pieces[0], B1=pieces[1], B2=pieces[2], E4M3=448.0, GELU=gelu,
                                             ONE_PASS=one_pass, LIBDEVICE=True, GDC=True),
               fused_ops.row_warps(sum(pieces), one_pass))
    yield ("sum_splits", stream_gemm._sum_splits_kernel, dict(PART=f32, SCALE=f32, BIAS=bf, Y=bf),
           dict(SPLIT=4, HAS_SCALE=True, HAS_BIAS=False, BLOCK=stream_gemm.REDUCE_BLOCK, GDC=True), 4)
    yield ("vision_rope", fused_ops._vision_rope_kernel, dict(QKV=bf, Q=bf, K=bf, COS=f32, SIN=f32),
           dict(H=16, D=72, NH=16, BD=128, GDC=True), 4)
    yield ("quantize_rows", fp8._quantize_rows_kernel, dict(X=bf, Q=f8, S=f32), dict(BLOCK=4096, E4M3=448.0), 8)
    for rows, c in (*stream_gemm.LAUNCH_CONFIGS, *stream_gemm.F16_LAUNCH_CONFIGS):
        for w, split, y in ((f8, 1, bf), (f8, 4, bf), (bf, 1, bf)):
            f16 = stream_gemm.takes_f16(c, torch.float8_e4m3fn if w == f8 else torch.bfloat16, torch.bfloat16)
            f16_rows = f16 and c.f16_rows
            yield (f"stream product, {rows} rows, {w[1:]} weight, {split} splits, {y[1:]} Y, fp16 dot {f16}",
                   stream_gemm._stream_kernel,
                   dict(X="*fp16" if f16_rows else bf, W=w, SCALE=f32, BIAS=bf, Y=y, PART=f32, DOWN=f32),
                   dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=split, EVEN_K=True,
                        HAS_SCALE=w == f8, HAS_BIAS=False, DOT_FP32=False, SWAP_AB=c.swap_ab and c.block_m > 1,
                        F16=f16, F16_ROWS=f16_rows, GDC=True), (c.warps, c.stages))
    yield ("stream product, fp16 dot swapped", stream_gemm._stream_kernel,
           dict(X=bf, W=f8, SCALE=f32, BIAS=bf, Y=bf, PART=f32, DOWN=f32),
           dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=4, EVEN_K=True, HAS_SCALE=True, HAS_BIAS=False, DOT_FP32=False,
                SWAP_AB=True, F16=True, F16_ROWS=False, GDC=True), (4, 4))
    yield ("f16 rows", stream_gemm._f16_rows_kernel, dict(X=bf, X16="*fp16", DOWN=f32),
           dict(BLOCK=stream_gemm.F16_ROWS_BLOCK, GDC=True), 4)
    for t, block_m, block_n, direct in [(1, 16, 64, False), (8, 64, 64, False), (64, 64, attention.TILED_BLOCK_N, True),
                                        (64, 64, 64, False), (64, 128, 64, False), (8, 64, 64, True),
                                        (1, 16, 64, True)]:   # the expert at batch 1: split tiles, at 2-4
        # one split 128-row tile; decode and verify from batch 16: one split, 4 stages
        yield (f"attention split, T={t}, BLOCK_M={block_m}", attention._split_kernel,
               dict(Q=bf, K=bf, V=bf, KVLEN=i64, OPART=f32, LPART=f32, OUT=bf),
               dict(T=t, G=8, HKV=8, D=128, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=t == 8, DIRECT=direct, GDC=True),
               (8 if block_m == 128 else 4, attention.pipeline_stages(block_m, block_n, direct, 2)))
    for observe, decay, accepted in ((False, False, f32), (False, True, i64), (True, True, i64)):   # a batch's first
        yield (f"policy step, observe={observe}, decay={decay}", policy._policy_step_kernel,    # head, decode, verify
               dict(DONE="*u8", FINISHING="*u8", BEFORE="*u8", ACCEPTED=accepted, SUCC=f32, FAIL=f32, HEAD=f32,
                    GENERATING="*u8"), dict(OBSERVE=observe, DECAY=decay, N_A=3, N_B=7, BLOCK=16), 4)
    yield ("attention merge", attention._merge_kernel, dict(OPART=f32, LPART=f32, KVLEN=i64, OUT=bf),
           dict(HQ=64, D=128, BLOCK_N=64, S_MAX=16, GDC=True), 4)


CASES = [c if len(c) == 6 else (*c, {}) for c in _cases()]     # (..., compile options)


@pytest.mark.parametrize("name, fn, pointers, constants, launch, options", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_the_h200(name, fn, pointers, constants, launch, options):
    warps, stages = launch if isinstance(launch, tuple) else (launch, 3)
    kernel = compiled(fn, pointers, constants, warps, stages, **options)
    assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"], name


def test_the_quantising_norm_is_the_plain_norms_compiled_kernel(monkeypatch):
    """The norm handing e4m3 to an fp8 product must give `quantize_rows`' bits of the plain norm's
    output. Compiled as two kernels (a constexpr form) the compiler summed the variance in a
    different order in each (on the H200 5-7 of 23.7 M e4m3 values one step off, with and
    without FMA contraction); so both forms launch one kernel with the same compile-time
    arguments, pointer types and integer values (Triton specialises an int equal to 1, as the
    stride of a (1, 1) stand-in output, into a constant), the form a runtime flag that Triton does
    not specialise."""
    import torch

    launches = []

    class Recording:
        arg_names = fused_ops._add_norm_kernel.arg_names
        do_not_specialize = fused_ops._add_norm_kernel.do_not_specialize

        def __getitem__(self, grid):          # ints by value: Triton specialises 1 and multiples of 16
            flag = Recording.arg_names.index("quantize")
            return lambda *args, **kw: launches.append((tuple(
                a.dtype if isinstance(a, torch.Tensor) else a if isinstance(a, int) and i != flag else type(a)
                for i, a in enumerate(args)), kw))

    monkeypatch.setattr(fused_ops, "_add_norm_kernel", Recording())
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    fused_ops.add_rms_norm(x, w, 1e-6, x, quantize=False)
    fused_ops.add_rms_norm(x, w, 1e-6, x, quantize=True)
    assert len(launches) == 2 and launches[0] == launches[1]
    assert {"quantize", Recording.arg_names.index("quantize")} & set(Recording.do_not_specialize)


def test_a_quantised_activations_row_is_three_pieces_that_cover_it_with_a_power_of_two_of_warps():
    for n, pieces in [(25600, (16384, 8192, 1024)), (4304, (4096, 128, 128)), (1152, (1024, 128, 0)), (4096, (4096, 0, 0)),
                      (300, (256, 32, 16)), (7, (4, 2, 1))]:
        assert fused_ops.row_pieces(n) == pieces and n <= sum(pieces) < n + max(pieces[2], 1)
    for n in range(1, 40000, 7):              # Triton launches only a power of two of warps
        warps = fused_ops.row_warps(sum(fused_ops.row_pieces(n)), True)
        assert warps in (4, 8, 16, 32), (n, warps)


def test_a_norms_row_is_two_pieces_that_cover_it():
    for n, pieces in [(5120, (4096, 1024)), (1152, (1024, 128)), (1536, (1024, 512)), (4096, (4096, 0)), (300, (256, 64)),
                      (1, (1, 0))]:
        assert fused_ops.norm_pieces(n) == pieces and n <= sum(pieces) < 2 * n


def test_every_launched_kernel_is_compiled_here():
    """A kernel added to the GPU path gets a case here."""
    launched = {getattr(m, n) for m in (attention, fp8, fused_ops, stream_gemm, policy) for n in dir(m)
                if n.startswith("_") and n.endswith("_kernel")}
    assert launched == {c[1] for c in CASES}
