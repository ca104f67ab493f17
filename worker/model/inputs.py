"""Model inputs: camera profiles, image preprocessing (decoding: worker/frames.py), the prompt, trajectory tokens.

Follows docs/alpamayo2-model.md section 2: 6 cameras x 4 frames, camera-major, oldest frame
first; each frame is one Qwen3-VL *image* (temporal patch duplicated); the no-special-token
prompt rendered with the Qwen3-VL chat layout; 45 history trajectory tokens replacing the
`<|traj_history|>` placeholders; for auto_labeling 128 future tokens replacing `<|traj_future|>`.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from schemas import CAMERAS, TASKS_NEEDING_EGOMOTION
from worker.model.config import CheckpointError

SYSTEM_PROMPT = "You are a driving assistant that generates safe and accurate actions."
INSTRUCTIONS = {
    "trajectory": "output the chain-of-thought reasoning of the driving process, then output the future trajectory.",
    "meta_action": "output the chain-of-thought reasoning of the driving process, then output meta actions, "
                   "then output the future trajectory.",
    "auto_labeling": "output a comprehensive analysis of the driving scene in JSON format.",
}
DEFAULT_QUESTIONS = {
    "grounding": "Find the white lead vehicle directly ahead and return its bounding box in JSON.",
    "vqa": "What are the key traffic elements visible in this scene and how should they influence driving behavior?",
}

@dataclass(frozen=True)
class ImageProcessing:
    """Qwen3-VL image preprocessing settings (preprocessor_config.json + config min/max pixels)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 163840
    max_pixels: int = 196608
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, path: Path, min_pixels: int, max_pixels: int) -> "ImageProcessing":
        d = json.loads((Path(path) / "preprocessor_config.json").read_text())
        return cls(
            patch_size=int(d.get("patch_size", 16)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(d.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(d.get("image_std", (0.5, 0.5, 0.5))),
        )

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """Qwen's smart_resize: multiples of patch*merge, pixels within [min, max]."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ValueError("image aspect ratio must be below 200")
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def _resize(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, H, W, 3) uint8 -> (N, 3, th, tw) fp32 in [0, 1], resized to `target_size` as
        transformers' Qwen2-VL/Qwen3-VL processor resizes (PIL's bicubic with antialiasing on
        8-bit images): a horizontal then a vertical pass, each rounded to 8 bits, then x/255.
        Each image is resized on its own (batching is exact)."""
        th, tw = self.target_size(frames.shape[1], frames.shape[2])
        x = frames.permute(0, 3, 1, 2).float()
        if tw != x.shape[3]:
            x = F.interpolate(x, size=(x.shape[2], tw), mode="bicubic", antialias=True,
                              align_corners=False).round_().clamp_(0, 255)
        if th != x.shape[2]:
            x = F.interpolate(x, size=(th, tw), mode="bicubic", antialias=True,
                              align_corners=False).round_().clamp_(0, 255)
        return x / 255.0

    def shrink(self, frame: np.ndarray) -> np.ndarray:
        """One decoded frame (H, W, 3) uint8 -> what is worth keeping until the batch runs.

        A frame larger than the model's target size becomes its resized float frame
        (th, tw, 3) fp32 in [0, 1] - exactly what `__call__` would compute from it later - so a
        queued 1920x1080 frame costs th*tw*12 bytes instead of 6 MB. Frames at or below the target
        size are returned unchanged (uint8 is the smaller form then)."""
        th, tw = self.target_size(frame.shape[0], frame.shape[1])
        if th * tw >= frame.shape[0] * frame.shape[1]:
            return frame
        x = self._resize(torch.from_numpy(np.array(frame))[None])    # a copy: decoded frames are read-only
        return x[0].permute(1, 2, 0).contiguous().numpy()

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, 3, 1, 1) fp32 image mean and std on `device`, made once per device (a tensor from a
        list on the GPU is a copy that waits for the GPU: once per scene before)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = tuple(torch.tensor(v, device=device).view(1, 3, 1, 1)
                                         for v in (self.image_mean, self.image_std))
        return self._on_device[key]

    def grid(self, frames) -> torch.Tensor:
        """(N, 3) long patch grid (1, gh, gw) per image of frames (N, H, W, 3): uint8 frames are
        resized to `target_size`, float frames (from `shrink`) are already at it. Raises
        ValueError on an aspect ratio the model refuses."""
        n, h, w = frames.shape[:3]
        if frames.dtype in (np.uint8, torch.uint8):
            h, w = self.target_size(h, w)
        return torch.tensor([[1, h // self.patch_size, w // self.patch_size]] * n, dtype=torch.long)

    def __call__(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """frames (N, H, W, 3) uint8, or fp32 frames already resized by `shrink` (one size)
        -> pixel_values (N*gh*gw, 3*T*P*P) fp32, grid (N, 3).

        Resize as transformers' processor does (`_resize`), normalise, patchify in the exact order
        of transformers' Qwen2-VL processor (each still image duplicated over the temporal patch).
        """
        n = frames.shape[0]
        if frames.dtype == torch.uint8:
            x = self._resize(frames)
        else:
            x = frames.permute(0, 3, 1, 2).float()
        th, tw = x.shape[2], x.shape[3]
        mean, std = self._mean_std(x.device)
        x = (x - mean) / std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = th // p, tw // p
        x = x.reshape(n, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
        pixel_values = x.reshape(n * gh * gw, 3 * t * p * p)
        return pixel_values, self.grid(frames)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU (CUDA: through pinned memory,
    non-blocking; a copy of pageable memory synchronises the stream)."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def to_host(*xs: torch.Tensor) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Device tensors copied into pinned host memory without waiting for the GPU, and an event
    recorded behind the copies (synchronize it before reading them); on the CPU the tensors
    themselves and None."""
    if not xs or xs[0].device.type != "cuda":
        return list(xs), None
    out = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True) for x in xs]
    ready = torch.cuda.Event()
    ready.record()
    return out, ready


def mrope_positions(input_ids: torch.Tensor, image_grid: torch.Tensor, image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """Qwen3-VL multimodal rotary positions for one prompt.

    input_ids (P,) -> positions (3, P) long and rope_delta (int) = max position + 1 - P.
    Text tokens advance all three axes together; an image block of grid (1, gh, gw) takes
    t = start, h = start + row, w = start + col and advances by max(gh, gw) / merge.
    """
    n_ids = len(input_ids)
    pos = torch.empty(3, n_ids, dtype=torch.long)
    image_at = (input_ids == image_token_id).nonzero().flatten().tolist()
    cur = i = 0
    for _, gh, gw in image_grid.tolist():           # one image block at a time, the text before it one
        k = bisect.bisect_left(image_at, i)         # position per token
        if k == len(image_at):
            break
        nxt = image_at[k]
        pos[:, i:nxt] = torch.arange(cur, cur + nxt - i)
        cur += nxt - i
        h, w = int(gh) // merge_size, int(gw) // merge_size
        n = h * w
        pos[0, nxt:nxt + n] = cur
        pos[1, nxt:nxt + n] = cur + torch.arange(h).repeat_interleave(w)[:n_ids - nxt]
        pos[2, nxt:nxt + n] = cur + torch.arange(w).repeat(h)[:n_ids - nxt]
        cur += max(h, w)
        i = nxt + n
    if i < n_ids:
        pos[:, i:] = torch.arange(cur, cur + n_ids - i)
    return pos, int(pos.max()) + 1 - n_ids


@dataclass(frozen=True)
class PromptSpec:
    """Everything the prompt depends on, for one scene (the trajectory tokens aside)."""

    task: str
    camera_ids: tuple[int, ...]
    num_frames: int
    tokens_per_image: int
    nav_text: str | None = None
    question: str | None = None


TEMPLATE_CACHE = 64                 # distinct prompts (camera rig, frames, task, free text) kept tokenized
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"    # one image as a chat template renders it


class PromptBuilder:
    """The prompt (section 2.5) as chat messages, rendered with the checkpoint's chat template
    when it has one (`chat_template`, worker/model/tokenizer.py) and with the built-in Qwen3-VL
    chat layout otherwise; each image's `<|image_pad|>` then expands to the image's token count,
    as Qwen3-VL's processor expands it. Tokenized once, as the processor would."""

    def __init__(self, tokenizer, token_ids, tokens_per_history: int, tokens_per_future: int,
                 include_camera_ids: bool = True, frame_label: str = "frame_num", chat_template=None):
        self.tok = tokenizer
        self.ids = token_ids
        self.tokens_per_history = tokens_per_history
        self.tokens_per_future = tokens_per_future
        self.include_camera_ids = include_camera_ids
        self.frame_label = frame_label
        self.chat_template = chat_template
        # the rendered and tokenized prompt of each spec seen lately, placeholders in place: scenes of
        # one camera rig and task share it (py-spy on the H200 machine, 2026-12-02: tokenizing held
        # the interpreter lock 1.3 s of a 40 s Kafka run, on the batch-prep thread beside the
        # engine's kernel launches)
        self._template = functools.lru_cache(maxsize=TEMPLATE_CACHE)(self._tokenize)
        self._positions = functools.lru_cache(maxsize=TEMPLATE_CACHE)(self._mrope)

    def messages(self, spec: PromptSpec) -> list[dict]:
        """System and user messages, the user's content a list of text and image items."""
        content: list[dict] = []

        def text(t: str) -> None:
            content.append({"type": "text", "text": t})
        for cid in spec.camera_ids:
            if self.include_camera_ids:
                text(f"{CAMERAS[cid].display_name}: ")
            for k in range(spec.num_frames):
                if self.frame_label == "frame_num":
                    text(f"frame {k} ")
                content.append({"type": "image"})
        if spec.task in TASKS_NEEDING_EGOMOTION:     # the prompt holds the ego history
            text("<|traj_history_start|>" + "<|traj_history|>" * self.tokens_per_history + "<|traj_history_end|>")
        if spec.task == "auto_labeling":
            text("<|traj_future_start|>" + "<|traj_future|>" * self.tokens_per_future + "<|traj_future_end|>")
        if spec.nav_text:
            text(spec.nav_text)
        text(INSTRUCTIONS[spec.task] if spec.task in INSTRUCTIONS else spec.question or DEFAULT_QUESTIONS[spec.task])
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]

    @staticmethod
    def builtin_render(messages: list[dict]) -> str:
        """The Qwen3-VL chat layout, for checkpoints without a chat template."""
        out = []
        for m in messages:
            body = m["content"] if isinstance(m["content"], str) else "".join(
                IMAGE_PLACEHOLDER if item["type"] == "image" else item["text"] for item in m["content"])
            out.append(f"<|im_start|>{m['role']}\n{body}<|im_end|>\n")
        return "".join(out) + "<|im_start|>assistant\n"

    def render(self, spec: PromptSpec) -> str:
        messages = self.messages(spec)
        text = self.chat_template.render(messages) if self.chat_template else self.builtin_render(messages)
        return text.replace("<|image_pad|>", "<|image_pad|>" * spec.tokens_per_image)

    def check_template(self, label: str) -> None:
        """Render every task's prompt once (at load): a chat template that fails, or renders another
        number of images than the prompt holds, is refused in one line (CheckpointError)."""
        for task in (*INSTRUCTIONS, *DEFAULT_QUESTIONS):
            try:
                text = self.render(PromptSpec(task, (0, 1), 2, 1))
            except Exception as e:      # jinja2 raises many types for a bad template
                raise CheckpointError(f"{label}: its chat template cannot render the {task} prompt "
                                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
            if text.count("<|image_pad|>") != 4:
                raise CheckpointError(f"{label}: its chat template renders {text.count('<|image_pad|>')} image "
                                      f"placeholders for a {task} prompt of 4 images: it must render each image item "
                                      "as <|vision_start|><|image_pad|><|vision_end|>")

    def _tokenize(self, spec: PromptSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (P,) ids of the rendered prompt, and the positions of each trajectory placeholder."""
        ids = torch.tensor(self.tok.encode(self.render(spec), add_special_tokens=False).ids, dtype=torch.long)
        return ids, {name: (ids == pad).nonzero().flatten()
                     for pad, name in ((self.ids.traj_history, "history"), (self.ids.traj_future, "future"))}

    def positions(self, spec: PromptSpec, grid: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, int]:
        """The prompt's multimodal rotary positions and rope delta (`mrope_positions`; read-only).
        They depend on where the image tokens are and on the images' grids only (the trajectory
        tokens are text), so every scene of one spec and frame size shares them: computed once
        (the per-image loop was most of a scene's prompt work, all of it before the scene's first
        kernel: 2.3 -> 0.35 ms a 24-image scene on the development machine's CPU)."""
        return self._positions(spec, tuple(map(tuple, grid.tolist())), merge_size)

    def _mrope(self, spec: PromptSpec, grid: tuple, merge_size: int) -> tuple[torch.Tensor, int]:
        return mrope_positions(self._template(spec)[0], torch.tensor(grid), self.ids.image_pad, merge_size)

    def encode(self, spec: PromptSpec, history_ids: torch.Tensor | None,
               future_ids: torch.Tensor | None) -> torch.Tensor:
        """-> (P,) long prompt ids with the trajectory placeholders replaced in order."""
        template, places = self._template(spec)
        ids = template.clone()
        for values, name in ((history_ids, "history"), (future_ids, "future")):
            where = places[name]
            if len(where) == 0:
                continue
            if values is None or len(values) != len(where):
                raise ValueError(f"prompt has {len(where)} {name} placeholders, "
                                 f"got {0 if values is None else len(values)} {name} tokens")
            ids[where] = values.to(torch.long)
        return ids
