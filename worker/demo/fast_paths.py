"""Exact, faster forwards of transformers' Qwen3-VL vision tower for training (`fast_training_paths`):
the same numbers as the library's own forwards, without its per-image Python loops."""

from __future__ import annotations

import types
from typing import Callable

import torch.nn.functional as F


def _vision_attention_batched(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """Qwen3VLVisionAttention.forward for equal-length images in one SDPA call (transformers'
    non-flash path loops over images; the math is the same block-diagonal attention)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision  # heavy: training only

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    n = hidden_states.shape[0]
    if not bool((lengths == lengths[0]).all()):
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                                  **kwargs)
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    ln = int(lengths[0])
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


class fast_training_paths:
    """Context: exact, faster forwards for the vision tower's attention, patch embedding and rotary
    position ids (instance attributes and one function of transformers' Qwen3-VL module, restored on
    exit; the weights and checkpoint layout are untouched)."""

    def __init__(self, model):
        self.visual = model.vlm.model.visual

    def __enter__(self):
        from transformers.models.qwen3_vl import modeling_qwen3_vl  # heavy: training only

        self.patched = [(self.visual.patch_embed, types.MethodType(_patch_embed_linear, self.visual.patch_embed))]
        self.patched += [(b.attn, types.MethodType(_vision_attention_batched, b.attn)) for b in self.visual.blocks]
        for mod, fn in self.patched:
            mod.forward = fn
        self.module, self.position_ids = modeling_qwen3_vl, modeling_qwen3_vl.get_vision_position_ids
        modeling_qwen3_vl.get_vision_position_ids = _equal_grid_position_ids(self.position_ids)
        return self

    def __exit__(self, *exc):
        for mod, _ in self.patched:
            mod.__dict__.pop("forward", None)
        self.module.get_vision_position_ids = self.position_ids
