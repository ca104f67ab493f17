"""Image inputs against transformers' own Qwen2-VL/Qwen3-VL image processor (its PIL backend, the
one that needs no torchvision): the same grids and image-token counts, and pixel values within
1/255 (before normalisation) on camera-sized frames, 1920x1080 included."""

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from worker.model.inputs import ImageProcessing

OURS = ImageProcessing()          # the release's preprocessing: patch 16, merge 2, 160-192 K pixels
REFERENCE = Qwen2VLImageProcessorPil(
    patch_size=OURS.patch_size, temporal_patch_size=OURS.temporal_patch_size, merge_size=OURS.merge_size,
    image_mean=list(OURS.image_mean), image_std=list(OURS.image_std),
    size={"shortest_edge": OURS.min_pixels, "longest_edge": OURS.max_pixels})


def _image(kind: str, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(h * 7 + w)
    if kind == "noise":
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([127 + 120 * np.sin(xx / 17.0 + c) * np.cos(yy / 23.0) for c in range(3)], -1).astype(np.uint8)


# pure noise at 640x480 differs by up to 18/255 in a few pixels (PIL's fixed-point 8-bit passes)
@pytest.mark.parametrize("kind, h, w", [("noise", 1080, 1920), ("noise", 720, 1280), ("noise", 1200, 1600),
                                        ("smooth", 1080, 1920), ("smooth", 720, 1280), ("smooth", 1200, 1600),
                                        ("smooth", 480, 640)])
def test_pixels_grids_and_token_counts_match_transformers(kind, h, w):
    img = _image(kind, h, w)
    ref = REFERENCE(images=[img], return_tensors="pt")
    pixels, grid = OURS(torch.from_numpy(img)[None])
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert int(grid[0].prod()) // OURS.merge_size ** 2 == int(ref["image_grid_thw"][0].prod()) // 4
    assert pixels.shape == ref["pixel_values"].shape
    diff = (pixels - ref["pixel_values"]).abs().max() * OURS.image_std[0] * 255
    assert float(diff) <= 1.0 + 1e-4, float(diff)
