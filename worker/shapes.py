"""Model shapes the benchmarks build: the real 32B (Qwen3-VL-32B text stack, 27-block vision
tower, 64 x 1536 expert), a mid-size and the tiny test shape; their config.json, and config-only
checkpoint directories that `ALPAMAYO_LOAD_FORMAT=dummy` serves (vLLM's --load-format dummy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.demo.layout import Dims

SHAPES = {
    # the real model: Qwen3-VL-32B text stack, 27-block vision tower, 64 x 1536 expert
    "32b": dict(hidden=5120, intermediate=25600, layers=64, heads=64, kv_heads=8, head_dim=128,
                expert_hidden=1536, expert_intermediate=6144, expert_heads=16, vision_hidden=1152,
                vision_intermediate=4304, vision_depth=27, vision_heads=16, deepstack=(8, 16, 24),
                in_proj_hidden=512, min_pixels=163840, max_pixels=196608),
    "mid": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, head_dim=64, expert_hidden=512,
                expert_intermediate=1024, expert_heads=8, vision_hidden=128, vision_intermediate=256, vision_depth=2,
                vision_heads=2),
    "tiny": dict(),
}
REAL_VOCAB = 155776


def shape_config(shape: str, layers: int | None = None) -> tuple[Any, dict]:
    """(tokenizer, config.json dict) of a model of `shape` (the 32B shape with the real vocabulary)
    with `layers` text and expert layers (default: the shape's)."""
    from worker.demo.layout import DEFAULT_CORPUS, build_tokenizer, make_config

    tok = build_tokenizer([DEFAULT_CORPUS], vocab_size=400)
    dims = Dims(**{**SHAPES[shape], **({"layers": layers} if layers is not None else {})})
    config = make_config(tok, dims, dtype="bfloat16")
    if shape == "32b":
        for c in (config["vlm_config"]["text_config"], config["expert_config"]["llm_config"]):
            c["vocab_size"] = REAL_VOCAB
            c["rope_parameters"]["mrope_section"] = [24, 20, 20]
    return tok, config


def write_config_only(shape: str, directory: str) -> Path:
    """A config-only checkpoint directory of `shape` (config, tokenizer, templates; no weights),
    which `ALPAMAYO_LOAD_FORMAT=dummy` serves with random weights (vLLM's --load-format dummy)."""
    from worker.demo.layout import write_support_files

    tok, config = shape_config(shape)
    d = Path(directory)
    write_support_files(d, tok, config)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d
