"""The Alpamayo 2 Super module tree, built from config with transformers' Qwen3-VL classes.

Tensor names follow the public checkpoint (docs: alpamayo2-model.md section 1.1):
  vlm.model.visual.*            Qwen3-VL vision tower and mergers
  vlm.model.language_model.*    text decoder (layers, embed_tokens, norm)
  vlm.lm_head.weight            untied LM head
  expert.expert.layers.{l}.*    expert transformer (Qwen3-VL text decoder, no embed_tokens)
  expert.expert.norm.weight
  expert.action_in_proj.encoder.trunk.{0,2,3,5,6}.*, expert.action_in_proj.norm.*
  expert.action_out_proj.{weight,bias}

The modules here only hold weights and the rebuilt (non-checkpoint) buffers; the forward math
of decode, verify and the expert lives in `decoder.py` and `expert.py`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from worker.model.config import ActionInProjConfig, AlpamayoConfig


def _text_config(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    d.setdefault("model_type", "qwen3_vl_text")
    d["dtype"] = torch.get_default_dtype()        # build in the caller's dtype, whatever config.json says
    return AutoConfig.for_model(**d)


def build_vlm_config(cfg: AlpamayoConfig):
    from transformers import AutoConfig

    d = dict(cfg.vlm_config)
    d.setdefault("model_type", "qwen3_vl")
    conf = AutoConfig.for_model(**d)
    for c in (conf, conf.text_config, conf.vision_config):
        c.dtype = torch.get_default_dtype()
    conf._attn_implementation = "sdpa"
    conf.text_config._attn_implementation = "sdpa"
    conf.vision_config._attn_implementation = "sdpa"
    return conf


class FourierEncoder(nn.Module):
    """f(s) = cat(sin(2π s f), cos(2π s f)) * sqrt(2), f = logspace(0, log10(max_freq), dim/2).

    `freqs` is rebuilt from config, never read from the checkpoint.
    """

    def __init__(self, dim: int, max_freq: float):
        super().__init__()
        self.register_buffer(
            "freqs", torch.logspace(0, math.log10(max_freq), dim // 2, dtype=torch.float32),
            persistent=False,
        )

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """s (...,) fp32 -> (..., dim) fp32."""
        x = 2 * math.pi * s.float()[..., None] * self.freqs
        return torch.cat([x.sin(), x.cos()], dim=-1) * math.sqrt(2.0)


class ActionInProj(nn.Module):
    """PerWaypointActionInProjV2: per-waypoint Fourier features of (accel, curvature, t) -> MLP.

    x (B, 64, 2) normalised action, t (B, 1, 1) -> (B, 64, hidden_expert).
    """

    def __init__(self, c: ActionInProjConfig, out_features: int):
        super().__init__()
        n = c.num_fourier_feats
        self.sinus = nn.ModuleList([FourierEncoder(n, c.max_freq) for _ in range(2)])
        self.timestep_fourier_encoder = FourierEncoder(n, c.max_freq)
        layers: list[nn.Module] = []
        width_in = 3 * n
        for _ in range(c.num_enc_layers):
            layers += [nn.Linear(width_in, c.hidden_size), nn.SiLU(), nn.RMSNorm(c.hidden_size, eps=1e-5)]
            width_in = c.hidden_size
        layers.append(nn.Linear(c.hidden_size, out_features))
        self.encoder = nn.Module()
        self.encoder.trunk = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(out_features)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        feats = torch.cat(
            [
                self.sinus[0](x[..., 0]),
                self.sinus[1](x[..., 1]),
                self.timestep_fourier_encoder(t[..., -1]).expand(-1, x.shape[1], -1),
            ],
            dim=-1,
        )
        w = self.encoder.trunk[0].weight
        with torch.autocast(device_type=w.device.type, enabled=False):
            h = self.encoder.trunk(feats.to(w.dtype))
            return self.norm(h)


class ExpertModel(nn.Module):
    """Action expert: a Qwen3-VL text decoder without embeddings plus action in/out projections."""

    def __init__(self, cfg: AlpamayoConfig):
        super().__init__()
        from transformers import AutoModel

        llm_conf = _text_config(cfg.expert_llm_config)
        llm_conf._attn_implementation = "sdpa"
        self.expert = AutoModel.from_config(llm_conf)
        del self.expert.embed_tokens
        hidden = llm_conf.hidden_size
        self.action_in_proj = ActionInProj(cfg.action_in_proj, hidden)
        self.action_out_proj = nn.Linear(hidden, 2)
        self.llm_config = llm_conf


class Alpamayo2(nn.Module):
    """Weights of the whole model: `vlm` (Qwen3VLForConditionalGeneration) and `expert`."""

    def __init__(self, cfg: AlpamayoConfig):
        super().__init__()
        from transformers import Qwen3VLForConditionalGeneration

        self.cfg = cfg
        self.vlm_config = build_vlm_config(cfg)
        self.vlm = Qwen3VLForConditionalGeneration._from_config(self.vlm_config)
        self.expert = ExpertModel(cfg)

    @property
    def language_model(self):
        return self.vlm.model.language_model

    @property
    def lm_head(self) -> nn.Linear:
        return self.vlm.lm_head

