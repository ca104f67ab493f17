"""fp8 profiles: e4m3 weights with one scale per output channel.

On GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper) the product runs as a
real fp8 matrix multiply (`torch._scaled_mm`, activations quantised per token on the fly);
elsewhere the weight is dequantised to the activation dtype (same numbers, no speed-up), so CPU
tests exercise the same quantised weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0


def _has_fp8_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) \
        and hasattr(torch, "_scaled_mm")


class Fp8Linear(nn.Module):
    """y = x W^T + b with W (out, in) stored as e4m3 and scale (out,) fp32: W ≈ W8 * scale[:, None]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
        self.register_buffer("weight", (w / scale[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.fast = _has_fp8_mm(w.device) and self.in_features % 16 == 0 and self.out_features % 16 == 0

    @classmethod
    def from_parts(cls, weight: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> "Fp8Linear":
        """An Fp8Linear over existing e4m3 weights (out, in) and scales (out,)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.register_buffer("weight", weight)
        m.register_buffer("weight_scale", scale)
        m.bias = None
        m.out_features, m.in_features = weight.shape
        m.compute_dtype = compute_dtype
        m.fast = _has_fp8_mm(weight.device) and m.in_features % 16 == 0 and m.out_features % 16 == 0
        return m

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fast:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
        xq = (x2.float() / x_scale).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                             bias=self.bias, out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` with an Fp8Linear. Returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Fp8Linear(child))
            n += 1
        else:
            n += quantize_linears(child)
    return n


def quantize_model_fp8(model) -> int:
    """fp8 for the decoder stacks (VLM text layers and expert layers); the vision tower, the
    embeddings, the LM head and the action projections stay in the compute dtype."""
    n = quantize_linears(model.language_model.layers)
    n += quantize_linears(model.expert.expert.layers)
    return n
