"""A scene's frames on their way to the model: `StagedFrames`, made when the scene is prepared
and collected (`pixel_values`) just before its prefill.

On the GPU the frames are copied into one page-locked buffer in pieces of about `PIECE_BYTES`
(`piece_frames`: 6 full-HD frames; small frames, such as the demo's, in one piece, whose one copy
and preprocessing launch a quarter of the kernels), each piece a task of the image-prep pool; `pixel_values` sends each piece to the device and
preprocesses it there (resize, normalise, patchify: `ImageProcessing`) as soon as that piece is
in place, so the device's copies and resizes of the first pieces run while the host still copies
the last ones. Before, the device waited for the whole scene's host copy (149 MB, 4 ms on the
H200's host) and then copied and resized all 24 frames (~7 ms) before the vision tower's first kernel.
Each image is preprocessed on its own, so the pieces' pixel values, concatenated, are exactly the
whole scene's.

On the CPU the pool preprocesses the whole scene (one task), off the caller's thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from worker.model.inputs import ImageProcessing

PIECE_BYTES = 40 << 20    # bytes per staged piece at most: a 24-frame full-HD scene in 4 (6 frames, ~37 MB)


def reserve_pinned(scenes: int, frames_shape: tuple[int, ...]) -> None:
    """Put `scenes` page-locked buffers for one scene's uint8 frames of `frames_shape` (N, H, W, 3)
    into torch's caching host allocator, which keeps a freed pinned block (its size rounded up to a
    power of two) for the next request of that size. A worker's first batches then stage their
    frames into cached buffers. H200 host, 2026-12-04 (`docs/benchmarks.md`): a fresh 149 MB buffer
    (24 full-HD frames) took 131-158 ms to pin, a cached one 0.01 ms; 4,000 matrix products ran 14%
    slower beside a thread pinning fresh ones (0.5% beside cached ones); in a Kafka run the engine
    thread pinned the first batch's 16 scenes (2.7 s) and the prep thread the next batch's beside
    its prefill. They outlive the warm-up's later CUDA graph captures because `GraphCache` captures
    without torch.cuda.graph's flush of this cache. CUDA only."""
    held = [torch.empty(frames_shape, dtype=torch.uint8, pin_memory=True) for _ in range(scenes)]
    del held


def piece_frames(frame_shape: tuple[int, ...], itemsize: int = 1) -> int:
    """Frames per staged piece for frames of `frame_shape` (H, W, 3) and `itemsize` bytes a value."""
    return max(1, PIECE_BYTES // (int(np.prod(frame_shape)) * itemsize))


class StagedFrames:
    """One scene's frames (N, H, W, 3), uint8 or the float frames of `ImageProcessing.shrink`.

    pieces: per piece a Future of (its first frame, its last + 1, host seconds start, end); on the
    device path the pieces fill `host`, a page-locked (pinned on CUDA) copy of the frames.
    """

    def __init__(self, frames: np.ndarray, image_proc: ImageProcessing, device: torch.device,
                 dtype: torch.dtype, pool: ThreadPoolExecutor | None, on_device: bool | None = None):
        self.image_proc, self.device, self.dtype = image_proc, device, dtype
        self.on_device = device.type == "cuda" if on_device is None else on_device
        frames = np.ascontiguousarray(frames)
        self.pixels: torch.Tensor | None = None
        if self.on_device:
            self.host = torch.empty(frames.shape, dtype=torch.from_numpy(np.empty(0, frames.dtype)).dtype,
                                    pin_memory=device.type == "cuda")
            step = piece_frames(frames.shape[1:], frames.itemsize)
            spans = [(a, min(a + step, len(frames))) for a in range(0, len(frames), step)]
            self.pieces = [_submit(pool, self._copy, frames, a, b) for a, b in spans]
        else:
            self.pieces = [_submit(pool, self._preprocess, frames)]

    def _copy(self, frames: np.ndarray, a: int, b: int) -> tuple[int, int, float, float]:
        t0 = time.perf_counter()
        self.host[a:b].copy_(torch.from_numpy(frames[a:b]))
        return a, b, t0, time.perf_counter()

    def _preprocess(self, frames: np.ndarray) -> tuple[int, int, float, float]:
        t0 = time.perf_counter()
        self.pixels = self.image_proc(torch.from_numpy(frames))[0].to(self.dtype)
        return 0, len(frames), t0, time.perf_counter()

    def pixel_values(self) -> tuple[torch.Tensor, float]:
        """-> (pixel values (N*gh*gw, 3*T*P*P) in the compute dtype on the device, the staging's
        host milliseconds: its first piece's start to its last piece's end). No host sync on CUDA:
        each piece's device copy reads the pinned buffer asynchronously (torch's caching host
        allocator keeps the buffer until those copies are done)."""
        out, times = [], []
        for piece in self.pieces:
            a, b, t0, t1 = piece.result()
            times += [t0, t1]
            if self.on_device:
                x = self.host[a:b].to(self.device, non_blocking=True)
                out.append(self.image_proc(x)[0].to(self.dtype))
        if self.on_device:
            self.pixels = torch.cat(out) if len(out) > 1 else out[0]
            self.host = None
        return self.pixels, (max(times) - min(times)) * 1000.0


def _submit(pool: ThreadPoolExecutor | None, fn, *args) -> Future:
    """fn(*args) on the pool, or here (no pool) as an already-finished Future."""
    if pool is not None:
        return pool.submit(fn, *args)
    done: Future = Future()
    done.set_result(fn(*args))
    return done
