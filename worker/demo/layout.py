"""Small checkpoints of the real Alpamayo 2 layout: tokenizer, config.json and files.

Used by the embedded demo checkpoint build (worker/demo/build.py) and by tests that need tiny
random checkpoints. Everything written here is read back by the same loader real checkpoints use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from worker.model.tokenizer import QWEN_TOKENS, extend_tokenizer

DEFAULT_CORPUS = (
    "The traffic light ahead is red, so the ego vehicle must stop before the stop line. "
    "The lead vehicle is 18 meters ahead and slower, so keep a safe gap. "
    "Longitudinal: Decelerate. Lateral: Go Straight. Lane: Lane Keep. "
    "Front left camera: frame 0 frame 1 frame 2 frame 3 Front camera: Front right camera: "
    "Rear left camera: Rear camera: Rear right camera: Front telephoto camera: "
    "system user assistant You are a driving assistant that generates safe and accurate actions. "
    "output the chain-of-thought reasoning of the driving process, then output the future trajectory. "
    '{"critical_components_analysis": "x", "bbox_2d": [1, 2, 3, 4], "label": "lead vehicle"} 0123456789'
)

# The Qwen3-VL chat layout as a chat template (messages of text and image items; an image is one
# <|image_pad|> between vision markers, expanded by the prompt builder to the image's token count).
CHAT_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for item in message.content %}
            {%- if item.type == 'image' or 'image' in item %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1000):
    """A byte-level BPE tokenizer trained on `corpus`, with the Qwen special tokens first and the
    Alpamayo trajectory-bin and special tokens appended in the release's order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    extend_tokenizer(tok)
    return tok


@dataclass(frozen=True)
class Dims:
    """Dimensions of a small model of the real layout."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    expert_hidden: int = 48
    expert_intermediate: int = 96
    expert_heads: int = 4
    vision_hidden: int = 32
    vision_intermediate: int = 64
    vision_depth: int = 2
    vision_heads: int = 2
    deepstack: tuple[int, ...] = (0,)
    in_proj_hidden: int = 32
    min_pixels: int = 64 * 64
    max_pixels: int = 64 * 64


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2
    h = w = (half * 5 // 16) or 1     # release: 128 -> [24, 20, 20]
    return [half - h - w, h, w]


def make_config(tok, dims: Dims = Dims(), dtype: str = "float32", action_space: dict | None = None) -> dict:
    """config.json of the Alpamayo2Super wrapper for a model of `dims` over tokenizer `tok`."""
    n = tok.get_vocab_size()
    vocab = -(-n // 128) * 128
    t = tok.token_to_id
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": _mrope_section(dims.head_dim),
            "mrope_interleaved": True}

    def text(hidden, inter, heads):
        return {"model_type": "qwen3_vl_text", "vocab_size": vocab, "hidden_size": hidden,
                "intermediate_size": inter, "num_hidden_layers": dims.layers, "num_attention_heads": heads,
                "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim, "hidden_act": "silu",
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_parameters": dict(rope),
                "attention_bias": False, "tie_word_embeddings": False, "dtype": dtype}

    from worker.model.action_space import UnicycleActionSpaceConfig

    space = UnicycleActionSpaceConfig().to_dict()
    space.update(action_space or {})
    return {
        "architectures": ["Alpamayo2Super"],
        "model_type": "alpamayo2_super",
        "dtype": dtype,
        "vlm_class": "Qwen3VLForConditionalGeneration",
        "vlm_config": {
            "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
            "image_token_id": t("<|image_pad|>"), "video_token_id": t("<|image_pad|>"),
            "vision_start_token_id": t("<|vision_start|>"), "vision_end_token_id": t("<|vision_end|>"),
            "tie_word_embeddings": False,
            "text_config": text(dims.hidden, dims.intermediate, dims.heads),
            "vision_config": {
                "model_type": "qwen3_vl_vision", "depth": dims.vision_depth, "hidden_size": dims.vision_hidden,
                "intermediate_size": dims.vision_intermediate, "num_heads": dims.vision_heads, "in_channels": 3,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "out_hidden_size": dims.hidden, "num_position_embeddings": 64,
                "deepstack_visual_indexes": list(dims.deepstack), "hidden_act": "gelu_pytorch_tanh"},
        },
        "expert_config": {
            "model_type": "alpamayo2_super_expert",
            "llm_config": text(dims.expert_hidden, dims.expert_intermediate, dims.expert_heads),
            "expert_update_cfg": {"hidden_size": dims.expert_hidden, "intermediate_size": dims.expert_intermediate,
                                  "num_attention_heads": dims.expert_heads, "head_dim": dims.head_dim},
            "action_space_cfg": space,
            "diffusion_cfg": {"int_method": "euler", "num_inference_steps": 10, "use_classifier_free_guidance": False},
            "action_in_proj_cfg": {"num_fourier_feats": 20, "max_freq": 100, "num_enc_layers": 2,
                                   "hidden_size": dims.in_proj_hidden},
            "expert_non_causal_attention": True,
        },
        "hist_traj_tokenizer_cfg": {"pad_origin_at_beginning": False, "num_bins": 1000},
        "future_traj_tokenizer_cfg": {"num_bins": 3000, "dims_min": [-10, -10], "dims_max": [10, 10]},
        "history_vocab_size": 1000, "future_vocab_size": 3000,
        "tokens_per_history_traj": 45, "tokens_per_future_traj": 128,
        "traj_ids": {"history_id0": t("<i0>"), "future_id0": t("<i1000>"),
                     "history_start": t("<|traj_history_start|>"), "history_end": t("<|traj_history_end|>"),
                     "history_pad": t("<|traj_history|>"), "future_start": t("<|traj_future_start|>"),
                     "future_end": t("<|traj_future_end|>"), "future_pad": t("<|traj_future|>")},
        "min_pixels": dims.min_pixels, "max_pixels": dims.max_pixels,
        "include_camera_ids": True, "token_layout": "camera_ts", "frame_label": "frame_num",
        "padding_side": "left",
    }


def write_support_files(directory: str | Path, tok, config: dict) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json
    (weights are saved apart). The tokenizer class is transformers' generic fast tokenizer: the
    demo's byte-level BPE is not Qwen's (whose class re-splits text with Qwen's own pattern)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 32768}, indent=1))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": config["min_pixels"], "longest_edge": config["max_pixels"]}}, indent=1))


def write_random_checkpoint(directory: str | Path, dims: Dims = Dims(), seed: int = 0, corpus=None,
                            max_shard_bytes: int = 2 << 30) -> Path:
    """A randomly initialised checkpoint of the real layout (tests, benchmarks)."""
    import torch

    from worker.model.checkpoint import save_checkpoint
    from worker.model.config import AlpamayoConfig
    from worker.model.modules import Alpamayo2

    tok = build_tokenizer(corpus or [DEFAULT_CORPUS], vocab_size=400)
    config = make_config(tok, dims)
    torch.manual_seed(seed)
    model = Alpamayo2(AlpamayoConfig.from_dict(config))
    save_checkpoint(model, config, directory, max_shard_bytes=max_shard_bytes)
    write_support_files(directory, tok, config)
    return Path(directory)
