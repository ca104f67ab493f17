"""Faster forwards of transformers' Qwen3-VL vision tower (`fast_vision_paths`): the same
function as the library's own forwards (up to summation order), without its per-image Python
loops. The demo recipe's training steps and the GPU runtime's prefill run inside it.

Given the scene's prompt on the host (the runtime's prefill), it also reads nothing back from the
device: transformers derives the tower's positions, interpolation taps and sequence bounds from
the image grid with `.tolist()`, and checks and places the image tokens by device counts and
boolean masks (with the runtime's own copies, 24 host synchronisations a scene on the H200,
torch's sync debug mode, 2026-12-02; each a point where the engine thread waits for the GPU to
drain and then for the interpreter lock). Here the grid stays on the host, what it gives is
computed there once per grid and kept on the device, and the image tokens are counted and found
in the host's prompt."""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.nn.functional as F

from worker.model.fp8 import Fp8Linear
from worker.model.fused_ops import add_layer_norm, available, gelu_tanh_rows, vision_rope
from worker.model.inputs import to_device


def _equal_length(memo: list, cu_seqlens: torch.Tensor) -> int | None:
    """The images' common length (None if they differ), read from the device once per cu_seqlens
    tensor: every block of a forward gets the same one (and every scene of one grid, from the
    grid's memo), memo[0] keeps the last one with its answer."""
    seen = memo[0]
    if seen is None or seen[0] is not cu_seqlens:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        seen = memo[0] = (cu_seqlens, lengths[0] if len(set(lengths)) == 1 else None)
    return seen[1]


def _vision_attention_batched(self, hidden_states, cu_seqlens, position_embeddings=None, *, memo, **kwargs):
    """Qwen3VLVisionAttention.forward for equal-length images in one SDPA call (transformers'
    non-flash path loops over images, with a host sync per block; the math is the same
    block-diagonal attention)."""
    ln = _equal_length(memo, cu_seqlens)
    if ln is None:
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                                  **kwargs)
    return self.proj(_attend(self, self.qkv(hidden_states), ln, position_embeddings))


def _attend(attn, qkv: torch.Tensor, ln: int, position_embeddings) -> torch.Tensor:
    """qkv (n, 3 H D), a vision attention's qkv product over images of `ln` patches each -> its
    attention output (n, H D), the input of its output projection."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision  # heavy

    n = qkv.shape[0]
    cos, sin = position_embeddings
    if available(qkv):                  # the rotary in one pass (GPU; Triton's interpreter in tests)
        q, k = vision_rope(qkv, attn.num_heads, cos, sin)
        v = qkv.view(n, 3, attn.num_heads, -1)[:, 2]
    else:
        q, k, v = qkv.reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (x.reshape(-1, ln, attn.num_heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
    return o.transpose(1, 2).reshape(n, -1)


def _vision_block_fp8(self, hidden_states, cu_seqlens, position_embeddings=None, *, memo, **kwargs):
    """Qwen3VLVisionBlock.forward where its products multiply in fp8 x fp8 (`fp8.Fp8Linear` over a
    prompt's rows): the two norms and the GELU hand the products their inputs quantised
    (`fused_ops.add_layer_norm`, the second one adding the attention's residual too, and
    `gelu_tanh_rows`) instead of writing them for each product to quantise; only the attention's
    output is quantised by its product."""
    ln = _equal_length(memo, cu_seqlens)
    attn, mlp = self.attn, self.mlp
    if ln is None or not attn.qkv.takes_fp8(hidden_states):
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, **kwargs)
    x = hidden_states
    _, xq = add_layer_norm(x, self.norm1.weight, self.norm1.bias, self.norm1.eps, quantize=True)
    o = attn.proj(_attend(attn, attn.qkv.forward_fp8(*xq, x), ln, position_embeddings))
    h, hq = add_layer_norm(o, self.norm2.weight, self.norm2.bias, self.norm2.eps, residual=x, quantize=True)
    a = mlp.linear_fc1.forward_fp8(*hq, h)
    return h + mlp.linear_fc2.forward_fp8(*gelu_tanh_rows(a), a)


def _fp8_block(block) -> bool:
    """True for a vision block `_vision_block_fp8` runs: its four products fp8 (`Fp8Linear`), torch's
    tanh-approximate GELU between the MLP's two (what `gelu_tanh_rows` computes)."""
    act = getattr(block.mlp.act_fn, "act", None)
    return (all(isinstance(m, Fp8Linear) for m in (block.attn.qkv, block.attn.proj, block.mlp.linear_fc1,
                                                    block.mlp.linear_fc2))
            and isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"})


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


VISION_GRAPHS = 4      # image grids (frame sizes) whose tower replays as a graph: each holds its activations


def _graphed_tower(self, hidden_states, grid_thw, *, graphs, memo, **kwargs):
    """Qwen3VLVisionModel.forward as one CUDA graph per image grid (on the host) and dtype, at most
    `VISION_GRAPHS` of them (more grids run plainly). Launched op by op, a 24-image tower (27 blocks,
    ~300 kernels) left the H200 waiting for the host's launches once the frames reached the device
    earlier (torch.profiler, 2026-12-03); a replay is one launch. The graph reads the
    grid's tensors of `_from_host_grid`'s memo, kept alive here for as long as the tower lives.
    Each call returns a new output object over the graph's buffers (the caller reassigns fields)."""
    if grid_thw.device.type != "cpu" or set(kwargs) - {"return_dict"}:
        return type(self).forward(self, hidden_states, grid_thw, **kwargs)
    key = ("vision", tuple(map(tuple, grid_thw.tolist())), hidden_states.dtype, tuple(sorted(kwargs.items())))
    if not graphs.holds(key) and graphs.count("vision") >= VISION_GRAPHS:
        return type(self).forward(self, hidden_states, grid_thw, **kwargs)
    out = graphs.run(key, lambda x: type(self).forward(self, x, grid_thw, **kwargs), hidden_states)
    self.__dict__.setdefault("_graph_memo", {}).setdefault(key, list(memo.values()))
    return type(out)(**{k: list(v) if isinstance(v, list) else v for k, v in out.items()})


PRECOMPUTED = ("cu_seqlens", "max_seqlen", "position_ids", "interp_indices", "interp_weights")
GRID_MEMO_ENTRIES = 64                 # grid-derived tensors kept on the device (a few per camera rig)


def _from_host_grid(name: str, fn: Callable, memo: dict, device: torch.device) -> Callable:
    """transformers' grid function `name`, `fn` (grid_thw, *args, kwargs=None, **kw), for a grid on the host:
    computed there (no device read) once per grid and arguments, its tensors kept on `device`. A
    grid already on the device, or precomputed values in kwargs, go to `fn` as before."""

    def on_host(grid_thw, *args, kwargs=None, **kw):
        if grid_thw.device.type != "cpu" or (kwargs and any(k in kwargs for k in PRECOMPUTED)):
            return fn(grid_thw, *args, kwargs=kwargs, **kw)
        key = (name, tuple(map(tuple, grid_thw.tolist())), tuple(a if isinstance(a, (int, float, str)) else id(a)
                                                               for a in args), tuple(sorted(kw.items())))
        if key not in memo:
            if len(memo) >= GRID_MEMO_ENTRIES:
                memo.clear()
            out = fn(grid_thw, *args, **kw)
            memo[key] = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in out) \
                if isinstance(out, tuple) else out.to(device)
        return memo[key]

    return on_host


def _placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None, *,
                      host_ids: torch.Tensor):
    """Qwen3VLModel.get_placeholder_mask with the image-token count checked on the host's prompt
    (the library's check formats and tests a device count)."""
    masks = type(self).get_placeholder_mask(self, input_ids, inputs_embeds, None, video_features)
    if image_features is not None:
        n = int((host_ids == self.config.image_token_id).sum())
        if n * inputs_embeds.shape[-1] != image_features.numel():
            raise ValueError(f"Image features and image tokens do not match, tokens: {n}, "
                             f"features: {image_features.shape[0]}")
    return masks


def _deepstack_add(self, hidden_states, visual_pos_masks, visual_embeds, *, index: torch.Tensor):
    """Qwen3VLTextModel._deepstack_process by the image tokens' positions among the prompts' G x P
    tokens (from the host's prompts) instead of a boolean mask (which reads its count from the
    device): the same sums."""
    if visual_embeds.shape[0] != index.numel():
        return type(self)._deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds)
    hidden_states = hidden_states.clone()
    rows = hidden_states.view(-1, hidden_states.shape[-1])
    rows[index] = rows[index] + visual_embeds.to(rows.device, rows.dtype)
    return hidden_states


class fast_vision_paths:
    """Context: faster forwards for the vision tower's attention, patch embedding and rotary
    position ids (instance attributes and one function of transformers' Qwen3-VL module, restored on
    exit; the weights and checkpoint layout are untouched)."""

    GRID_FUNCTIONS = ("get_vision_position_ids", "get_vision_attention_seqlens",
                      "get_vision_interpolation_indices_and_weights")

    def __init__(self, model, prompt_ids: torch.Tensor | None = None, graphs=None):
        """prompt_ids (G x P,) on the host: the prompts the model is called with, flattened
        (input_ids = prompt_ids.view(G, P) on the device, image_grid_thw on the host): the host-grid paths. graphs
        (an enabled `graphs.GraphCache`, with prompt_ids): the tower replays as a CUDA graph."""
        self.vlm = model.vlm.model
        self.visual = self.vlm.visual
        self.prompt_ids = prompt_ids
        self.graphs = graphs if graphs is not None and graphs.enabled and prompt_ids is not None else None

    def __enter__(self):
        from transformers.models.qwen3_vl import modeling_qwen3_vl  # heavy

        self.module = modeling_qwen3_vl
        self.functions = {name: getattr(modeling_qwen3_vl, name) for name in self.GRID_FUNCTIONS}
        memo = self.visual.__dict__.setdefault("_grid_memo", {})
        device = self.visual.patch_embed.proj.weight.device
        for name, fn in self.functions.items():
            if name == "get_vision_position_ids":
                fn = _equal_grid_position_ids(fn)
            if self.prompt_ids is not None:             # one scene's prefill: its grid on the host
                fn = _from_host_grid(name, fn, memo, device)
            setattr(modeling_qwen3_vl, name, fn)
        embed = self.visual.patch_embed
        self.patched = [(embed, "forward", types.MethodType(_patch_embed_linear, embed))]
        lengths = self.visual.__dict__.setdefault("_length_memo", [None])
        attention = functools.partial(_vision_attention_batched, memo=lengths)
        self.patched += [(b.attn, "forward", types.MethodType(attention, b.attn)) for b in self.visual.blocks]
        block_fp8 = functools.partial(_vision_block_fp8, memo=lengths)
        self.patched += [(b, "forward", types.MethodType(block_fp8, b)) for b in self.visual.blocks if _fp8_block(b)]
        if self.graphs is not None:
            tower = functools.partial(_graphed_tower, graphs=self.graphs, memo=memo)
            self.patched.append((self.visual, "forward", types.MethodType(tower, self.visual)))
        if self.prompt_ids is not None:
            image_id = self.vlm.config.image_token_id
            index = to_device((self.prompt_ids == image_id).nonzero().flatten(), device)
            self.patched += [
                (self.vlm, "get_placeholder_mask",
                 types.MethodType(functools.partial(_placeholder_mask, host_ids=self.prompt_ids), self.vlm)),
                (self.vlm.language_model, "_deepstack_process",
                 types.MethodType(functools.partial(_deepstack_add, index=index), self.vlm.language_model))]
        self.before = [(mod, name, mod.__dict__.get(name)) for mod, name, _ in self.patched]
        for mod, name, fn in self.patched:
            setattr(mod, name, fn)
        return self

    def __exit__(self, *exc):
        for mod, name, before in reversed(self.before):    # nested: the outer context's paths stay
            if before is None:
                mod.__dict__.pop(name, None)
            else:
                setattr(mod, name, before)
        for name, fn in self.functions.items():
            setattr(self.module, name, fn)
