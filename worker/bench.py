"""Side-by-side benchmark: `python -m worker.bench [--shape 32b|tiny] [--out FILE]`.

One run measures, on the same weights and in the same process:
  floors      device copy bandwidth, bf16 matmul rate, weight bytes streamed per decode step
  HF          transformers `generate` (eager dynamic cache, and static cache)
  engine      baseline decode step, verify(8) step, draft pass (CUDA graphs, persistent cache),
              baseline and DFlash2 reasoning loops (oracle proposals at tau = 2, 4, 6: the draft
              network runs, its proposals come from a recorded baseline generation with errors
              injected), at several batch sizes; fp8 decode step
  end to end  one scene, K = 1 and K = 3, split into image prep, prefill, reasoning, diffusion
Random weights make acceptance meaningless, hence the oracle; the demo checkpoint's real
acceptance is measured separately (`--demo CHECKPOINT --head HEAD`). Imports no Kafka library.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from worker.shapes import SHAPES, shape_config, write_config_only

def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(fn, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of fn() (device-synchronised)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    t0 = time.perf_counter()

    def add(self, section: str, what: str, value: str):
        self.rows.append((section, what, value))
        print(f"[{time.perf_counter() - self.t0:6.0f}s] {section:10s} | {what:58s} | {value}", flush=True)

    def markdown(self) -> str:
        out = ["| section | measurement | value |", "|---|---|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in self.rows]
        return "\n".join(out)


def floors(t: Table, dev: torch.device) -> tuple[float, float]:
    if dev.type != "cuda":
        t.add("floors", "device", "cpu (no floors measured)")
        return float("nan"), float("nan")
    n = 1 << 30
    x = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    s = timeit(lambda: y.copy_(x), reps=20)
    bw = 2 * x.numel() * 2 / s
    t.add("floors", "copy bandwidth (read + write)", f"{bw / 1e12:.2f} TB/s")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    s = timeit(lambda: a @ b, reps=10)
    t.add("floors", "bf16 matmul 8192^3", f"{2 * 8192 ** 3 / s / 1e12:.0f} TFLOP/s")
    return bw, 2 * 8192 ** 3 / s


def build_model(shape: str, dev: torch.device, dtype: torch.dtype):
    """A random-weight Alpamayo2 of `shape` in memory, with a tokenizer and config (no files)."""
    from worker.model.checkpoint import default_dtype
    from worker.model.config import AlpamayoConfig
    from worker.model.modules import Alpamayo2

    tok, config = shape_config(shape)
    cfg = AlpamayoConfig.from_dict(config)
    torch.manual_seed(0)
    with default_dtype(dtype), torch.device(dev):
        model = Alpamayo2(cfg)
    model.eval().requires_grad_(False)
    # Well-conditioned random weights: with the default init every layer's output dwarfs the
    # residual stream and greedy choices flip under bf16 rounding (verify(8) vs decode(1)), so an
    # oracle reference would diverge at once. Scaling the residual-branch outputs keeps the
    # stream near the token embedding; shapes, bytes and FLOPs are unchanged.
    with torch.no_grad():
        for layer in model.language_model.layers:
            layer.self_attn.o_proj.weight.mul_(5e-4)
            layer.mlp.down_proj.weight.mul_(5e-4)
    return model, cfg, tok


def condition_successors(model, allowed: torch.Tensor, seed: int = 0) -> None:
    """Give every allowed token x a fixed greedy successor pi(x) that wins by a wide margin.

    The residual stream stays near the input token's embedding (see build_model), so setting
    lm_head row pi(x) to sqrt(H) * E[x] / |E[x]| makes the logit of pi(x) about H against about
    sqrt(H) for every other token: greedy choices far above bf16 rounding at any batch size and
    in verify(8) as in decode(1). Shapes, bytes and FLOPs are unchanged (rows are overwritten).
    allowed (V,) bool: tokens the bench's rows may sample.
    """
    ids = allowed.nonzero()[:, 0]
    g = torch.Generator(device="cpu").manual_seed(seed)
    succ = ids[torch.randperm(len(ids), generator=g).to(ids.device)]
    emb = model.language_model.embed_tokens.weight
    w = model.lm_head.weight
    with torch.no_grad():
        e = emb[ids].float()
        w[succ] = (e / e.norm(dim=-1, keepdim=True) * w.shape[1] ** 0.5).to(w.dtype)


def make_runtime(model, cfg, tok, dev, dtype):
    from worker.model.inputs import ImageProcessing
    from worker.model.runtime import AlpamayoRuntime
    from worker.model.config import TokenIds

    t = tok.token_to_id
    ids = TokenIds(history_id0=t("<i0>"), future_id0=t("<i1000>"), traj_history_start=t("<|traj_history_start|>"),
                   traj_history_end=t("<|traj_history_end|>"), traj_history=t("<|traj_history|>"),
                   traj_future_start=t("<|traj_future_start|>"), traj_future_end=t("<|traj_future_end|>"),
                   traj_future=t("<|traj_future|>"), im_start=t("<|im_start|>"), im_end=t("<|im_end|>"),
                   endoftext=t("<|endoftext|>"), vision_start=t("<|vision_start|>"),
                   vision_end=t("<|vision_end|>"), image_pad=t("<|image_pad|>"), pad=t("<|endoftext|>"))
    proc = ImageProcessing(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return AlpamayoRuntime(model, cfg, tok, ids, proc, dev, dtype)


def random_draft(rt, num_layers: int = 1):
    """An untrained DFlash2 draft network for the runtime's model, in its dtype on its device
    (the draft's cost is real; its proposals come from an oracle where acceptance matters)."""
    from worker.dflash.draft import MASK_TOKEN, DraftModel
    from worker.dflash.head import head_config_for

    hc = head_config_for(rt.cfg, mask_token_id=rt.tok.token_to_id(MASK_TOKEN), num_layers=num_layers)
    with torch.device(rt.device):
        return DraftModel(hc).to(rt.dtype).eval().requires_grad_(False)


def weight_bytes(model) -> int:
    lm = model.language_model
    n = sum(p.numel() * p.element_size() for p in lm.layers.parameters())
    n += sum(b.numel() * b.element_size() for b in lm.layers.buffers())
    n += sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    n += sum(p.numel() * p.element_size() for p in lm.norm.parameters())
    return n


def kv_bytes(rt, rows: int, context: int) -> int:
    """Live K/V bytes one decode step reads: rows x context positions of every layer."""
    d = rt.decoder
    return 2 * d.num_layers * rows * d.kv_heads * context * d.head_dim * torch.finfo(rt.dtype).bits // 8


def expert_loop(t: Table, rt, rows: int, context: int, steps: int = 10) -> float:
    """The expert's flow-matching loop (CUDA graph over the persistent cache) for `rows` rows."""
    dev = rt.device
    cache = random_prompt_cache(rt, rows, context, context + rt.expert.num_waypoints + 16)
    offset = torch.full((rows,), context, dtype=torch.long, device=dev)
    delta = torch.zeros(rows, dtype=torch.long, device=dev)
    keys = torch.arange(rows, device=dev)
    graphs = rt.graphs if dev.type == "cuda" else None
    s = timeit(lambda: rt.expert.sample(cache, offset, delta, keys, steps, graphs=graphs), reps=5)
    t.add("expert", f"flow matching, {steps} steps, {rows} rows, context {context}", f"{s * 1e3:.1f} ms")
    return s


def random_prompt_cache(rt, rows: int, context: int, capacity: int):
    """Persistent cache with `context` random-token positions per row, via a text-only prefill."""
    dev = rt.device
    rt.enable_graphs(max_rows=rows, capacity=capacity)
    cache = rt.decoder.new_cache(rows, capacity, rt.dtype, dev)
    rt.decoder.persistent = cache
    ids = torch.randint(100, 300, (1, context), device=dev)
    with torch.inference_mode():
        out = rt.model.vlm.model(input_ids=ids, use_cache=True)
    c = out["cache"] if "cache" in out.keys() else out["past_key_values"]
    cache.load_prefix([(layer.keys, layer.values) for layer in c.layers], slice(0, rows))
    return cache


def engine_steps(t: Table, rt, floor_s: float, batches: list[int], context: int, tag: str) -> dict:
    """Decode(1) and verify(8) step times over the persistent cache with CUDA graphs."""
    dev = rt.device
    res = {}
    cap = context + 64
    cache = random_prompt_cache(rt, max(batches), context, cap)
    for b in batches:
        start = torch.full((b,), context, dtype=torch.long, device=dev)
        delta = torch.zeros(b, dtype=torch.long, device=dev)
        for T in (1, 8):
            ids = torch.randint(100, 300, (b, T), device=dev)
            s = timeit(lambda: rt.decoder.step(ids, start, delta, cache, context + T), reps=10)
            res[(b, T)] = s
        ratio = f" = {res[(b, 1)] / floor_s:.2f}x floor" if floor_s == floor_s and b == 1 else ""
        t.add(tag, f"decode step, batch {b}, context {context}", f"{res[(b, 1)] * 1e3:.2f} ms{ratio}")
        res[("kv_bytes", b)] = kv_bytes(rt, b, context)
        t.add(tag, f"verify(8) step, batch {b}", f"{res[(b, 8)] * 1e3:.2f} ms = {res[(b, 8)] / res[(b, 1)]:.2f}x decode")
    return res


def hf_generate(t: Table, model, dev, context: int, new: int = 16) -> dict:
    out = {}
    ids = torch.randint(100, 300, (1, context), device=dev)
    for name, kw in (("eager", {}), ("static cache (no compile)",
                                     {"cache_implementation": "static", "disable_compile": True})):
        def gen(n):
            with torch.inference_mode():
                model.vlm.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        try:
            gen(2)
            a = timeit(lambda: gen(1), warmup=0, reps=2)
            b = timeit(lambda: gen(new + 1), warmup=0, reps=2)
            per = (b - a) / new
            out[name] = per
            t.add("HF", f"generate {name}, batch 1, context {context}", f"{per * 1e3:.1f} ms/token = {1 / per:.1f} tok/s")
        except Exception as e:  # a transformers version without a feature: report, don't die
            t.add("HF", f"generate {name}", f"failed: {type(e).__name__}: {str(e)[:80]}")
    return out


def loops(t: Table, rt, head_layers: int, batches: list[int], context: int, new: int, taus=(2, 4, 6)) -> dict:
    """Baseline vs DFlash2 reasoning tokens/s (greedy; oracle proposals), draft pass time."""
    from worker.dflash.loop import DFlash2Speculator
    from worker.dflash.oracle import OracleProposer, error_rate_for_tau
    from worker.model.generate import baseline_decode, start_batch
    from worker.model.sampling import SamplingParams

    dev = rt.device
    draft = random_draft(rt, head_layers)
    hc = draft.config
    spec = DFlash2Speculator(draft, rt.model)
    res = {}
    cap = context + new + 16
    for b in batches:
        cache = random_prompt_cache(rt, b, context, cap)
        spec.begin(b, cap, persistent=True, graphs=rt.graphs)
        with torch.inference_mode():
            feats = {i: torch.randn(1, context, hc.hidden_size, device=dev, dtype=rt.dtype) for i in hc.target_layer_ids}
        spec.load_context(slice(0, b), feats, [0], per=b)

        first = torch.randn(b, rt.model.lm_head.out_features, device=dev)

        def new_batch():
            params = SamplingParams(key=torch.arange(b, device=dev), temperature=torch.zeros(b, device=dev),
                                    top_p=torch.ones(b, device=dev), top_k=torch.zeros(b, dtype=torch.long, device=dev))
            logits = first
            return start_batch(cache, torch.full((b,), context, device=dev), logits,
                               torch.zeros(b, dtype=torch.long, device=dev), params, rt._banned_text,
                               torch.tensor([-1], device=dev), torch.full((b,), new, device=dev))
        baseline_decode(rt.decoder, new_batch())      # capture
        s_base = timeit(lambda: baseline_decode(rt.decoder, new_batch()), warmup=0, reps=3)
        ref = baseline_decode(rt.decoder, new_batch()).generated.clone()
        base_tps = b * new / s_base
        t.add("loop", f"baseline reasoning, batch {b}, {new} tokens", f"{base_tps:.0f} tok/s")
        res[("base", b)] = base_tps
        # draft pass alone
        probe = new_batch()
        s_draft = timeit(lambda: spec.proposer.propose(probe), reps=10)
        t.add("loop", f"draft pass, batch {b}", f"{s_draft * 1e3:.2f} ms")
        res[("draft", b)] = s_draft
        inner = spec.proposer
        for tau in taus:
            spec.proposer = OracleProposer(inner, ref, error_rate_for_tau(tau), seed=7)
            try:
                spec.decode(rt.decoder, new_batch())
                out = {}

                def run():
                    out["b"], out["s"] = spec.decode(rt.decoder, new_batch())
                s_spec = timeit(run, warmup=0, reps=3)
            finally:
                spec.proposer = inner
            rows = out["s"]()
            steps = sum(len(r.accepted) for r in rows)
            acc = sum(sum(r.accepted) for r in rows)
            tps = b * new / s_spec
            diff = int((out["b"].generated != ref).sum())
            res[("dflash", b, tau)] = tps
            res[("diff", b, tau)] = diff
            t.add("loop", f"DFlash2 oracle tau={tau} (measured {1 + acc / max(steps, 1):.2f}), batch {b}",
                  f"{tps:.0f} tok/s = {tps / base_tps:.2f}x baseline"
                  + ("" if diff == 0 else f" ({diff}/{ref.numel()} tokens differ: bf16 verify vs decode rounding)"))
    return res


def end_to_end(t: Table, rt, image_hw: tuple[int, int], reasoning: int) -> dict:
    from worker.model.runtime import SceneRequest

    rng = np.random.default_rng(0)
    rt.trajectory_max_new = reasoning
    rt.enable_graphs(max_rows=4, capacity=8192 if rt.device.type == "cuda" else 1024)
    xyz = np.zeros((16, 3), np.float32)
    xyz[:, 0] = np.linspace(-15, 0, 16)
    rot = np.tile(np.eye(3, dtype=np.float32), (16, 1, 1))
    frames = rng.integers(0, 255, (24, image_hw[0], image_hw[1], 3), dtype=np.uint8)
    out = {}
    for k in (1, 3):
        req = SceneRequest(request_id=f"e2e-{k}", task="trajectory", frames=frames, camera_ids=(0, 1, 2, 3, 5, 6),
                           ego_history_xyz=xyz, ego_history_rot=rot, num_samples=k, temperature=0.6, seed=1)
        rt.run([req])                                   # untimed first request per K (warm-up, capture)
        walls, splits = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            r = rt.run([req])[0]
            _sync()
            walls.append(time.perf_counter() - t0)
            splits.append(r.timings_ms)
        wall = statistics.median(walls)
        sp = {key: statistics.median(s[key] for s in splits) for key in splits[0]}
        out[k] = wall
        t.add("e2e", f"scene K={k}, {image_hw[1]}x{image_hw[0]} x 24 images, {reasoning} reasoning tokens",
              f"{wall * 1e3:.0f} ms (prep {sp['image_prep']:.0f}, prefill {sp['prefill']:.0f}, "
              f"reasoning {sp['decode']:.0f}, diffusion {sp['diffusion']:.0f})")
    t.add("e2e", "K=3 scene / K=1 scene", f"{out[3] / out[1]:.2f}x")
    return out


def demo_acceptance(t: Table, checkpoint: str, head: str, dev, n: int = 16) -> None:
    from worker.dflash.loop import DFlash2Speculator
    from worker.dflash.train import demo_requests, measure_acceptance
    from worker.model.runtime import AlpamayoRuntime

    base = AlpamayoRuntime.load(checkpoint, device=dev)
    spec = AlpamayoRuntime.load(checkpoint, device=dev, speculator_factory=DFlash2Speculator.factory(head))
    reqs = demo_requests(range(90_000_000, 90_000_000 + n), k=1, temperature=0.0)
    for rt in (base, spec):
        rt.enable_graphs(max_rows=32, capacity=1024)
        rt.run(reqs[:1])
    a = base.run(reqs)
    b = spec.run(reqs)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    q = measure_acceptance(spec, reqs)
    t.add("demo", f"real acceptance, {n} held-out scenes (greedy)",
          f"rate {q['draft_acceptance_rate']:.3f}, mean length {q['mean_acceptance_length']:.2f}; "
          f"identical outputs {same}/{n}")
    for name, rt in (("baseline", base), ("dflash2", spec)):
        walls = []
        for r in reqs[:4]:
            t0 = time.perf_counter()
            res = rt.run([r])[0]
            _sync()
            walls.append((time.perf_counter() - t0, res.timings_ms))
        ms = statistics.median(w for w, _ in walls) * 1e3
        dec = statistics.median(tm["decode"] for _, tm in walls)
        t.add("demo", f"{name} scene latency (K=1)", f"{ms:.1f} ms (reasoning {dec:.1f} ms)")


def to_fp8(rt, model) -> None:
    """The decoder stacks quantised to fp8 in place, as a checkpoint loaded for an fp8 profile has
    them; the captured graphs dropped and the fused products of the text stack and of the expert
    built again (a stack left unfused keeps its bf16 q/k/v and gate/up products)."""
    from worker.model.fp8 import quantize_model_fp8

    rt.graphs.clear()
    quantize_model_fp8(model)
    rt.decoder.fuse()
    rt.expert.fuse()


def decode_path_targets(steps: dict, lp: dict, hf: dict, expert_s: float, floor_s: float, wb: int, bw: float,
                        batches: list[int]) -> str:
    """The `Targets: GPU decode path` table (issue 14), from figures measured in this run."""
    rows = []

    def row(target: str, measured: float | None, limit: float, text: str, higher_is_better: bool = False):
        if measured is None or measured != measured:
            rows.append(f"| {target} | not measured | missed |")
            return
        ok = measured >= limit if higher_is_better else measured <= limit
        rows.append(f"| {target} | {text} | {'met' if ok else 'missed'} |")

    big = max(batches)
    d1 = steps.get((1, 1))
    row("decode step, batch 1, context 4400 <= 1.12x weight-streaming floor", d1 / floor_s if d1 else None, 1.12,
        f"{(d1 or 0) * 1e3:.2f} ms = {(d1 or 0) / floor_s:.2f}x")
    if (big, 1) in steps:
        kv_floor = (wb + steps[("kv_bytes", big)]) / bw
        r = steps[(big, 1)] / kv_floor
        row(f"decode step, batch {big}, context 4400 <= 1.25x (weights + live K/V) / copy bandwidth", r, 1.25,
            f"{steps[(big, 1)] * 1e3:.2f} ms = {r:.2f}x of {kv_floor * 1e3:.2f} ms")
    for b, limit in ((1, 1.10), (4, 1.25)):
        if (b, 8) in steps:
            r = steps[(b, 8)] / steps[(b, 1)]
            row(f"verify(8) <= {limit:.2f}x decode(1), batch {b}", r, limit, f"{r:.2f}x")
    for b in (1, big):
        if ("draft", b) in lp and (b, 8) in steps:
            r = lp[("draft", b)] / steps[(b, 8)]
            row(f"draft pass <= 8% of a verify step, batch {b}", r, 0.08, f"{100 * r:.1f}%")
    for b, limit in ((1, 3.3), (4, 2.8), (16, 2.2), (32, 1.8)):
        if ("dflash", b, 4) in lp:
            r = lp[("dflash", b, 4)] / lp[("base", b)]
            diff = lp.get(("diff", b, 4), -1)
            ok_text = f"{r:.2f}x, {diff} tokens differ"
            row(f"DFlash2 oracle tau=4 over baseline, batch {b}: >= {limit}x, 0 tokens differ",
                r if diff == 0 else float("nan"), limit, ok_text, higher_is_better=True)
            if diff != 0:
                rows[-1] = f"| DFlash2 oracle tau=4 over baseline, batch {b}: >= {limit}x, 0 tokens differ | {ok_text} | missed |"
    row("expert 10-step loop, 8 rows <= 100 ms", expert_s * 1e3, 100.0, f"{expert_s * 1e3:.1f} ms")
    if "eager" in hf and ("dflash", 1, 4) in lp:
        r = lp[("dflash", 1, 4)] * hf["eager"]
        row("DFlash2 tau=4 batch 1 over HF generate eager (bf16) >= 14x", r, 14.0, f"{r:.1f}x", higher_is_better=True)
    head = ["### Targets: GPU decode path", "", "| target | measured | status |", "|---|---|---|"]
    return "\n".join(head + rows)


def demo_parity(t: Table, checkpoint: str, head: str, dev) -> list[str]:
    """The demo checkpoint on the GPU path (bf16, CUDA graphs, fused kernels): dflash2 outputs
    against the baseline's, 32 held-out scenes greedy in one batch and 16 at K=3, T=0.6."""
    from worker.dflash.loop import DFlash2Speculator
    from worker.dflash.train import demo_requests
    from worker.model.runtime import AlpamayoRuntime

    base = AlpamayoRuntime.load(checkpoint, device=dev)
    spec = AlpamayoRuntime.load(checkpoint, device=dev, speculator_factory=DFlash2Speculator.factory(head))
    rows = []
    for n, k, temp in ((32, 1, 0.0), (16, 3, 0.6)):
        reqs = demo_requests(range(91_000_000, 91_000_000 + n), k=k, temperature=temp)
        outs = []
        for rt in (base, spec):
            rt.enable_graphs(max_rows=n * k, capacity=1024)
            rt.run(reqs[:1])
            outs.append(rt.run(reqs))
        same = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
        traj = max(float(np.abs(a.trajectories - b.trajectories).max()) for a, b in zip(*outs))
        steps = sum(r.speculative.steps for r in outs[1])
        acc = sum(r.speculative.accepted for r in outs[1])
        t.add("demo", f"{n} held-out scenes in one batch, K={k}, T={temp}",
              f"dflash2 == baseline in {same}/{n} scenes (trajectory max diff {traj:.2e} m); "
              f"mean acceptance length {1 + acc / max(steps, 1):.2f}")
        rows.append(f"| demo checkpoint on the GPU: dflash2 outputs equal the baseline's, {n} scenes, K={k}, T={temp} "
                    f"| {same}/{n} | {'met' if same == n else 'missed'} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32b" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--batches", default=None, help="comma list (default 1,4,16,32 on GPU; 1,2 on CPU)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--demo", default=None, help="demo checkpoint dir (real acceptance)")
    ap.add_argument("--head", default=None, help="DFlash2 head dir for --demo")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--expert-only", action="store_true",
                    help="only the expert loop (8 rows)")
    ap.add_argument("--throughput", action="store_true",
                    help="whole scenes through AlpamayoRuntime, baseline vs dflash2 (oracle tau=4), bf16 and fp8 "
                         "(worker/bench_throughput.py; --batches default 1,8,16,32)")
    ap.add_argument("--k3-batches", default=None, help="--throughput: batches also run at K=3 (default 1,8 on GPU, 1 on CPU; '' for none)")
    ap.add_argument("--profiles", default="bf16,fp8", help="--throughput: precision profiles, in order")
    ap.add_argument("--reps", type=int, default=1, help="--throughput: timed runs per batch (median)")
    ap.add_argument("--quick", action="store_true", help="--throughput: batches 1,16; K=3 at batch 1 only")
    ap.add_argument("--capacity", type=int, default=None,
                    help="--throughput: cache columns per row (default: what a scene needs, rounded up to 256; "
                         "the worker's default is 8192)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="only profile the decode/verify/draft/expert kernels, bf16, then the decode and verify "
                         "steps at batch 1 in fp8; write DIR/profile.txt")
    ap.add_argument("--profile-prefill", default=None, metavar="DIR",
                    help="only profile one 24-image scene's prefill, bf16 then fp8; write DIR/prefill.txt")
    ap.add_argument("--profile-demo", default=None, metavar="DIR",
                    help="only profile one batch of 16 demo scenes (needs --demo, --head), baseline then dflash2; "
                         "write DIR/demo.txt")
    ap.add_argument("--compare", default=None, metavar="MODULE.FLAG",
                    help="only the batch-1 decode and verify steps, bf16 and fp8, with a worker.model switch "
                         "(e.g. stream_gemm.EARLY_WEIGHTS) on and off, side by side")
    ap.add_argument("--config-only", default=None, metavar="DIR",
                    help="write a config-only directory of --shape (ALPAMAYO_LOAD_FORMAT=dummy serves it) and exit")
    args = ap.parse_args(argv)
    if args.config_only:
        print(write_config_only(args.shape, args.config_only))
        return 0
    if args.profile_prefill:
        from worker.bench_throughput import profile_prefill

        profile_prefill(shape=args.shape, out_dir=args.profile_prefill)
        return 0
    if args.profile_demo:
        if not (args.demo and args.head):
            ap.error("--profile-demo needs --demo CKPT and --head HEAD")
        from worker.bench_throughput import profile_demo

        profile_demo(args.demo, args.head, out_dir=args.profile_demo)
        return 0
    if args.throughput:
        profiles = args.profiles.split(",")
        if not set(profiles) <= {"bf16", "fp8"} or profiles != sorted(set(profiles)):
            # fp8 quantises the bench's one model in place: a bf16 row after it would run fp8 weights
            ap.error(f"--profiles {args.profiles}: give bf16, fp8 or bf16,fp8 (bf16 first: fp8 quantises the weights in place)")
        from worker import bench_throughput     # it imports this module's helpers

        return bench_throughput.main(args)
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    context = args.context or (4400 if args.shape == "32b" else 256)
    batches = [int(x) for x in (args.batches or ("1,4,16,32" if gpu else "1,2")).split(",")]
    new = args.new_tokens or (128 if gpu else 24)
    t = Table()
    import transformers

    t.add("setup", "date / device", f"{datetime.date.today()} / {torch.cuda.get_device_name(0) if gpu else platform.processor() or 'cpu'}")
    t.add("setup", "torch / transformers", f"{torch.__version__} / {transformers.__version__}")
    bw, _ = floors(t, dev)
    if gpu:
        torch.cuda.empty_cache()
    model, cfg, tok = build_model(args.shape, dev, dtype)
    rt = make_runtime(model, cfg, tok, dev, dtype)
    wb = weight_bytes(model)
    floor_s = wb / bw if bw == bw else float("nan")
    t.add("floors", f"{args.shape}: weight bytes per decode step", f"{wb / 1e9:.2f} GB"
          + (f" -> floor {floor_s * 1e3:.2f} ms/step" if floor_s == floor_s else ""))
    condition_successors(model, ~rt._banned_text)
    if args.profile:
        from worker.bench_throughput import profile_steps

        profile_steps(rt, context, args.profile, label=str(dtype)[6:])
        to_fp8(rt, model)
        profile_steps(rt, context, args.profile, label="fp8", shapes=((1, 1), (1, 8)))
        return 0
    if args.expert_only:
        expert_loop(t, rt, 8, context)
        return 0
    if args.compare:
        from worker.bench_throughput import compare_switch

        md = compare_switch(t, rt, model, args.compare, context)
        if args.out:
            Path(args.out).write_text(md + "\n")
        print("\n" + md)
        return 0
    hf = {} if args.skip_hf else hf_generate(t, model, dev, context, new=16 if gpu else 4)
    steps = engine_steps(t, rt, floor_s, sorted({1, 4, max(batches)}), context, "bf16")
    if gpu:
        torch.cuda.empty_cache()
    lp = loops(t, rt, 1, batches, context, new)
    if "eager" in hf:
        best = max(v for k_, v in lp.items() if k_[0] == "dflash" and k_[2] == 4 and k_[1] == 1)
        t.add("ratio", "DFlash2 tau=4 batch 1 tok/s / HF eager batch 1", f"{best * hf['eager']:.1f}x")
        top = max(v for k_, v in lp.items() if k_[0] == "dflash" and k_[2] == 4)
        t.add("ratio", f"DFlash2 tau=4 batch {max(batches)} tok/s / HF eager batch 1", f"{top * hf['eager']:.1f}x")
    t.add("ratio", "draft pass / verify(8), batch 1", f"{lp[('draft', 1)] / steps[(1, 8)]:.3f}")
    expert_s = expert_loop(t, rt, 8, context)
    targets = decode_path_targets(steps, lp, hf, expert_s, floor_s, wb, bw, batches)
    print("\n" + targets, flush=True)
    if not args.skip_e2e:
        end_to_end(t, rt, (1080, 1920) if args.shape == "32b" else (64, 64), 64 if gpu else 8)
    to_fp8(rt, model)
    if gpu:
        torch.cuda.empty_cache()
    s8 = engine_steps(t, rt, floor_s, [1], context, "fp8")
    t.add("ratio", "fp8 decode step / bf16 decode step, batch 1", f"{s8[(1, 1)] / steps[(1, 1)]:.2f}")
    del model, rt
    if gpu:
        torch.cuda.empty_cache()
    if args.demo and args.head:
        demo_acceptance(t, args.demo, args.head, dev)
        targets += "\n" + "\n".join(demo_parity(t, args.demo, args.head, dev))
    md = t.markdown() + "\n\n" + targets
    if args.out:
        Path(args.out).write_text(md + "\n")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
