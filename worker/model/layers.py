"""The GPU step of a stack of Qwen3-style layers over a static KV cache: the target decoder
(decode and verify), the DFlash2 draft head and the action expert all run through `FusedStack`.

Per layer of a step, 9 launches: [residual add + RMSNorm] -> q/k/v GEMM -> [q/k norm + rotary, K/V into
the cache] -> attention over live keys (2 kernels) -> o GEMM -> [residual add + RMSNorm] ->
gate/up GEMM -> [silu * mul] -> down GEMM. The residual add of a layer's MLP output is folded
into the next layer's input norm. The reference (unfused, CPU) math of each user stays in its
own module; `python -m worker.kernel_check` (run on the CPU by `tests/worker/test_kernel_check.py`,
through Triton's interpreter) checks this path against it.

A prompt's prefill runs transformers' text model (its multimodal rotary and deepstack glue) with
each layer's forward swapped for `FusedStack.prefill_layer` inside `FusedStack.prefilling()`:
the same fused element-wise kernels and projections, torch's SDPA (causal, grouped-query) for
the prompt's attention, and its K/V written once into per-layer buffers (no cache appends).

Shapes: B rows, T new tokens per row, P prompt tokens, H hidden, Hq/Hkv heads, D head dim, L cache capacity.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import cache_attention
from worker.model.fp8 import Fp8Linear
from worker.model.stream_gemm import stream_linear
from worker.model.fused_ops import available as fused_available
from worker.model.fused_ops import add_rms_norm, qk_norm_rope_write, silu_mul


def norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return 1e-6 if eps is None else float(eps)


def fuse_projections(mods: list[nn.Module]) -> nn.Module | None:
    """One projection whose output is the concatenation of `mods`' outputs; the original
    modules' weights become views into it (no extra memory), as trainable as they were (a model
    that is still being trained keeps training them: optimiser steps write through the views into
    the fused weight). None if they cannot be fused."""
    if all(type(m) is nn.Linear and m.bias is None for m in mods):
        w = torch.cat([m.weight.data for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(w[off:off + n], requires_grad=m.weight.requires_grad)
            off += n
        return fused
    if all(isinstance(m, Fp8Linear) and m.bias is None for m in mods):
        fused = Fp8Linear.from_parts(torch.cat([m.weight for m in mods]), torch.cat([m.weight_scale for m in mods]),
                                     mods[0].compute_dtype)
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight, m.weight_scale = fused.weight[off:off + n], fused.weight_scale[off:off + n]
            off += n
        return fused
    return None


# products of at most this many rows with a plain `nn.Linear` weight stored (N, K) (qkv, gate/up)
# run the Triton weight-streaming kernel instead of cuBLAS: at 1 row 25.8 / 119.0 us against
# 28.1 / 130.6 for the 32B layer, at 8 rows 27.6 / 123.0 against 28.0 / 128.7 (H200, 2026-12-01);
# decode step, batch 1: 16.82 against 18.10 ms with cuBLAS on the same machine
GEMV_MAX_ROWS = 8


def project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x) for a projection of the fused path: few rows (`GEMV_MAX_ROWS`) of a plain `nn.Linear`
    whose weight is stored (N, K) through the weight-streaming kernel; anything else (more rows,
    weights stored transposed for cuBLAS, fp8 modules) through the module."""
    if (GEMV_MAX_ROWS and type(m) is nn.Linear and m.weight.stride(1) == 1
            and x.numel() <= GEMV_MAX_ROWS * x.shape[-1] and fused_available(x)):
        return stream_linear(x, m.weight, None, m.bias)
    return m(x)


def norm_project(proj, x: torch.Tensor, norm: nn.Module,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, proj(rms_norm(h))) with h = x + residual (or x); proj: a projection, or a tuple of
    projections whose outputs are concatenated. Where proj multiplies in fp8 x fp8
    (`Fp8Linear.takes_fp8`: a prompt's rows on the GPU), the norm hands its output over quantised."""
    if isinstance(proj, Fp8Linear) and proj.takes_fp8(x):
        h, (xq, scale) = add_rms_norm(x, norm.weight, norm_eps(norm), residual=residual, quantize=True)
        return h, proj.forward_fp8(xq, scale, h)
    h, y = add_rms_norm(x, norm.weight, norm_eps(norm), residual=residual)
    return h, (concat_project(proj, y) if isinstance(proj, tuple) else project(proj, y))


def concat_project(proj, x: torch.Tensor) -> torch.Tensor:
    """proj(x) for a projection, or the concatenated outputs of a tuple of projections (the
    q/k/v and gate/up entries of `FusedStack.parts` where they could not be fused)."""
    return torch.cat([m(x) for m in proj], -1) if isinstance(proj, tuple) else proj(x)


def silu_project(down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) of the fused gate/up output (..., 2 I); handed over quantised where
    down multiplies in fp8 x fp8, as in `norm_project`."""
    if isinstance(down, Fp8Linear) and down.takes_fp8(gate_up):
        return down.forward_fp8(*silu_mul(gate_up, quantize=True), gate_up)
    return project(down, silu_mul(gate_up))


def store_transposed(m: nn.Module) -> None:
    """Keep an inference GPU `nn.Linear`'s weight as (in, out) row-major (the module sees its
    transposed view, so every caller is unchanged): `F.linear` then runs cuBLAS's NN product
    instead of TN (only where the fused path runs: GPUs, and Triton's interpreter in tests). Measured on the H200 (`python -m worker.kernel_check --sweep`): the NN form is
    faster for the down projection at every row count (1-256 rows: 73-106 us against 78-109) and
    ties for o; it loses for gate/up at 128 rows, which therefore keep the (out, in) layout."""
    w = getattr(m, "weight", None)
    if type(m) is nn.Linear and fused_available(w) and not w.requires_grad and w.is_contiguous():
        m.weight = nn.Parameter(w.data.t().contiguous().t(), requires_grad=False)


class FusedStack:
    """Layers with `.self_attn.{q,k,v,o}_proj`, `.self_attn.{q,k}_norm`, `.input_layernorm`,
    `.post_attention_layernorm`, `.mlp.{gate,up,down}_proj` (transformers' Qwen3 layout)."""

    def __init__(self, layers, head_dim: int):
        self.layers = list(layers)
        self.head_dim = head_dim
        self.fuse()

    def fuse(self) -> None:
        """Fuse q/k/v and gate/up per layer (`parts`: (q/k/v, gate/up, (Hq, Hkv)) per layer; a
        tuple of the separate projections where they cannot be fused), and store o and down
        transposed (`store_transposed`). Call again after swapping weights (fp8 quantisation)."""
        self.parts = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = fuse_projections([a.q_proj, a.k_proj, a.v_proj]) or (a.q_proj, a.k_proj, a.v_proj)
            gate_up = fuse_projections([m.gate_proj, m.up_proj]) or (m.gate_proj, m.up_proj)
            heads = (a.q_proj.out_features // self.head_dim, a.k_proj.out_features // self.head_dim)
            store_transposed(a.o_proj)
            store_transposed(m.down_proj)
            self.parts.append((qkv, gate_up, heads))

    def run(self, h: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], start: torch.Tensor,
            rope_delta: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float, causal: bool,
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """h (B, T, H) -> (B, T, H) after every layer, and {layer id: its output} for `capture`.

        caches[l] = (K, V) of layer l, each (>= B, Hkv, L, D). The T tokens' K/V are written at
        cache positions start[b] + t (rotary position + rope_delta[b]); each row attends keys
        [0, start[b] + T) (causal: token t stops at start[b] + t).
        """
        b, t, _ = h.shape
        kv_len = start + t
        hidden: dict[int, torch.Tensor] = {}
        pending = None                       # the previous layer's MLP output, not yet added
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            qkv_proj, gate_up_proj, (hq, hkv) = self.parts[i]
            h, qkv = norm_project(qkv_proj, pending if pending is not None else h, layer.input_layernorm,
                                  residual=h if pending is not None else None)
            k_cache, v_cache = caches[i]
            q = qk_norm_rope_write(qkv, hq, hkv, a.q_norm.weight, a.k_norm.weight, norm_eps(a.q_norm),
                                   k_cache, v_cache, start, rope_delta, inv_freq, rope_scaling)
            o = cache_attention(q, k_cache, v_cache, kv_len, causal)
            h, gu = norm_project(gate_up_proj, project(a.o_proj, o.view(b, t, -1)), layer.post_attention_layernorm,
                                 residual=h)
            pending = silu_project(mlp.down_proj, gu)
            if i in capture:
                h, pending = h + pending, None
                hidden[i] = h
        if pending is not None:
            h = h + pending
        return h, hidden

    def prefill_layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv: list) -> torch.Tensor:
        """Layer i over G whole prompts of P tokens: h (G, P, H) -> (G, P, H), as transformers'
        decoder layer computes it (cos, sin (G, P, D): its rotary embedding); the layer's K/V
        (G, Hkv, P, D) are stored in kv[i]."""
        layer = self.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        qkv_proj, gate_up_proj, (hq, hkv) = self.parts[i]
        b, p, _ = h.shape
        _, qkv = norm_project(qkv_proj, h, layer.input_layernorm)
        k = torch.empty(b, hkv, p, self.head_dim, dtype=h.dtype, device=h.device)
        v = torch.empty_like(k)
        start = torch.zeros(b, dtype=torch.long, device=h.device)
        q = qk_norm_rope_write(qkv, hq, hkv, a.q_norm.weight, a.k_norm.weight, norm_eps(a.q_norm), k, v, start,
                               cos_sin=(cos, sin))
        kv[i] = (k, v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=hq != hkv)
        h, gu = norm_project(gate_up_proj, a.o_proj(o.transpose(1, 2).reshape(b, p, -1)),
                             layer.post_attention_layernorm, residual=h)
        return h + silu_project(mlp.down_proj, gu)

    @contextlib.contextmanager
    def prefilling(self):
        """Within: every layer's forward, as transformers' text model calls it for G prompts of
        one length (no padding, an empty cache), is `prefill_layer`. Yields the list that receives
        each layer's (K, V) (G, Hkv, P, D); the model's own cache object stays empty."""
        kv: list = [None] * len(self.layers)

        def forward(i):
            def run(hidden_states, *args, position_embeddings, **kwargs):
                return self.prefill_layer(i, hidden_states, *position_embeddings, kv)
            return run

        for i, layer in enumerate(self.layers):
            layer.forward = forward(i)             # shadows the class's forward; hooks still run
        try:
            yield kv
        finally:
            for layer in self.layers:
                del layer.forward

    @staticmethod
    def final_norm(h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return add_rms_norm(h, norm.weight, norm_eps(norm))[1]
