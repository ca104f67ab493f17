"""The DFlash2 draft network: projector, draft decoder layers and the candidate selector.

Projector: the hidden states of the chosen target layers at a committed position are
concatenated and fused, f = RMSNorm(fc(cat_l h_l)) (H). Draft layers: Qwen3-style blocks whose
queries come from the 8 block tokens only, while keys/values are [projected context features of
every committed position ; block tokens] (context K/V computed once per committed token and kept
in a static cache, like the target's). The block is [last committed token, MASK x 7], embedded
with the base model's embedding table; logits come from the base model's LM head.

Candidate selector (DFlash2): the parallel pass predicts each block position independently,
which yields incoherent blocks; the selector re-scores the draft's top-C candidates at each
position conditioned on the token chosen at the previous position:
    q_i   = W_q [h_i ; E(chosen_{i-1})]          W_q: selector.q_proj.weight (S, 2H)
    k_c   = W_k E(c)                             W_k: selector.k_proj.weight (S, H)
    score = draft_logit_c + q_i . k_c / sqrt(S)
    chosen_i = argmax_c score                    (chosen_0's previous token is the block anchor)
It starts as the plain argmax (W_q = 0, W_k random so gradients flow); training teaches it the
in-block dependencies (worker/dflash/train.py: cross-entropy over the top-C, teacher-forced on the
previous true token, which is the previous choice whenever acceptance can still continue).
Shapes: B rows, C candidates, S selector width, H hidden.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from worker.dflash.head import HeadConfig
from worker.model.attention import attend
from worker.model.decoder import apply_rope, rope_cos_sin
from worker.model.fp8 import quantize_linears
from worker.model.fused_ops import qk_norm_rope_write
from worker.model.layers import FusedStack, concat_project, norm_eps, project


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.q_norm = _RMSNorm(d, c.rms_norm_eps)
        self.k_norm = _RMSNorm(d, c.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


class Selector(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.selector_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.selector_dim, bias=False)
        # W_q = 0: an untrained selector is the plain argmax. W_k random (not 0): the score is
        # bilinear in the two, so with both at 0 every gradient is 0 and the selector never trains
        nn.init.zeros_(self.q_proj.weight)
        nn.init.normal_(self.k_proj.weight, std=c.hidden_size ** -0.5)

    def scores(self, h: torch.Tensor, prev_emb: torch.Tensor, cand_emb: torch.Tensor,
               cand_logits: torch.Tensor) -> torch.Tensor:
        """h (B, T, H), prev_emb (B, T, H), cand_emb (B, T, C, H), cand_logits (B, T, C) -> (B, T, C):
        `table` with the one previous token each position was given."""
        return self.table(h[:, :, None], prev_emb[:, :, None], cand_emb, cand_logits)[:, :, 0]

    def table(self, h: torch.Tensor, prev_emb: torch.Tensor, cand_emb: torch.Tensor,
              cand_logits: torch.Tensor) -> torch.Tensor:
        """`scores` for every previous token at once: h and prev_emb (B, T, C', H) (position t's
        hidden state beside each token the position before could have chosen), cand_emb (B, T, C, H),
        cand_logits (B, T, C) -> (B, T, C', C), [b, t, p, c] the score of candidate c after p."""
        q = self.q_proj(torch.cat([h, prev_emb], dim=-1))                 # (B, T, C', S)
        k = self.k_proj(cand_emb)                                          # (B, T, C, S)
        return cand_logits[:, :, None] + (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])


class DraftModel(nn.Module):
    """Weights of a DFlash2 head (embedding and LM head borrowed from the base model)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.selector = Selector(c)
        d = c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, d, 2).float() / d)),
                             persistent=False)
        self._stack: FusedStack | None = None        # GPU path, built on first use (fuses projections)

    # ---------------------------------------------------------------- pieces
    def project(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target hidden states {layer: (B, T, H)} -> context features (B, T, H)."""
        x = torch.cat([hidden[i] for i in self.config.target_layer_ids], dim=-1)
        return self.hidden_norm(self.fc(x.to(self.norm.weight.dtype)))

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer K/V of context features. feats (B, T, H), positions (B, T) rope positions."""
        b, t, _ = feats.shape
        d = self.config.head_dim
        cos, sin = rope_cos_sin(positions, self.inv_freq, feats.dtype)
        out = []
        for layer in self.layers:
            a = layer.self_attn
            k = a.k_norm(a.k_proj(feats).view(b, t, -1, d)).transpose(1, 2)
            v = a.v_proj(feats).view(b, t, -1, d).transpose(1, 2)
            out.append((apply_rope(k, cos, sin), v))
        return out

    def block_hidden(self, block_emb: torch.Tensor, positions: torch.Tensor,
                     ctx: list[tuple[torch.Tensor, torch.Tensor]], ctx_visible: torch.Tensor) -> torch.Tensor:
        """One parallel pass over the block.

        block_emb (B, T, H); positions (B, T); ctx[l] = (K, V) each (B, Hkv, S, D);
        ctx_visible (B, S) bool. The block attends to visible context and to itself, both ways.
        Returns the final-normed hidden states (B, T, H).
        """
        b, t, _ = block_emb.shape
        d = self.config.head_dim
        cos, sin = rope_cos_sin(positions, self.inv_freq, block_emb.dtype)
        mask = torch.cat([ctx_visible, torch.ones(b, t, dtype=torch.bool, device=block_emb.device)], dim=1)
        mask = mask[:, None, None, :].expand(b, 1, t, mask.shape[1])
        h = block_emb
        for layer, (ck, cv) in zip(self.layers, ctx):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(a.q_norm(a.q_proj(x).view(b, t, -1, d)).transpose(1, 2), cos, sin)
            k = apply_rope(a.k_norm(a.k_proj(x).view(b, t, -1, d)).transpose(1, 2), cos, sin)
            v = a.v_proj(x).view(b, t, -1, d).transpose(1, 2)
            o = attend(q, torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2), mask)
            h = h + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def block_hidden_fused(self, block_emb: torch.Tensor, start: torch.Tensor, rope_delta: torch.Tensor,
                           caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`block_hidden` on the GPU path: the block's K/V are written into each draft layer's
        context cache (>= B, Hkv, L, D) at columns start[b]..start[b]+T-1 (free columns: the
        target's verify writes the committed context there afterwards) and the block attends
        columns [0, start[b] + T), non-causally. block_emb (B, T, H); start (B,) -> (B, T, H)."""
        if self._stack is None:
            self._stack = FusedStack(self.layers, self.config.head_dim)
        h, _ = self._stack.run(block_emb, caches, start, rope_delta, self.inv_freq, 1.0, causal=False)
        return self._stack.final_norm(h, self.norm)

    def write_context_fused(self, hidden: dict[int, torch.Tensor], start: torch.Tensor, rope_delta: torch.Tensor,
                            caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`project` and `context_kv` on the GPU path, the K/V written into each draft layer's context
        cache (>= B, Hkv, L, D) at columns start[b]..start[b]+T-1 (rotary position + rope_delta[b]):
        the hidden norm one kernel, and per layer the fused q/k/v product and one kernel that norms,
        rotates and writes K and V (`qk_norm_rope_write`; its q, of no use to the context, costs the
        q product's ~5 us). The eager norms, rotary and scatters were ~35 small kernels of every
        verify step's ~0.45 ms tail on the H200 (torch.profiler, 2026-12-03). hidden {layer: (B, T, H)}."""
        if self._stack is None:
            self._stack = FusedStack(self.layers, self.config.head_dim)
        x = torch.cat([hidden[i] for i in self.config.target_layer_ids], dim=-1).to(self.norm.weight.dtype)
        feats = FusedStack.final_norm(project(self.fc, x), self.hidden_norm)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            qkv_proj, _, (hq, hkv) = self._stack.parts[i]
            a = layer.self_attn
            qk_norm_rope_write(concat_project(qkv_proj, feats), hq, hkv, a.q_norm.weight, a.k_norm.weight,
                               norm_eps(a.k_norm), k_cache, v_cache, start, rope_delta, self.inv_freq)

    def quantize_fp8(self) -> None:
        """fc's and the layers' products in e4m3 with per-channel scales (`fp8.Fp8Linear`), as the
        fp8 profiles hold the target's; the selector stays in the compute dtype."""
        quantize_linears(self, keep=lambda name, shape: not name.startswith("selector."))
        self._stack = None                           # its fused products were the bf16 ones

    # ---------------------------------------------------------------- io
    @classmethod
    def from_dir(cls, path: str | Path, config: HeadConfig, device, dtype) -> "DraftModel":
        from safetensors.torch import load_file

        with torch.device(device):
            model = cls(config)
        state = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(str(shard), device=str(device)))
        model.load_state_dict(state, strict=True)
        return model.to(dtype).eval().requires_grad_(False)

    def save(self, path: str | Path) -> None:
        import json

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.config.to_json(), indent=2))


MASK_TOKEN = "<|route_pad|>"   # the packaged head's mask token: a base-vocabulary token no prompt uses


def write_random_head(checkpoint: str | Path, out_dir: str | Path, seed: int = 1,
                      note: str = "untrained head (plumbing and cost checks only)") -> Path:
    """An untrained DFlash2 head matching `checkpoint`, in the head format, with its metadata."""
    from worker.dflash.head import head_config_for, write_metadata
    from worker.model.config import AlpamayoConfig
    from worker.model.tokenizer import load_tokenizer

    cfg = AlpamayoConfig.from_dir(checkpoint)
    tok, _ = load_tokenizer(checkpoint, cfg)
    torch.manual_seed(seed)
    out = Path(out_dir)
    DraftModel(head_config_for(cfg, mask_token_id=tok.token_to_id(MASK_TOKEN))).save(out)
    write_metadata(out, cfg, {"trained": False, "note": note})
    return out
