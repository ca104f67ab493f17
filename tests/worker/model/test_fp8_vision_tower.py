"""The vision tower with fp8 products (fp8 x fp8 over a prompt's rows): the fused paths against the
reference ops. e4m3 rounds every product's input to 3 mantissa bits, so a last-bit difference
upstream (the batched attention, the fused rotary) moves some values a whole e4m3 step and the
difference grows from layer to layer; the kernel check's fp8 prefill rows (`FP8_PREFILL_BOUND`)
measure that, and this test pins where it comes from on the CPU (Triton's interpreter, torch's
fp32 -> e4m3 cast on both sides and no quantising handovers: the interpreter's cast drops rounding
carries; the handovers' bits are checked on the GPU, `kernel_check`)."""

from __future__ import annotations

from tests.worker.model.interpreted import run_interpreted

_CASES = r"""
import json
import torch
from worker.bench import build_model, make_runtime
from worker.bench_throughput import scenes
from worker.kernel_check import FP8_PREFILL_BOUND, rel_err
from worker.model import fp8
from worker.model.fast_vision import fast_vision_paths
from worker.model.fused_ops import reference_only

fp8._has_fp8_mm = lambda device: True                    # torch's CPU _scaled_mm stands in for CUDA's
fp8.FP8_MM_MIN_FEATURES = 16                             # the tiny shape's products take it too
fp8.quantize_rows = fp8.quantize_rows_reference
fp8.Fp8Linear.takes_fp8 = lambda self, x: False          # the norms' and GELU's own e4m3 casts run interpreted
model, cfg, tok = build_model("tiny", torch.device("cpu"), torch.float32)
rt = make_runtime(model, cfg, tok, torch.device("cpu"), torch.float32)
p = rt._prepare(scenes(1, 1, (64, 64), "kernel-check")[0])      # the kernel check's scene
vis = rt.model.vlm.model.visual

def tower():
    v = vis(p.pixel_values, grid_thw=p.grid)
    a = v.pooler_output if hasattr(v, "pooler_output") else v[0]
    return torch.cat(list(a)) if isinstance(a, (list, tuple)) else a

out = {}
with torch.inference_mode():
    with fast_vision_paths(rt.model):
        fused = tower()
    with reference_only():
        ref = tower()
    out["plain"] = rel_err(fused, ref)[0]
    fp8.quantize_model_fp8(model)
    with fast_vision_paths(rt.model):
        fused8 = tower()
    with reference_only():
        ref8 = tower()
    out["fp8"] = rel_err(fused8, ref8)[0]
    out["fp8_weights"] = rel_err(ref8, ref)[0]
out["bound"] = FP8_PREFILL_BOUND
print(json.dumps(out))
"""


def test_the_fp8_towers_difference_from_its_reference_is_e4m3_amplifying_last_bits():
    """Without fp8 the fused vision paths agree with the reference to fp32's last bits; with e4m3
    inputs the same paths can differ by far more (this scene: 5.3e-4 against 8.3e-7, tiny model;
    8.5e-3 for the mid model; 2.9e-2 on the H200, handovers included), yet stay inside the kernel
    check's bound and well below what fp8 weights themselves change (5.1e-2)."""
    r = run_interpreted(_CASES)         # (worker.kernel_check, imported here, would set TRITON_INTERPRET
                                        # for every process this one starts after)
    assert r["plain"] < 1e-5, r
    # (how many values flip depends on the input: none for some scenes)
    assert r["fp8"] < min(r["bound"], r["fp8_weights"] / 4), r
