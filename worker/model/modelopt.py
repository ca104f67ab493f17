"""Pre-quantised ModelOpt FP8 checkpoints (the NIM's fp8 profiles serve them).

A ModelOpt FP8 export keeps the tensor names of the bf16 checkpoint; each quantised linear layer
`X` holds `X.weight` as float8_e4m3fn, `X.weight_scale` (one scale per tensor or per output
channel: W ~ W8 * scale) and usually `X.input_scale` (the calibrated activation scale). The
export says so in `hf_quant_config.json` ({"producer": {"name": "modelopt"}, "quantization":
{"quant_algo": "FP8"}}) or in config.json's `quantization_config` ({"quant_method": "modelopt",
"quant_algo": "FP8"}). Such layers load straight into `Fp8Linear` modules (no bf16 copy);
`input_scale` is kept on the module (activations are quantised per token on the fly).
Quantised layers are accepted where the fp8 profiles quantise (`is_fp8_weight`): the decoder
layers of the VLM's text stack and of the expert, the vision tower's blocks and mergers; a
quantised layer's bias (the vision tower's) stays in the compute dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.config import AlpamayoConfig, CheckpointError

QUANT_CONFIG_FILE = "hf_quant_config.json"
FP8_DTYPE = "F8_E4M3"
FP8_STACKS = ("vlm.model.language_model.layers.", "expert.expert.layers.", "vlm.model.visual.blocks.",
              "vlm.model.visual.merger.", "vlm.model.visual.deepstack_merger_list.")
"""Where the fp8 profiles hold linear weights in e4m3: the decoder layers of the text stack and of
the expert, and the vision tower's blocks and mergers (about 17,600 patch rows a 24-image scene:
products worth fp8's rate); not the patch embedding, the position table, the embeddings, the LM
head or the action projections."""


def is_fp8_weight(name: str, shape) -> bool:
    """Whether the fp8 profiles hold the state-dict tensor `name` of `shape` in e4m3: the weight
    (2-D) of a linear layer under FP8_STACKS."""
    return name.startswith(FP8_STACKS) and name.endswith(".weight") and len(shape) == 2


@dataclass(frozen=True)
class Fp8Layer:
    """One quantised linear layer of the checkpoint: its module name and (out, in) shape."""

    module: str
    out_features: int
    in_features: int
    has_input_scale: bool
    has_bias: bool = False


def declared_quant_algo(path: Path, cfg: AlpamayoConfig) -> str | None:
    """The quantisation the checkpoint declares (hf_quant_config.json, else config.json's
    quantization_config): "FP8" or None; anything else is refused in one line."""
    label = f"checkpoint {path}"
    f = path / QUANT_CONFIG_FILE
    algo = None
    if f.is_file():
        try:
            d = json.loads(f.read_text())
            algo = d["quantization"]["quant_algo"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{label}: {QUANT_CONFIG_FILE} has no readable quantization.quant_algo") from None
        where = f"{QUANT_CONFIG_FILE} quantization.quant_algo"
    else:
        q = cfg.raw.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method") if isinstance(q, dict) else q
        if method != "modelopt":
            raise CheckpointError(f"{label}: config.json quantization_config.quant_method={method!r} is not served: "
                                  "use a bf16 checkpoint or a ModelOpt FP8 export (quant_method modelopt)")
        algo = q.get("quant_algo")
        where = "config.json quantization_config.quant_algo"
    if algo != "FP8":
        raise CheckpointError(f"{label}: {where}={algo!r} is not served: use a bf16 checkpoint or a ModelOpt "
                              "FP8 export (quant_algo FP8)")
    return algo


def fp8_layers(path: Path, cfg: AlpamayoConfig, tensors: dict, want: dict[str, tuple[int, ...]]) -> dict[str, Fp8Layer]:
    """The checkpoint's quantised layers, checked against the model's shapes `want` (state-dict
    name -> shape). {} for a bf16 checkpoint. Raises CheckpointError (one line) on a declared
    quantisation without fp8 weights or the reverse, a missing or misshapen scale, or fp8 weights
    outside the decoder layers."""
    label = f"checkpoint {path}"
    algo = declared_quant_algo(path, cfg)
    weights = sorted(n for n, t in tensors.items() if t.dtype == FP8_DTYPE)
    if not weights:
        if algo:
            raise CheckpointError(f"{label} declares ModelOpt {algo} but holds no float8_e4m3fn weight: "
                                  f"remove the declaration or re-export the checkpoint")
        return {}
    if not algo:
        raise CheckpointError(f"{label} holds float8_e4m3fn tensors ({weights[0]}) but neither {QUANT_CONFIG_FILE} nor "
                              "config.json quantization_config declares ModelOpt FP8: add the export's "
                              f"{QUANT_CONFIG_FILE}")
    out: dict[str, Fp8Layer] = {}
    for name in weights:
        module = name.removesuffix(".weight")
        if name not in want or not is_fp8_weight(name, want[name]):
            raise CheckpointError(f"{label}: {name} is float8_e4m3fn, but only the linear weights under "
                                  f"{', '.join(s + '*' for s in FP8_STACKS)} are served in fp8")
        n_out, n_in = want[name]
        if tensors[name].shape != (n_out, n_in):
            raise CheckpointError(f"{label}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {[n_out, n_in]}")
        scale = tensors.get(module + ".weight_scale")
        if scale is None:
            raise CheckpointError(f"{label}: {name} is float8_e4m3fn but {module}.weight_scale is missing: "
                                  "re-export the checkpoint with its scales")
        if scale.shape not in ((), (1,), (n_out,), (n_out, 1)):
            raise CheckpointError(f"{label}: tensor {module}.weight_scale has shape {list(scale.shape)}: expected "
                                  f"[] or [1] (per tensor) or [{n_out}] or [{n_out}, 1] (per output channel)")
        act = tensors.get(module + ".input_scale")
        if act is not None and act.shape not in ((), (1,)):
            raise CheckpointError(f"{label}: tensor {module}.input_scale has shape {list(act.shape)}: expected [] or [1]")
        out[module] = Fp8Layer(module, n_out, n_in, act is not None, module + ".bias" in want)
    strays = sorted(n for n in tensors if n.endswith((".weight_scale", ".input_scale"))
                    and n.rsplit(".", 1)[0] not in out)
    if strays:
        raise CheckpointError(f"{label}: {strays[0]} scales a weight that is not float8_e4m3fn "
                              f"({len(strays)} such tensor(s)): re-export the checkpoint")
    return out


def quantised_names(layers: dict[str, Fp8Layer]) -> set[str]:
    """State-dict names the quantised layers add to the model's (their scales)."""
    return {f"{m}.{s}" for m, layer in layers.items()
            for s in (("weight_scale", "input_scale") if layer.has_input_scale else ("weight_scale",))}


def fp8_shell(layer: Fp8Layer, device: torch.device, compute_dtype: torch.dtype):
    """An Fp8Linear with uninitialised e4m3 weight, per-channel scale (and bias) on `device`,
    filled by the shard copy (a per-tensor scale is broadcast over the output channels there)."""
    from worker.model.fp8 import Fp8Linear

    m = Fp8Linear.from_parts(torch.empty(layer.out_features, layer.in_features, dtype=torch.float8_e4m3fn,
                                         device=device),
                             torch.empty(layer.out_features, dtype=torch.float32, device=device), compute_dtype)
    if layer.has_input_scale:
        m.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=device))
    if layer.has_bias:
        m.bias = torch.nn.Parameter(torch.empty(layer.out_features, dtype=compute_dtype, device=device),
                                    requires_grad=False)
    return m
