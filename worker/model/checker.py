"""An independent second opinion on a trajectory scene: a small CNN that sees the scene's front
cameras and the ego history and predicts the 6.4 s trajectory by itself.

Why: the VLM's worst misses are confident (all K samples share one misreading), so no spread
between its samples reveals them, and neither do probes of its own hidden states (what it misses
is not in its representation). A model that looks at the pixels on its own does see them; the
mean distance between its trajectory and the K samples (`worker.uncertainty.checker_disagreement`)
ranks bad results
(docs/uncertainty.md). The checker is an optional part of a checkpoint (`<checkpoint>/checker/`:
`model.safetensors` + `config.json`); without one, the uncertainty block has no checker term.

Shapes: B scenes, C cameras x F frames (camera-major, as requests carry them), S image side,
W = 64 waypoints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

CHECKER_DIR = "checker"
"""The checker's directory inside a checkpoint directory."""


@dataclass(frozen=True)
class CheckerConfig:
    cameras: tuple[int, ...] = (1, 6)           # camera ids: front wide 120 deg, front tele 30 deg
    frames_per_camera: int = 4
    image_size: int = 64
    channels: tuple[int, ...] = (48, 64, 96, 128, 128)
    history_len: int = 16
    waypoints: int = 64
    fact_classes: tuple[int, ...] = (5, 2, 3, 4)  # training aid (worker.demo.checker): lead, pedestrian, blocked lane, light
    scale_m: float = 20.0                         # inputs and outputs in units of this many metres
    heldout_ade_m: float = 0.0                    # its own trajectory error on held-out scenes (the recipe's)

    @classmethod
    def from_json(cls, text: str) -> "CheckerConfig":
        d = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in cls.__dataclass_fields__})


class SceneChecker(nn.Module):
    def __init__(self, cfg: CheckerConfig = CheckerConfig()):
        super().__init__()
        self.cfg = cfg
        c_in = 3 * len(cfg.cameras) * cfg.frames_per_camera
        layers, prev = [], c_in
        for i, c in enumerate(cfg.channels):
            stride = 1 if i in (0, len(cfg.channels) - 1) else 2
            layers += [nn.Conv2d(prev, c, 3, stride, 1), nn.BatchNorm2d(c), nn.ReLU()]
            prev = c
        self.body = nn.Sequential(*layers)
        self.hist = nn.Sequential(nn.Linear(cfg.history_len * 3, 64), nn.ReLU())
        width = 2 * prev + 64
        self.facts = nn.Linear(width, sum(cfg.fact_classes))
        self.traj = nn.Sequential(nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, cfg.waypoints * 2))

    def forward(self, frames: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """frames (B, C*F, S, S, 3) uint8, history (B, history_len, 3) metres ->
        (trajectory (B, W, 2) metres in the t0 ego frame, per-fact logits [(B, classes)])."""
        b = frames.shape[0]
        x = frames.permute(0, 1, 4, 2, 3).reshape(b, -1, frames.shape[2], frames.shape[3]).float() / 255.0
        h = self.body(x)
        h = torch.cat([h.mean((2, 3)), h.amax((2, 3)), self.hist(history.reshape(b, -1) / self.cfg.scale_m)], 1)
        traj = self.traj(h).reshape(b, self.cfg.waypoints, 2) * self.cfg.scale_m
        return traj, list(self.facts(h).split(list(self.cfg.fact_classes), 1))


def checker_inputs(cfg: CheckerConfig, frames: np.ndarray, camera_ids, num_frames: int,
                   history_xyz) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A request's frames (N, H, W, 3) uint8, camera-major over `camera_ids`, `num_frames` each,
    and its ego history (history_len, 3) -> the checker's inputs ((1, C*F, S, S, 3) uint8,
    (1, history_len, 3)), or None when the request lacks one of the checker's cameras or frames."""
    cams = list(camera_ids)
    if any(c not in cams for c in cfg.cameras) or num_frames < cfg.frames_per_camera or history_xyz is None:
        return None
    x = torch.from_numpy(np.ascontiguousarray(frames)).reshape(len(cams), num_frames, *frames.shape[1:])
    x = x[[cams.index(c) for c in cfg.cameras], num_frames - cfg.frames_per_camera:].flatten(0, 1)
    if x.shape[1] != cfg.image_size or x.shape[2] != cfg.image_size:
        x = F.interpolate(x.permute(0, 3, 1, 2).float(), size=(cfg.image_size, cfg.image_size), mode="bilinear",
                          antialias=True, align_corners=False).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    hist = torch.as_tensor(np.asarray(history_xyz, np.float32)).reshape(-1, 3)
    if hist.shape[0] != cfg.history_len:
        return None
    return x[None].contiguous(), hist[None]


def save_checker(model: SceneChecker, directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # fp16 on disk (half the bytes of the shipped demo files; the model runs in fp32)
    save_file({k: (v.half() if v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(asdict(model.cfg), indent=1) + "\n")
    return d


def load_checker(checkpoint: str | Path) -> SceneChecker | None:
    """The checker of a checkpoint directory (eval mode, fp32, CPU), or None when it has none."""
    d = Path(checkpoint) / CHECKER_DIR
    if not (d / "config.json").is_file():
        return None
    model = SceneChecker(CheckerConfig.from_json((d / "config.json").read_text()))
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    return model.eval()


__all__ = ["CHECKER_DIR", "CheckerConfig", "SceneChecker", "checker_inputs", "save_checker", "load_checker"]
