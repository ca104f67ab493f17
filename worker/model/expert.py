"""The flow-matching action expert over the VLM's static KV cache (alpamayo2-model.md section 4).

Expert layer l appends its 64 action tokens' K/V to VLM cache layer l and attends over
[VLM K/V up to each row's terminal position ; 64 action K/V], non-causally. Action tokens take
the text positions that would follow `<|traj_future_start|>`: offset + arange(64) + rope_delta.
Euler integration from noise (t=0) to data (t=1); output is a velocity in normalised
(acceleration, curvature) space.

Shapes: R rows (all samples of the batch), L cache positions, W = 64 waypoints.
"""

from __future__ import annotations

import torch

from worker.model.attention import attend
from worker.model.decoder import StaticKVCache, qkv, rope_cos_sin
from worker.model.fp8 import Fp8Linear
from worker.model.fused_ops import available as fused_available
from worker.model.graphs import GraphCache
from worker.model.layers import FusedStack
from worker.model.modules import ExpertModel
from worker.model.sampling import normal


# The expert's fp8 q/k/v (4,096 x 1,536) and gate/up (12,288 x 1,536) take `_scaled_mm` above this
# many rows, not above fp8.WEIGHT_ONLY_MAX_ROWS: their short K leaves the weight-streaming tiles too
# few steps to hide their latency. H200, 2026-12-03, batch 1 (64 rows), alone (`.run/ab21.py`):
# gate/up 16.8 us weight-only (16.3 with its best tile), 10.8 with `_scaled_mm` and the rows'
# quantisation; q/k/v 9.2 against 9.7 alone, but whole scenes (`.run/ab21b.py`, 8 each, medians)
# ran diffusion 63.1 ms weight-only, 51.9 with gate/up routed, 48.7 with both (one scene 630.7 /
# 620.8 / 615.7 ms): the norm hands them quantised rows. o and down stay weight-only (8.2 against
# 10.7, 11.2 against 20.4).
WEIGHT_ONLY_ROWS = 32


class ActionExpert:
    def __init__(self, expert: ExpertModel, num_waypoints: int = 64):
        self.m = expert
        conf = expert.llm_config
        self.head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        self.inv_freq = expert.expert.rotary_emb.inv_freq
        self.rope_scaling = float(getattr(expert.expert.rotary_emb, "attention_scaling", 1.0))
        self.num_waypoints = num_waypoints
        self.stack = FusedStack(expert.expert.layers, self.head_dim)
        self._route_short_products()

    def fuse(self) -> None:
        """Fuse the layers' products again after swapping weights (e.g. fp8 quantisation)."""
        self.stack.fuse()
        self._route_short_products()

    def _route_short_products(self) -> None:
        """fp8 q/k/v and gate/up products multiply fp8 x fp8 above WEIGHT_ONLY_ROWS rows."""
        for qkv_proj, gate_up, _ in self.stack.parts:
            for proj in (qkv_proj, gate_up):
                for m in proj if isinstance(proj, tuple) else (proj,):
                    if isinstance(m, Fp8Linear):
                        m.weight_only_rows = WEIGHT_ONLY_ROWS

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cache: StaticKVCache, offset: torch.Tensor,
                 rope_delta: torch.Tensor, context_len: int) -> torch.Tensor:
        """x (R, W, 2) noisy action, t (R, 1, 1) in [0, 1] -> velocity (R, W, 2) fp32.

        offset (R,) long: cache columns [0, offset) are visible (prompt + reasoning up to and
        including `<|traj_future_start|>`); context_len >= max(offset) (host int). On the GPU path
        the cache needs W free columns after each row's offset.
        """
        r, w = x.shape[0], self.num_waypoints
        dev = x.device
        dtype = cache.k.dtype
        h = self.m.action_in_proj(x, t).to(dtype)                         # (R, W, He)
        if fused_available(h):
            # action K/V go into cache columns [offset, offset + W) (past every row's reasoning),
            # so each row attends one contiguous range [0, offset + W)
            caches = [(cache.k[i], cache.v[i]) for i in range(len(self.stack.layers))]
            h, _ = self.stack.run(h, caches, offset, rope_delta, self.inv_freq, self.rope_scaling, causal=False)
            return self.m.action_out_proj(self.stack.final_norm(h, self.m.expert.norm)).float()
        positions = offset[:, None] + torch.arange(w, device=dev) + rope_delta[:, None]
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scaling)
        cols = torch.arange(context_len, device=dev)
        visible = cols[None, :] < offset[:, None]                          # (R, L)
        mask = torch.cat([visible, torch.ones(r, w, dtype=torch.bool, device=dev)], dim=1)
        mask = mask[:, None, None, :].expand(r, 1, w, context_len + w)
        for i, layer in enumerate(self.m.expert.layers):
            attn = layer.self_attn
            q, k, v = qkv(attn, layer.input_layernorm(h), cos, sin, self.head_dim)
            keys = torch.cat([cache.k[i, :r, :, :context_len], k.to(dtype)], dim=2)
            vals = torch.cat([cache.v[i, :r, :, :context_len], v.to(dtype)], dim=2)
            o = attend(q, keys, vals, mask)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(r, w, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.m.expert.norm(h)
        return self.m.action_out_proj(h).float()

    def integrate(self, x: torch.Tensor, cache: StaticKVCache, offset: torch.Tensor, rope_delta: torch.Tensor,
                  context_len: int, steps: int) -> torch.Tensor:
        """Euler steps from noise x (R, W, 2) at t=0 to the action at t=1."""
        r = x.shape[0]
        ts = torch.linspace(0, 1, steps + 1).tolist()
        for i in range(steps):
            t = torch.full((r, 1, 1), ts[i], device=x.device)
            x = x + (ts[i + 1] - ts[i]) * self.velocity(x, t, cache, offset, rope_delta, context_len)
        return x

    @torch.inference_mode()
    def sample(self, cache: StaticKVCache, offset: torch.Tensor, rope_delta: torch.Tensor,
               keys: torch.Tensor, steps: int = 10, graphs: GraphCache | None = None) -> torch.Tensor:
        """Flow matching from seeded noise; keys (R,) int64 per-sample noise keys.

        With `graphs` (over the persistent cache) the whole loop replays as one CUDA graph per
        rows bucket. Returns the action (R, W, 2) fp32.
        """
        x = normal(keys, (self.num_waypoints, 2)).to(offset.device)
        if graphs is not None:                      # persistent cache: attend over its capacity
            return graphs.run(("expert", x.shape[0], steps),
                              lambda x_, o, d: self.integrate(x_, cache, o, d, cache.capacity, steps),
                              x, offset, rope_delta).clone()
        return self.integrate(x, cache, offset, rope_delta, int(offset.max()), steps)
