"""The checkpoint's `config.json` (wrapper `Alpamayo2SuperConfig`), parsed and checked.

The wrapper holds an inline Qwen3-VL config (`vlm_config`) and an inline expert config
(`expert_config.llm_config`, a Qwen3-VL *text* config) plus the action space, diffusion,
trajectory-tokenizer and token-id settings (docs: alpamayo2-model.md section 1.2-1.4).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import Refusal
from worker.model.action_space import UnicycleActionSpaceConfig


class CheckpointError(Refusal, ValueError):
    """A checkpoint directory or config that cannot be served; the message names the piece."""


# The special tokens of the real layout, in the order the release adds them (section 1.4).
SPECIAL_TOKEN_KEYS = (
    "prompt_start prompt_end image_start image_pre_tkn image_end traj_history_start "
    "traj_history_pre_tkn traj_history_end cot_start cot_end meta_action_start meta_action_end "
    "traj_future_start traj_future_pre_tkn traj_future_end traj_history traj_future image_pad "
    "vectorized_wm vectorized_wm_start vectorized_wm_end vectorized_wm_pre_tkn route_start "
    "route_pad route_end question_start question_end answer_start answer_end"
).split()
SPECIAL_TOKENS = tuple(f"<|{k}|>" for k in SPECIAL_TOKEN_KEYS)
HISTORY_BINS = 1000
FUTURE_BINS = 3000


def canonical_config_sha256(config: dict[str, Any]) -> str:
    """sha256 of a config dict in canonical form: JSON, keys sorted, no whitespace, UTF-8.

    The DFlash2 head metadata records this hash of the base checkpoint's config.json.
    """
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TokenIds:
    """Token ids the runtime needs, resolved from the tokenizer and checked against config."""

    history_id0: int
    future_id0: int
    traj_history_start: int
    traj_history_end: int
    traj_history: int
    traj_future_start: int
    traj_future_end: int
    traj_future: int
    im_start: int
    im_end: int
    endoftext: int
    vision_start: int
    vision_end: int
    image_pad: int
    pad: int

    @property
    def traj_token_range(self) -> tuple[int, int]:
        """[start, end) of the 4000 `<i*>` trajectory-bin tokens (never sampled in text)."""
        return self.history_id0, self.history_id0 + HISTORY_BINS + FUTURE_BINS


@dataclass(frozen=True)
class DiffusionConfig:
    num_inference_steps: int = 10
    int_method: str = "euler"
    use_classifier_free_guidance: bool = False


@dataclass(frozen=True)
class ActionInProjConfig:
    num_fourier_feats: int = 20
    max_freq: float = 100.0
    num_enc_layers: int = 2
    hidden_size: int = 512


@dataclass
class AlpamayoConfig:
    """Parsed wrapper config. `raw` is the config.json dict as read."""

    raw: dict[str, Any]
    vlm_config: dict[str, Any]
    expert_llm_config: dict[str, Any]
    action_space: UnicycleActionSpaceConfig
    diffusion: DiffusionConfig
    action_in_proj: ActionInProjConfig
    hist_traj_tokenizer_cfg: dict[str, Any]
    future_traj_tokenizer_cfg: dict[str, Any]
    tokens_per_history_traj: int
    tokens_per_future_traj: int
    traj_ids: dict[str, int]
    min_pixels: int
    max_pixels: int
    include_camera_ids: bool
    frame_label: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> dict[str, Any]:
        return self.vlm_config["text_config"]

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def sha256(self) -> str:
        return canonical_config_sha256(self.raw)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "AlpamayoConfig":
        def need(obj: dict, key: str, path: str):
            if not isinstance(obj, dict) or key not in obj:
                raise CheckpointError(f"{where}: missing `{path}`")
            return obj[key]

        if d.get("model_type") not in ("alpamayo2_super", None):
            raise CheckpointError(
                f"{where}: model_type is {d.get('model_type')!r}, expected 'alpamayo2_super'"
            )
        vlm = copy.deepcopy(need(d, "vlm_config", "vlm_config"))
        text = need(vlm, "text_config", "vlm_config.text_config")
        need(vlm, "vision_config", "vlm_config.vision_config")
        expert = need(d, "expert_config", "expert_config")
        llm = copy.deepcopy(need(expert, "llm_config", "expert_config.llm_config"))
        for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            a, b = text.get(key), llm.get(key)
            if a != b:
                raise CheckpointError(
                    f"{where}: expert_config.llm_config.{key}={b} must equal "
                    f"vlm_config.text_config.{key}={a} (expert layer l attends over VLM cache layer l)"
                )
        diffusion = expert.get("diffusion_cfg", {}) or {}
        if diffusion.get("use_classifier_free_guidance"):
            raise CheckpointError(f"{where}: expert_config.diffusion_cfg.use_classifier_free_guidance "
                                  "is true; classifier-free guidance is not served")
        in_proj = expert.get("action_in_proj_cfg", {}) or {}
        traj_ids = dict(d.get("traj_ids") or {})
        tph = int(d.get("tokens_per_history_traj", 45))
        if tph not in (45, 48, 60, 64):
            raise CheckpointError(f"{where}: tokens_per_history_traj={tph}, expected 45, 48, 60 or 64")
        frame_label = d.get("frame_label")
        if frame_label is None:  # legacy keys (section 1.2)
            frame_label = "frame_num" if d.get("include_frame_nums", True) else (
                "dt_token" if d.get("use_dt_tokens") else "none")
        return cls(
            raw=d,
            vlm_config=vlm,
            expert_llm_config=llm,
            action_space=UnicycleActionSpaceConfig.from_dict(expert.get("action_space_cfg", {}) or {}),
            diffusion=DiffusionConfig(
                num_inference_steps=int(diffusion.get("num_inference_steps", 10)),
                int_method=str(diffusion.get("int_method", "euler")),
            ),
            action_in_proj=ActionInProjConfig(
                num_fourier_feats=int(in_proj.get("num_fourier_feats", 20)),
                max_freq=float(in_proj.get("max_freq", 100.0)),
                num_enc_layers=int(in_proj.get("num_enc_layers", 2)),
                hidden_size=int(in_proj.get("hidden_size", 512)),
            ),
            hist_traj_tokenizer_cfg=dict(d.get("hist_traj_tokenizer_cfg") or {}),
            future_traj_tokenizer_cfg=dict(d.get("future_traj_tokenizer_cfg") or {}),
            tokens_per_history_traj=tph,
            tokens_per_future_traj=int(d.get("tokens_per_future_traj", 128)),
            traj_ids=traj_ids,
            min_pixels=int(d.get("min_pixels", 163840)),
            max_pixels=int(d.get("max_pixels", 196608)),
            include_camera_ids=bool(d.get("include_camera_ids", True)),
            frame_label=str(frame_label),
            dtype=str(d.get("dtype", d.get("torch_dtype", "bfloat16"))),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "AlpamayoConfig":
        path = Path(path)
        f = path / "config.json"
        try:
            d = json.loads(f.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path}: missing config.json") from None
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: config.json is not readable JSON ({e})") from None
        return cls.from_dict(d, where=str(f))
