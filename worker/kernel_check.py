"""GPU path check: `python -m worker.kernel_check [--shape 32b|mid|tiny]`.

Compares the Triton kernels of the serving path (`worker/model/`: attention, fused_ops, layers,
stream_gemm) with the reference torch ops on fresh random inputs of every shape the model uses
(decode, verify(8), draft block, expert), and prints one row per check with the relative error
||out - ref|| / ||ref|| against an fp64 reference on the same (rounded) inputs, and the max abs
difference. Exits 1 when any check fails its bound. Outputs are poisoned (NaN) before each
kernel run, so an unwritten element fails.

On the CPU it runs the same kernels through Triton's interpreter (`TRITON_INTERPRET=1`, set by
this module before Triton is imported) on small shapes; that is what `make test` runs.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():        # before Triton is imported: no GPU -> Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.model import fp8  # noqa: E402
from worker.model.attention import attend_reference, cache_attention  # noqa: E402
from worker.model.decoder import apply_rope, rms_norm, rope_cos_sin  # noqa: E402
from worker.model.fp8 import quantize_rows, quantize_rows_reference, quantize_weight  # noqa: E402
from worker.model.fused_ops import (add_layer_norm, add_rms_norm, gelu_tanh_rows, qk_norm_rope_write,  # noqa: E402
                                    reference_only, silu_mul, vision_rope)
from worker.model.stream_gemm import stream_linear  # noqa: E402

# (rows, T, Hq, Hkv, D, capacity) per use; capacity includes free columns after the live keys.
# Launches of >= 124 programs (rows x Hkv) write their output directly, smaller ones split the keys.
SHAPES = {
    "32b": {"decode": [(1, 1, 64, 8, 128, 8192), (4, 1, 64, 8, 128, 8192), (32, 1, 64, 8, 128, 4608)],
            "verify": [(1, 8, 64, 8, 128, 8192), (4, 8, 64, 8, 128, 8192), (32, 8, 64, 8, 128, 4608)],
            "draft": [(1, 8, 64, 8, 128, 8192), (32, 8, 64, 8, 128, 4608)],
            "expert": [(1, 64, 16, 8, 128, 8192), (8, 64, 16, 8, 128, 4608)],
            "hidden": 5120, "intermediate": 25600,
            # weight products (name, N, K): the text layer's fused q/k/v, o, fused gate/up, down,
            # then the expert's (1536 wide, 16/8 heads, intermediate 6144)
            "linear": [("qkv", (64 + 16) * 128, 5120), ("o", 5120, 64 * 128), ("gate/up", 2 * 25600, 5120),
                       ("down", 5120, 25600), ("expert qkv", (16 + 16) * 128, 1536), ("expert o", 1536, 16 * 128),
                       ("expert gate/up", 2 * 6144, 1536), ("expert down", 1536, 6144)]},
    "tiny": {"decode": [(1, 1, 4, 2, 16, 96), (3, 1, 4, 2, 16, 80), (64, 1, 4, 2, 16, 48)],
             "verify": [(2, 8, 4, 2, 16, 96), (64, 8, 4, 2, 16, 48)],
             "draft": [(2, 8, 4, 2, 16, 64)],
             "expert": [(2, 24, 4, 2, 16, 80), (2, 64, 4, 2, 16, 96), (1, 64, 4, 2, 16, 4200)],   # last: split tiles
             "hidden": 64, "intermediate": 160,
             "linear": [("qkv", (4 + 4) * 16, 64), ("o", 64, 64), ("gate/up", 2 * 160, 64), ("down", 64, 160),
                        ("odd", 37, 300)]},
}
SHAPES["mid"] = SHAPES["tiny"]
FP8_PREFILL_BOUND = 6e-2                  # the fp8 prefill's rows, both dtypes (see main)
FP8_ROWS = (1, 8, 32, 128)                # rows of the fp8 weight-only checks (decode, verify, batches)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out64, ref64 = out.double(), ref.double()
    if torch.isnan(out64).any():
        return float("nan"), float("nan")
    return (float((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30)), float((out64 - ref64).abs().max()))


def check_attention(use: str, shape, dtype, dev, gen) -> tuple[float, float]:
    b, t, hq, hkv, d, cap = shape
    q = torch.randn(b, t, hq, d, device=dev, generator=gen).to(dtype)
    k = torch.randn(b, hkv, cap, d, device=dev, generator=gen).to(dtype)
    v = torch.randn(b, hkv, cap, d, device=dev, generator=gen).to(dtype)
    free = min(64, cap // 4)                 # columns kept free after the longest row
    live = torch.randint(t + 1, cap - free + 1, (b,), device=dev, generator=gen)
    live[0] = cap - free                     # one row at the longest the cache holds
    causal = use in ("decode", "verify")
    out = torch.full_like(q, float("nan"))
    cache_attention(q, k, v, live, causal, out=out)
    if not torch.equal(out, cache_attention(q, k, v, live, causal)):    # a second launch: the same bits
        return float("nan"), float("nan")
    ref = attend_reference(q.double(), k.double(), v.double(), live, causal)
    return rel_err(out, ref)


def check_fused_ops(shape: dict, dtype, dev, gen) -> list[tuple[str, float, float]]:
    rows = []
    n, inter = shape["hidden"], shape["intermediate"]
    x = torch.randn(5, 3, n, device=dev, generator=gen).to(dtype)
    r = torch.randn(5, 3, n, device=dev, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(dtype)
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = w, 1e-6
    h, y = add_rms_norm(x, w, 1e-6, residual=r)
    rows.append(("add_rms_norm (residual)", *rel_err(y, rms_norm(x + r, norm))))
    rows.append(("add_rms_norm (sum)", *rel_err(h, x + r)))
    gu = torch.randn(7, 2 * inter, device=dev, generator=gen).to(dtype)
    g, u = gu.chunk(2, dim=-1)
    rows.append(("silu_mul", *rel_err(silu_mul(gu), torch.nn.functional.silu(g) * u)))
    # q/k norm + rope + cache write
    b, t, hq, hkv, d, cap = SHAPES_ACTIVE["verify"][0]
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device=dev, generator=gen).to(dtype)
    qn, kn = [(1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(dtype) for _ in range(2)]
    kc = torch.full((b + 1, hkv, cap, d), float("nan"), device=dev, dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    start = torch.randint(0, cap - t, (b,), device=dev, generator=gen)
    delta = torch.randint(-3, 50, (b,), device=dev, generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    q = qk_norm_rope_write(qkv, hq, hkv, qn, kn, 1e-6, kc, vc, start, delta, inv_freq, 1.0)
    pos = start[:, None] + torch.arange(t, device=dev)
    cos, sin = rope_cos_sin(pos + delta[:, None], inv_freq, dtype)
    rq, rk, rv = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    qm, km = torch.nn.Module(), torch.nn.Module()
    qm.weight, qm.variance_epsilon, km.weight, km.variance_epsilon = qn, 1e-6, kn, 1e-6
    ref_q = apply_rope(rms_norm(rq.view(b, t, hq, d), qm).transpose(1, 2), cos, sin).transpose(1, 2)
    ref_k = apply_rope(rms_norm(rk.view(b, t, hkv, d), km).transpose(1, 2), cos, sin)     # (B, Hkv, T, D)
    idx = pos[:, None, :, None].expand(b, hkv, t, d)
    rows.append(("qk_norm_rope_write q", *rel_err(q, ref_q)))
    rows.append(("qk_norm_rope_write k in cache", *rel_err(kc[:b].gather(2, idx), ref_k)))
    rows.append(("qk_norm_rope_write v in cache",
                 *rel_err(vc[:b].gather(2, idx), rv.view(b, t, hkv, d).transpose(1, 2))))
    # the vision tower's rotary (the 32B tower's 16 heads of 72) against transformers' own
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    n, vh, vd = 37, 16, 72
    qkv = torch.randn(n, 3 * vh * vd, device=dev, generator=gen).to(dtype)
    angles = torch.rand(n, vd // 2, device=dev, generator=gen) * 40
    vcos, vsin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    vq, vk = vision_rope(qkv, vh, vcos, vsin)
    rq, rk, _ = qkv.view(n, 3, vh, vd).unbind(1)
    ref_q, ref_k = apply_rotary_pos_emb_vision(rq, rk, vcos, vsin)
    rows += [("vision_rope q", *rel_err(vq, ref_q)), ("vision_rope k", *rel_err(vk, ref_k))]
    # the DFlash2 loop's per-step bookkeeping (worker/dflash/policy.py) against its torch form
    from worker.dflash.policy import RowAcceptance

    r = 37
    done, finishing, before = (torch.rand(r, device=dev, generator=gen) < p for p in (0.3, 0.1, 0.8))
    last = (before, torch.randint(0, 8, (r,), device=dev, generator=gen), 7)
    counts = torch.rand(2, r, device=dev, generator=gen) * 5
    fused, plain = RowAcceptance(0.7, *counts.clone()), RowAcceptance(0.7, *counts.clone())
    head, _ = fused.step(done, finishing & ~done, (3, 7), last)
    with reference_only():
        ref_head, _ = plain.step(done, finishing & ~done, (3, 7), last)
    rows.append(("DFlash2 policy step: head", *rel_err(head, ref_head)))
    rows.append(("DFlash2 policy step: decayed counts", *rel_err(fused.successes, plain.successes)))
    return rows


def _replayed(fn, like: torch.Tensor) -> torch.Tensor:
    """fn(out) run again into a NaN-poisoned `out`: on a GPU captured in a CUDA graph and replayed."""
    out = torch.full_like(like, float("nan"))
    if not out.is_cuda:
        fn(out)
        return out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(out)
    out.fill_(float("nan"))
    graph.replay()
    return out


def check_stream_linear(shape: dict, dtype, dev, gen) -> list[tuple[str, str, float, float]]:
    """The weight-only fp8 product at each weight shape and FP8_ROWS rows against fp64 of the
    dequantised product, and the same kernel on a plain weight at 1 and 8 rows; a second launch
    (on the GPU: captured in a CUDA graph and replayed) must give the same bits."""
    rows = []
    for name, n, k in shape["linear"]:
        w8, scale = quantize_weight(torch.randn(n, k, device=dev, generator=gen))
        w64 = w8.double() * scale.double()[:, None]
        for m in FP8_ROWS:
            x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
            out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            stream_linear(x, w8, scale, out=out)
            same = torch.equal(out, _replayed(lambda o: stream_linear(x, w8, scale, out=o), out))
            err = rel_err(out, x.double() @ w64.t()) if same else (float("nan"), float("nan"))
            rows.append((f"fp8 weight-only {name}", f"M {m}, {k} -> {n}", *err))
        del w64
        # the same kernel on a plain weight of the activation dtype, stored (N, K) (`layers.project`)
        w = torch.randn(n, k, device=dev, generator=gen).to(dtype)
        for m in (1, 8):
            x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
            out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            stream_linear(x, w, None, out=out)
            same = torch.equal(out, _replayed(lambda o: stream_linear(x, w, None, out=o), out))
            err = rel_err(out, x.double() @ w.double().t()) if same else (float("nan"), float("nan"))
            rows.append((f"{str(dtype)[6:]} weight {name}", f"M {m}, {k} -> {n}", *err))
    if dev.type == "cuda":        # (Triton's interpreter rounds some fp32 -> e4m3 casts down a binade)
        def same_bits(name: str, where: str, got, want, exact: bool = True) -> tuple:
            """A check row: quantised rows' (e4m3, scale) error against others' (NaN unless the same
            bits where `exact`; the count of values that differ)."""
            (q, sc), (rq, rs) = got, want
            off = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()), int((sc != rs).sum())
            return name, where + (" ({} values, {} scales differ)".format(*off) if any(off) else ""), *(
                (float("nan"),) * 2 if any(off) and exact else rel_err(q.float() * sc, rq.float() * rs))

        for m, k in ((4623, shape["hidden"]), (301, shape["intermediate"])):
            x = (torch.randn(m, k, device=dev, generator=gen) * 3).to(dtype)
            rows.append(same_bits("fp8 activation quantisation (same bits as torch)", f"M {m}, K {k}",
                                  quantize_rows(x), quantize_rows_reference(x)))
            w = torch.randn(k, device=dev, generator=gen).to(dtype)
            ops = ((lambda q: add_rms_norm(x, w, 1e-6, x, quantize=q)[1]) if k == shape["hidden"] else  # handed over
                   (lambda q: silu_mul(torch.cat([x, x.flip(0)], 1), quantize=q)))
            rows.append(same_bits(f"fp8 handed over by {'the norm' if k == shape['hidden'] else 'silu'} (same bits)",
                                  f"M {m}, K {k}", ops(True), quantize_rows(ops(False))))
        x = (torch.randn(17280, 4304, device=dev, generator=gen) * 3).to(dtype)   # the vision tower's, against torch
        wv, bv = (torch.randn(1152, device=dev, generator=gen).to(dtype) for _ in range(2))
        rows.append(same_bits("fp8 handed over by the vision norm", "M 17280, K 1152", add_layer_norm(
            x[:, :1152], wv, bv, 1e-6, quantize=True)[1], quantize_rows(torch.nn.functional.layer_norm(x[:, :1152], (1152,), wv, bv, 1e-6)),
            exact=False))       # (the mean and variance summed in another order: a value may round the other way)
        rows.append(same_bits("fp8 handed over by the vision GELU", "M 17280, K 4304", gelu_tanh_rows(x),
                              quantize_rows(torch.nn.functional.gelu(x, approximate="tanh")), exact=False))
    return rows


SHAPES_ACTIVE: dict = {}


def check_decoder_steps(rt, tag: str, rows: int, cap: int, dtype, dev, gen):
    """Fused decoder steps (T = 1, 8) against the reference ops; -> (check rows, a cache of each)."""
    out = []
    for t in (1, 8):
        cache = rt.decoder.new_cache(rows, cap, dtype, dev)
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)
        ref_cache = rt.decoder.new_cache(rows, cap, dtype, dev)
        ref_cache.k.copy_(cache.k)
        ref_cache.v.copy_(cache.v)
        start = torch.randint(1, cap - 72, (rows,), device=dev, generator=gen)
        delta = torch.randint(0, 9, (rows,), device=dev, generator=gen)
        ids = torch.randint(0, 300, (rows, t), device=dev, generator=gen)
        fused = rt.decoder.forward(ids, start, delta, cache, cap, capture=(0,))
        with reference_only():
            ref = rt.decoder.forward(ids, start, delta, ref_cache, int(start.max()) + t, capture=(0,))
        out.append((f"{tag}decoder step T={t}: logits", *rel_err(fused.logits, ref.logits)))
        out.append((f"{tag}decoder step T={t}: captured hidden", *rel_err(fused.hidden[0], ref.hidden[0])))
        out.append((f"{tag}decoder step T={t}: cache K", *rel_err(cache.k, ref_cache.k)))
    return out, (cache, ref_cache, delta)


def check_expert(rt, tag: str, cache, ref_cache, delta, dev, gen, rows: int | None = None) -> tuple[str, float, float]:
    """The expert's velocity for the first `rows` rows (default all), fused over `cache` against the
    reference ops over `ref_cache` (the same K/V), 64 action columns after each row's offset."""
    rows, cap = rows or delta.shape[0], cache.capacity
    delta = delta[:rows]
    x = torch.randn(rows, rt.expert.num_waypoints, 2, device=dev, generator=gen)
    tt = torch.rand(rows, 1, 1, device=dev, generator=gen)
    offset = torch.randint(1, cap - rt.expert.num_waypoints, (rows,), device=dev, generator=gen)
    v_fused = rt.expert.velocity(x, tt, cache, offset, delta, cap)
    with reference_only():
        v_ref = rt.expert.velocity(x, tt, ref_cache, offset, delta, int(offset.max()))
    return (f"{tag}expert velocity", *rel_err(v_fused, v_ref))


def check_model(shape: str, dtype, dev, gen) -> list[tuple[str, float, float]]:
    """Whole stacks of a random model: decoder step (T = 1, 8), draft block, expert velocity, and
    the decoder step again with fp8 weights (the weight-only kernel against the dequantised ops)."""
    from worker.bench import build_model, make_runtime, random_draft, to_fp8

    model, cfg, tok = build_model(shape, dev, dtype)
    rt = make_runtime(model, cfg, tok, dev, dtype)
    rows, cap = 3, 160
    out = check_decoder_steps(rt, "1 row: ", 1, cap, dtype, dev, gen)[0]      # one-row products (gemv form)
    step_rows, (cache, ref_cache, delta) = check_decoder_steps(rt, "", rows, cap, dtype, dev, gen)
    out += step_rows
    out.append(check_expert(rt, "", cache, ref_cache, delta, dev, gen))
    # draft block over its context cache
    draft = random_draft(rt)
    hc = draft.config
    for p in draft.parameters():
        p.normal_(generator=gen).mul_(0.05)
    ck = torch.randn(rows, hc.num_key_value_heads, cap, hc.head_dim, device=dev, generator=gen).to(dtype)
    cv = torch.randn_like(ck)
    emb = torch.randn(rows, hc.block_size, hc.hidden_size, device=dev, generator=gen).to(dtype)
    lengths = torch.randint(1, cap - hc.block_size, (rows,), device=dev, generator=gen)
    s = int(lengths.max())
    visible = torch.arange(s, device=dev)[None, :] < lengths[:, None]
    positions = lengths[:, None] + torch.arange(hc.block_size, device=dev) + delta[:, None]
    with torch.inference_mode():
        h_ref = draft.block_hidden(emb, positions, [(ck[:, :, :s].clone(), cv[:, :, :s].clone())], visible)
        h_fused = draft.block_hidden_fused(emb, lengths, delta, [(ck, cv)])
    out.append(("draft block hidden", *rel_err(h_fused, h_ref)))
    # the verify step's context write: target hidden states of a block -> the draft layers' K/V
    hidden = {i: torch.randn(rows, hc.block_size, hc.hidden_size, device=dev, generator=gen).to(dtype)
              for i in hc.target_layer_ids}
    kf, vf = ck.clone(), cv.clone()
    with torch.inference_mode():
        draft.write_context_fused(hidden, lengths, delta, [(kf, vf)])
        (k_ref, v_ref), = draft.context_kv(draft.project(hidden), positions)
    cols = lengths[:, None] + torch.arange(hc.block_size, device=dev)
    at = cols[:, None, :, None].expand(-1, hc.num_key_value_heads, -1, hc.head_dim)
    out.append(("draft context write: K", *rel_err(kf.gather(2, at), k_ref)))
    out.append(("draft context write: V", *rel_err(vf.gather(2, at), v_ref)))
    out += check_prefill(rt, "", dtype)
    # this model's widths are below fp8.FP8_MM_MIN_FEATURES: lowered, its products check the fp8 x fp8 forms
    floor, fp8.FP8_MM_MIN_FEATURES = fp8.FP8_MM_MIN_FEATURES, 16
    try:
        to_fp8(rt, model)
    finally:
        fp8.FP8_MM_MIN_FEATURES = floor
    fp8_rows, (cache, ref_cache, delta) = check_decoder_steps(rt, "fp8 ", rows, cap, dtype, dev, gen)
    out += fp8_rows
    # one row: the batch-1 expert's 64-row products (fp8 x fp8 q/k/v and gate/up, weight-only o and down)
    out.append(check_expert(rt, "fp8 ", cache, ref_cache, delta, dev, gen, rows=1))
    # the interpreter's fp8 prefill over 2 of the cameras (~18 of the suite's seconds): the 24-image
    # prompt's tower and stack are the plain prefill's rows above, the fp8 kernels the same here
    out += check_prefill(rt, "fp8 ", dtype, cameras=2 if shape == "tiny" else None)
    return out


def check_prefill(rt, tag: str, dtype, cameras: int | None = None) -> list[tuple[str, float, float]]:
    """A 24-image prompt's prefill (the first `cameras` cameras' frames only, where given) through
    the fused layers (`FusedStack.prefilling`) against transformers' own layers: last-position
    logits, a captured hidden state, first and last layers' K/V."""
    from worker.bench_throughput import CAMERAS, scenes

    p = rt._prepare(scenes(1, 1, (64, 64), "kernel-check", cameras=CAMERAS[:cameras])[0])
    p.pixel_values = p.pixel_values.to(dtype)
    last = len(rt.decoder.stack.layers) - 1
    logits, kv, hidden = rt._prefill([p], (0,))
    with reference_only():
        r_logits, r_kv, r_hidden = rt._prefill([p], (0,))
    out = [(f"{tag}prefill ({len(p.input_ids)} tokens): logits", *rel_err(logits, r_logits)),
           (f"{tag}prefill: captured hidden", *rel_err(hidden[0], r_hidden[0])),
           (f"{tag}prefill: layer 0 K", *rel_err(kv[0][0], r_kv[0][0])),
           (f"{tag}prefill: layer {last} V", *rel_err(kv[last][1], r_kv[last][1]))]
    if not tag:         # two prompts in one pass (`AlpamayoRuntime._prefill` of a group): the second's rows
        q = rt._prepare(scenes(2, 1, (64, 64), "kernel-check")[1])
        q.pixel_values = q.pixel_values.to(dtype)
        g_logits, g_kv, g_hidden = rt._prefill([p, q], (0,))
        a_logits, a_kv, a_hidden = rt._prefill([q], (0,))
        out += [("prefill, 2 prompts a pass against 1: logits", *rel_err(g_logits[1], a_logits[0])),
                ("prefill, 2 prompts a pass against 1: captured hidden", *rel_err(g_hidden[0][1], a_hidden[0][0])),
                (f"prefill, 2 prompts a pass against 1: layer {last} V", *rel_err(g_kv[last][1][1], a_kv[last][1][0]))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.kernel_check", description=__doc__.split("\n")[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32b" if gpu else "tiny")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the expert attention's launch configurations, the weight products' forms "
                         "and the fp8 weight-only product against _scaled_mm and bf16")
    ap.add_argument("--fp8-only", action="store_true",
                    help="only the fp8 weight-only product's checks (and, with --sweep, its timings)")
    ap.add_argument("--rows", default=None, metavar="M,M",
                    help="with --sweep: time the fp8 weight-only product at these row counts only (of 1,8,32,64,"
                         "128,256), e.g. 8,32")
    ap.add_argument("--prefill", action="store_true",
                    help="with --sweep: also time the prefill's product forms and attention backends (PREFILL_ROWS rows)")
    ap.add_argument("--small", action="store_true",
                    help="with --sweep: only the many-row products of small weights, dequantised against fp8 x fp8")
    ap.add_argument("--libraries", action="store_true",
                    help="with --sweep: only the fp8 products of the kept libraries installed (gemlite, FBGEMM "
                         "gen-ai, torchao) against this project's")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if gpu else "cpu")
    SHAPES_ACTIVE.update(SHAPES[args.shape])
    gen = torch.Generator(device=dev).manual_seed(1234)
    dtypes = [torch.bfloat16, torch.float32] if gpu else [torch.float32]
    # bounds on ||out - ref|| / ||ref||: fp32 (tf32 dots on GPU) and bf16 operands (METHOD.md)
    bound = {torch.float32: 3e-3 if gpu else 1e-5, torch.bfloat16: 2e-2}
    failed = 0
    print("| check | shape (rows, T, Hq, Hkv, D, capacity) | dtype | rel err | max abs diff | status |")
    print("|---|---|---|---|---|---|")
    for dtype in dtypes:
        for use in () if args.fp8_only else ("decode", "verify", "draft", "expert"):
            for shape in SHAPES[args.shape][use]:
                err, mx = check_attention(use, shape, dtype, dev, gen)
                ok = err <= bound[dtype]
                failed += not ok
                print(f"| attention {use} | {shape} | {str(dtype)[6:]} | {err:.2e} | {mx:.2e} | {'ok' if ok else 'FAIL'} |")
        for name, err, mx in [] if args.fp8_only else check_fused_ops(SHAPES[args.shape], dtype, dev, gen):
            ok = err <= bound[dtype]
            failed += not ok
            print(f"| {name} | hidden {SHAPES[args.shape]['hidden']} | {str(dtype)[6:]} | {err:.2e} | {mx:.2e} "
                  f"| {'ok' if ok else 'FAIL'} |")
        for name, where, err, mx in check_stream_linear(SHAPES[args.shape], dtype, dev, gen):
            ok = err <= bound[dtype]
            failed += not ok
            print(f"| {name} | {where} | {str(dtype)[6:]} | {err:.2e} | {mx:.2e} | {'ok' if ok else 'FAIL'} |",
                  flush=True)
    model_shape = "tiny" if args.shape == "tiny" else "mid"
    for dtype in [] if args.fp8_only else dtypes:
        for name, err, mx in check_model(model_shape, dtype, dev, gen):
            # an fp8 prefill quantises every product's input to e4m3 (3 mantissa bits: a step of 6.7-12.5%):
            # a last-bit difference upstream moves some values a whole step and the difference grows
            # layer by layer (tests/worker/model/test_fp8_vision_tower.py; H200, 2026-12-02: bf16
            # 1.4-1.8e-2, fp32 2.1-2.8e-2, the vision tower's), so its rows get FP8_PREFILL_BOUND
            # (half of e4m3's largest relative step) in either dtype: a wrong scale or layout is O(1)
            # (the fp8 expert too: its q/k/v and gate/up go fp8 x fp8 above expert.WEIGHT_ONLY_ROWS rows)
            ok = err <= (FP8_PREFILL_BOUND if name.startswith(("fp8 prefill", "fp8 expert")) else bound[dtype])
            failed += not ok
            print(f"| {name} | model {model_shape} | {str(dtype)[6:]} | {err:.2e} | {mx:.2e} | {'ok' if ok else 'FAIL'} |")
    if args.sweep and gpu:
        from worker import kernel_sweep

        kernel_sweep.run(dev, gen, args.fp8_only, args.rows, args.prefill, args.small, args.libraries)
    print(f"{'FAILED' if failed else 'passed'}: {failed} check(s) out of bounds")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
