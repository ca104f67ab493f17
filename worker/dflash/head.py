"""The DFlash2 head directory: format, metadata and the startup checks.

A head directory holds
  config.json                     architectures ["DFlash2DraftModel"], block_size (= spec tokens + 1),
                                  draft transformer dims, dflash_config {projector_type "dflash2",
                                  target_layer_ids, mask_token_id, num_candidates, selector_dim}
  *.safetensors                   fc, hidden_norm, layers.*, norm, selector.* (no embedding, no LM
                                  head: both are the base model's)
  alpamayo_dflash_metadata.json   base_model_config_sha256 (canonical sha256 of the base
                                  checkpoint's config.json, see worker.model.config) + provenance

Every check runs before any weight is loaded to the GPU; every message names
NIM_ALPAMAYO_SPECULATIVE_MODEL and the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.model.checkpoint import read_safetensors_header
from worker.model.config import AlpamayoConfig, CheckpointError

ARCHITECTURE = "DFlash2DraftModel"
PROJECTOR_TYPE = "dflash2"
METADATA_FILE = "alpamayo_dflash_metadata.json"
NUM_SPEC_TOKENS = 7
ENV = "NIM_ALPAMAYO_SPECULATIVE_MODEL"


class HeadError(CheckpointError):
    """A DFlash2 head that cannot be served."""


@dataclass(frozen=True)
class HeadConfig:
    block_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_candidates: int
    selector_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    vocab_size: int = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_spec_tokens(self) -> int:
        return self.block_size - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURE], "model_type": "dflash2_draft",
            "block_size": self.block_size, "num_spec_tokens": self.num_spec_tokens,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
            "dflash_config": {"projector_type": PROJECTOR_TYPE, "target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id, "num_candidates": self.num_candidates,
                              "selector_dim": self.selector_dim},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], label: str) -> "HeadConfig":
        try:
            dc = d["dflash_config"]
            return cls(
                block_size=int(d["block_size"]), hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d["num_key_value_heads"]), head_dim=int(d["head_dim"]),
                target_layer_ids=tuple(int(i) for i in dc["target_layer_ids"]),
                mask_token_id=int(dc["mask_token_id"]), num_candidates=int(dc["num_candidates"]),
                selector_dim=int(dc["selector_dim"]), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 5e6)), vocab_size=int(d.get("vocab_size", 0)), raw=d)
        except (KeyError, TypeError, ValueError) as e:
            raise HeadError(f"{label} has an incomplete config.json: {type(e).__name__} {e}") from None


def expected_tensors(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head of config `c`, with its shape."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
        "selector.q_proj.weight": (c.selector_dim, 2 * h), "selector.k_proj.weight": (c.selector_dim, h),
    }
    for n in range(c.num_hidden_layers):
        p = f"layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": (c.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return out


def check_head(path: str | Path, base: AlpamayoConfig, num_spec_tokens: int = NUM_SPEC_TOKENS) -> HeadConfig:
    """Validate a head directory against the base model config. Raises HeadError with one line."""
    path = Path(path)
    label = f"{ENV}={path}"
    if not path.exists():
        raise HeadError(f"{label} does not exist")
    if not path.is_dir():
        raise HeadError(f"{label} is not a directory")
    if not any(path.iterdir()):
        raise HeadError(f"{label} is empty: copy the complete exported head directory")
    shards = sorted(path.glob("*.safetensors"))
    tensors = {}
    for shard in shards:   # each file against its own header, before anything else
        try:
            for name, info in read_safetensors_header(shard, label).items():
                tensors[name] = info
        except HeadError:
            raise
        except CheckpointError as e:
            raise HeadError(str(e)) from None
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HeadError(f"{label} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadError(f"{label} has an unreadable config.json ({e})") from None
    arch = raw.get("architectures")
    if arch != [ARCHITECTURE]:
        raise HeadError(f"{label} has architectures {arch}, expected [\"{ARCHITECTURE}\"]")
    ptype = (raw.get("dflash_config") or {}).get("projector_type")
    if ptype != PROJECTOR_TYPE:
        raise HeadError(f"{label} has dflash_config.projector_type {ptype!r}, expected \"{PROJECTOR_TYPE}\"")
    c = HeadConfig.from_json(raw, label)
    if c.block_size != num_spec_tokens + 1:
        raise HeadError(f"{label} has block_size {c.block_size}, but {num_spec_tokens} speculative tokens "
                        f"need block_size {num_spec_tokens + 1}")
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise HeadError(f"{label} has no {METADATA_FILE}: export the head with its metadata")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadError(f"{label} has an unreadable {METADATA_FILE} ({e})") from None
    want = meta.get("base_model_config_sha256") if isinstance(meta, dict) else None
    if not want:
        raise HeadError(f"{label} has no base_model_config_sha256 in {METADATA_FILE}")
    if want != base.sha256:
        raise HeadError(f"{label} was trained for base config sha256 {want[:16]}..., but the base model's "
                        f"config.json has sha256 {base.sha256[:16]}...")
    if not shards:
        raise HeadError(f"{label} has no *.safetensors weights")
    text = base.text
    if c.hidden_size != int(text["hidden_size"]):
        raise HeadError(f"{label} has hidden_size {c.hidden_size}, the base model {text['hidden_size']}")
    layers = int(text["num_hidden_layers"])
    bad = [i for i in c.target_layer_ids if not 0 <= i < layers]
    if bad or not c.target_layer_ids:
        raise HeadError(f"{label} has target_layer_ids {list(c.target_layer_ids)}, base has layers 0..{layers - 1}")
    vocab = int(text["vocab_size"])
    if not 0 <= c.mask_token_id < vocab:
        raise HeadError(f"{label} has mask_token_id {c.mask_token_id} outside the base vocabulary ({vocab})")
    if c.vocab_size and c.vocab_size != vocab:
        raise HeadError(f"{label} has vocab_size {c.vocab_size}, the base model {vocab}")
    want_shapes = expected_tensors(c)
    missing = sorted(set(want_shapes) - set(tensors))
    if missing:
        what = "the candidate selector" if any(m.startswith("selector.") for m in missing) else "tensors"
        raise HeadError(f"{label} lacks {what}: {', '.join(missing[:3])}")
    for name, shape in want_shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise HeadError(f"{label} has {name} of shape {list(tensors[name].shape)}, "
                            f"the base model needs {list(shape)}")
    extra = sorted(set(tensors) - set(want_shapes))
    if extra:
        raise HeadError(f"{label} has unexpected tensors {', '.join(extra[:3])}")
    return c


def write_metadata(path: str | Path, base: AlpamayoConfig, provenance: dict[str, Any]) -> None:
    meta = {"format_version": 1, "base_model_config_sha256": base.sha256,
            "canonical_form": "json.dumps(config, sort_keys=True, separators=(',', ':'), ensure_ascii=False)",
            **provenance}
    (Path(path) / METADATA_FILE).write_text(json.dumps(meta, indent=2))


def head_config_for(base: AlpamayoConfig, mask_token_id: int, num_layers: int = 1,
                    target_layer_ids: tuple[int, ...] | None = None, num_candidates: int = 16,
                    selector_dim: int = 32) -> HeadConfig:
    """A head config matching `base`: the draft layers have the target's width and head layout.

    Default target layers follow the public DFlash recipe: up to 5 layers spread from layer 1 to
    L-3 (all layers for very shallow bases)."""
    t = base.text
    n = int(t["num_hidden_layers"])
    if target_layer_ids is None:
        if n >= 5:
            span = n - 4
            k = min(5, span + 1)
            target_layer_ids = tuple(sorted({1 + round(i * span / max(k - 1, 1)) for i in range(k)}))
        else:
            target_layer_ids = tuple(range(n))
    rope = t.get("rope_parameters") or {}
    return HeadConfig(
        block_size=NUM_SPEC_TOKENS + 1, hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]), num_hidden_layers=num_layers,
        num_attention_heads=int(t["num_attention_heads"]), num_key_value_heads=int(t["num_key_value_heads"]),
        head_dim=int(t["head_dim"]), target_layer_ids=tuple(target_layer_ids), mask_token_id=int(mask_token_id),
        num_candidates=num_candidates, selector_dim=selector_dim, rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 5e6))), vocab_size=int(t["vocab_size"]))
