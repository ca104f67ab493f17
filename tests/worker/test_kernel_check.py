"""The GPU path's Triton kernels (attention over live keys, fused norm/rope/silu, whole fused
stacks of the decoder, draft head and expert, a prompt's prefill through the fused layers) against the reference torch ops, run on the CPU
through Triton's interpreter by the same script the GPU check uses (`python -m worker.kernel_check`)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import REPO_ROOT


def test_kernels_match_reference_ops_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "worker.kernel_check", "--shape", "tiny"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| ok |" in line]
    for name in ("attention decode", "attention verify", "attention draft", "attention expert", "silu_mul",
                 "qk_norm_rope_write k in cache", "decoder step T=8: logits", "expert velocity", "draft block hidden",
                 "draft context write: K", "draft context write: V",
                 "fp8 weight-only down", "fp8 weight-only odd", "fp8 decoder step T=8: logits", "fp8 expert velocity",
                 "prefill (399 tokens): logits", "prefill: layer 0 K", "fp8 prefill: captured hidden"):
        assert any(row.startswith(f"| {name} ") for row in rows), (name, proc.stdout)
    assert proc.stdout.strip().endswith("passed: 0 check(s) out of bounds")
