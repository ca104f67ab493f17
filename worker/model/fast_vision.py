"""Faster forwards of transformers' Qwen3-VL vision tower (`fast_vision_paths`): the same
function as the library's own forwards (up to summation order), without its per-image Python
loops. The demo recipe's training steps and the GPU runtime's prefill run inside it."""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.nn.functional as F

from worker.model.fused_ops import available, vision_rope


def _equal_length(memo: list, cu_seqlens: torch.Tensor) -> int | None:
    """The images' common length (None if they differ), read from the device once per tower
    forward: every block gets the same cu_seqlens tensor, memo keeps the last one's answer."""
    if memo[0] is not cu_seqlens:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        memo[:] = [cu_seqlens, lengths[0] if len(set(lengths)) == 1 else None]
    return memo[1]


def _vision_attention_batched(self, hidden_states, cu_seqlens, position_embeddings=None, *, memo, **kwargs):
    """Qwen3VLVisionAttention.forward for equal-length images in one SDPA call (transformers'
    non-flash path loops over images, with a host sync per block; the math is the same
    block-diagonal attention)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision  # heavy

    ln = _equal_length(memo, cu_seqlens)
    n = hidden_states.shape[0]
    if ln is None:
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                                  **kwargs)
    qkv = self.qkv(hidden_states)
    cos, sin = position_embeddings
    if available(qkv):                  # the rotary in one pass (GPU; Triton's interpreter in tests)
        q, k = vision_rope(qkv, self.num_heads, cos, sin)
        v = qkv.view(n, 3, self.num_heads, -1)[:, 2]
    else:
        q, k, v = qkv.reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (x.reshape(-1, ln, self.num_heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
    return self.proj(o.transpose(1, 2).reshape(n, -1))


def _patch_embed_linear(self, hidden_states):
    """Qwen3VLVisionPatchEmbed.forward as one matmul (a stride = kernel Conv3d over exactly one
    patch is a dot product with the flattened kernel; CPU conv backward is slow)."""
    w = self.proj.weight
    return F.linear(hidden_states.to(w.dtype).reshape(-1, w[0].numel()), w.reshape(w.shape[0], -1), self.proj.bias)


def _equal_grid_position_ids(per_image: Callable) -> Callable:
    """transformers' vision rotary position ids (`get_vision_position_ids`) loop over the images
    in Python (about ten small kernels each: 1,632 images a GPU-recipe step made the step bound by
    the host, 0.33 s of forward). Images of one grid get the ids of the first, tiled: the same
    tensor."""

    def position_ids(grid_thw, spatial_merge_size, *args, **kwargs):
        if len(grid_thw) > 1 and isinstance(spatial_merge_size, int) and bool((grid_thw == grid_thw[:1]).all()):
            return per_image(grid_thw[:1], spatial_merge_size, *args, **kwargs).repeat(len(grid_thw), 1)
        return per_image(grid_thw, spatial_merge_size, *args, **kwargs)

    return position_ids


class fast_vision_paths:
    """Context: faster forwards for the vision tower's attention, patch embedding and rotary
    position ids (instance attributes and one function of transformers' Qwen3-VL module, restored on
    exit; the weights and checkpoint layout are untouched)."""

    def __init__(self, model):
        self.visual = model.vlm.model.visual

    def __enter__(self):
        from transformers.models.qwen3_vl import modeling_qwen3_vl  # heavy

        self.patched = [(self.visual.patch_embed, types.MethodType(_patch_embed_linear, self.visual.patch_embed))]
        attention = functools.partial(_vision_attention_batched, memo=[None, None])
        self.patched += [(b.attn, types.MethodType(attention, b.attn)) for b in self.visual.blocks]
        for mod, fn in self.patched:
            mod.forward = fn
        self.module, self.position_ids = modeling_qwen3_vl, modeling_qwen3_vl.get_vision_position_ids
        modeling_qwen3_vl.get_vision_position_ids = _equal_grid_position_ids(self.position_ids)
        return self

    def __exit__(self, *exc):
        for mod, _ in self.patched:
            mod.__dict__.pop("forward", None)
        self.module.get_vision_position_ids = self.position_ids
