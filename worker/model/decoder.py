"""A compact decoder over a static KV cache with one length per sequence.

Decode (T=1) and DFlash2 verification (T=8) run here instead of through transformers: the cache
is indexed by position, so rolling a sequence back is just lowering its length (rejected slots
are overwritten next step), ragged acceptance across a batch costs nothing, and shapes stay
static for CUDA graphs.

For text positions the multimodal rotary of Qwen3-VL (three equal axes) reduces to 1-D rotary
at `position = cache_index + rope_delta`; `rope_delta` comes from the prompt's multimodal
positions (see `inputs.mrope_positions`).

Shapes: B rows (scenes x samples), T new tokens per row, L cache capacity, Hkv KV heads, D head
dim, H hidden size, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import attend_reference
from worker.model.fused_ops import available as fused_available
from worker.model.graphs import GraphCache
from worker.model.layers import FusedStack, concat_project


class StaticKVCache:
    """K/V of every layer: (layers, rows, Hkv, L, D). Row r holds positions [0, length[r])."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, rows, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def load_prefix(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: slice) -> None:
        """Copy a prefill's per-layer K/V (G, Hkv, P, D) of G prompts into `rows`, K consecutive
        rows each (the K-way fork; len(rows) = G x K)."""
        for layer, (k, v) in enumerate(layer_kv):
            g, p = k.shape[0], k.shape[2]
            self.k[layer, rows, :, :p].unflatten(0, (g, -1)).copy_(k[:, None])
            self.v[layer, rows, :, :p].unflatten(0, (g, -1)).copy_(v[:, None])


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos, sin (B, T, D), rotary layout cat(freqs, freqs) as in transformers."""
    freqs = positions[..., None].float() * inv_freq.float().to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D); cos/sin (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """Projections, per-head q/k RMSNorm and rotary of a Qwen3 attention module.

    x (B, T, H) -> q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, D).
    """
    b, t, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(b, t, -1, head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, t, -1, head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm (normalise in fp32, cast back, then scale) with a fused kernel."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@dataclass
class StepOutput:
    logits: torch.Tensor                 # (B, T, V) fp32
    hidden: dict[int, torch.Tensor]      # layer id -> (B, T, H), output of that decoder layer


class TextDecoder:
    """Runs the VLM text stack (weights of transformers' Qwen3VLTextModel) over a StaticKVCache."""

    def __init__(self, language_model: nn.Module, lm_head: nn.Module):
        self.lm = language_model
        self.lm_head = lm_head
        conf = language_model.config
        self.head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        self.num_layers = conf.num_hidden_layers
        self.kv_heads = conf.num_key_value_heads
        rotary = language_model.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.graphs = GraphCache(enabled=False)
        self.persistent: StaticKVCache | None = None     # the cache graphs are captured over
        self.fuse()

    def fuse(self) -> None:
        """Fuse q/k/v and gate/up projections per layer (fewer, larger matrix-vector products in
        decode). Call again after swapping weights (e.g. fp8 quantisation)."""
        self.stack = FusedStack(self.lm.layers, self.head_dim)

    def step(self, input_ids: torch.Tensor, start: torch.Tensor, rope_delta: torch.Tensor, cache: StaticKVCache,
             context_len: int, capture: tuple[int, ...] = ()) -> StepOutput:
        """`forward`, replayed as a CUDA graph per (rows, T, capture) over the persistent cache
        when graphs are on; eager otherwise."""
        if cache is self.persistent:
            key = ("decode", tuple(input_ids.shape), capture)
            return self.graphs.run(
                key, lambda i, s, d: self.forward(i, s, d, cache, cache.capacity, capture), input_ids, start, rope_delta)
        return self.forward(input_ids, start, rope_delta, cache, context_len, capture)

    def new_cache(self, rows: int, capacity: int, dtype: torch.dtype, device) -> StaticKVCache:
        return StaticKVCache(self.num_layers, rows, self.kv_heads, capacity, self.head_dim, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, rope_delta: torch.Tensor,
                cache: StaticKVCache, context_len: int, capture: tuple[int, ...] = ()) -> StepOutput:
        """Feed T tokens per row at positions start..start+T-1 and write their K/V.

        input_ids (B, T) long; start (B,) long cache index of the first new token;
        rope_delta (B,) long; context_len: host int >= max(start) + T (keys attended).
        Row b's token t attends keys [0, start[b] + t].
        """
        h = self.lm.embed_tokens(input_ids).to(cache.k.dtype)
        if fused_available(h):
            caches = [(cache.k[i], cache.v[i]) for i in range(self.num_layers)]
            h, hidden = self.stack.run(h, caches, start, rope_delta, self.inv_freq, self.rope_scaling,
                                       causal=True, capture=capture)
            logits = self.lm_head(self.stack.final_norm(h, self.lm.norm)).float()
            return StepOutput(logits=logits, hidden=hidden)
        return self._forward_reference(h, start, rope_delta, cache, context_len, capture)

    def _forward_reference(self, h: torch.Tensor, start: torch.Tensor, rope_delta: torch.Tensor,
                           cache: StaticKVCache, context_len: int, capture: tuple[int, ...]) -> StepOutput:
        """`forward` in plain torch ops over the first context_len cache columns (CPU, exact fp32)."""
        b, t = h.shape[:2]
        dev = h.device
        write = start[:, None] + torch.arange(t, device=dev)             # (B, T)
        cos, sin = rope_cos_sin(write + rope_delta[:, None], self.inv_freq, cache.k.dtype,
                                self.rope_scaling)
        idx = write[:, None, :, None].expand(b, self.kv_heads, t, self.head_dim)
        hidden: dict[int, torch.Tensor] = {}
        d = self.head_dim
        for i, layer in enumerate(self.lm.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_proj, gate_up_proj, (hq, hkv) = self.stack.parts[i]
            x = rms_norm(h, layer.input_layernorm)
            q, k, v = concat_project(qkv_proj, x).split((hq * d, hkv * d, hkv * d), dim=-1)
            q = apply_rope(rms_norm(q.view(b, t, -1, d), attn.q_norm).transpose(1, 2), cos, sin)
            k = apply_rope(rms_norm(k.view(b, t, -1, d), attn.k_norm).transpose(1, 2), cos, sin)
            v = v.view(b, t, -1, d).transpose(1, 2)
            ck, cv = cache.k[i, :b], cache.v[i, :b]
            ck.scatter_(2, idx, k.to(ck.dtype))
            cv.scatter_(2, idx, v.to(cv.dtype))
            o = attend_reference(q.transpose(1, 2), ck[:, :, :context_len], cv[:, :, :context_len],
                                 start + t, causal=True)
            h = h + attn.o_proj(o.reshape(b, t, -1))
            x = rms_norm(h, layer.post_attention_layernorm)
            g, u = concat_project(gate_up_proj, x).chunk(2, dim=-1)
            h = h + mlp.down_proj(F.silu(g) * u)
            if i in capture:
                hidden[i] = h
        logits = self.lm_head(rms_norm(h, self.lm.norm)).float()
        return StepOutput(logits=logits, hidden=hidden)
