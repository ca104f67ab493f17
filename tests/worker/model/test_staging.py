"""A scene's frames staged in pieces (worker/model/staging.py): the device path, exercised on the
CPU (`on_device=True`: the buffer unpinned, each piece "sent" to the CPU and preprocessed there)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from worker.model import staging
from worker.model.inputs import ImageProcessing
from worker.model.staging import StagedFrames, piece_frames

PROC = ImageProcessing()
PIECE_FRAMES = 6


@pytest.fixture(autouse=True)
def pieces_of_six_small_frames(monkeypatch):
    """The tests' 90 x 160 frames in pieces of 6, as full-HD frames are staged."""
    monkeypatch.setattr(staging, "PIECE_BYTES", PIECE_FRAMES * 90 * 160 * 3)


def test_full_hd_frames_go_six_a_piece_and_small_ones_in_one(monkeypatch):
    monkeypatch.undo()
    assert piece_frames((1080, 1920, 3)) == 6                       # a 24-frame scene in 4 pieces
    assert piece_frames((128, 128, 3)) >= 24                        # the demo's scene in one
    with ThreadPoolExecutor(2) as pool:
        staged = StagedFrames(frames(hw=(128, 128)), PROC, torch.device("cpu"), torch.float32, pool, on_device=True)
        assert len(staged.pieces) == 1
        staged.pixel_values()


def frames(n=24, hw=(90, 160), seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *hw, 3), dtype=np.uint8)


def test_pieces_give_exactly_the_whole_scenes_pixel_values():
    f = frames(n=2 * PIECE_FRAMES + 1)          # a short last piece too
    whole = PROC(torch.from_numpy(f))[0].to(torch.bfloat16)
    with ThreadPoolExecutor(4) as pool:
        staged = StagedFrames(f, PROC, torch.device("cpu"), torch.bfloat16, pool, on_device=True)
        assert len(staged.pieces) == 3
        pixels, host_ms = staged.pixel_values()
    assert torch.equal(pixels, whole) and host_ms > 0
    assert staged.host is None                  # the staging buffer goes back to the allocator
    cpu = StagedFrames(f, PROC, torch.device("cpu"), torch.bfloat16, None)      # the CPU path: one task
    assert len(cpu.pieces) == 1 and torch.equal(cpu.pixel_values()[0], whole)


def test_the_first_piece_is_preprocessed_while_the_last_is_still_being_copied(monkeypatch):
    """The device copies and resizes the first pieces while the host copies the last (before, the
    device waited for the whole scene's host copy): the last piece's copy here waits until the first
    piece has been preprocessed, which the old whole-scene staging could never let happen."""
    first_done = threading.Event()
    events = []
    copy = StagedFrames._copy

    def slow_copy(self, f, a, b):
        if b == len(f):
            events.append(("last copy waited", first_done.wait(timeout=10)))
        return copy(self, f, a, b)

    class Proc:
        def __call__(self, x):
            events.append(("preprocessed", len(x)))
            first_done.set()
            return PROC(x)
    monkeypatch.setattr(StagedFrames, "_copy", slow_copy)
    f = frames()
    with ThreadPoolExecutor(4) as pool:
        staged = StagedFrames(f, Proc(), torch.device("cpu"), torch.float32, pool, on_device=True)
        pixels, _ = staged.pixel_values()
    assert events[0] == ("preprocessed", PIECE_FRAMES) and ("last copy waited", True) in events
    assert torch.equal(pixels, PROC(torch.from_numpy(f))[0])


def test_pieces_are_copied_on_the_pool_threads(monkeypatch):
    names = []
    copy = StagedFrames._copy
    monkeypatch.setattr(StagedFrames, "_copy",
                        lambda self, f, a, b: (names.append(threading.current_thread().name), copy(self, f, a, b))[1])
    with ThreadPoolExecutor(2, thread_name_prefix="image-prep") as pool:
        StagedFrames(frames(), PROC, torch.device("cpu"), torch.float32, pool, on_device=True).pixel_values()
    assert len(names) == 24 // PIECE_FRAMES and all(n.startswith("image-prep") for n in names)


def test_the_engine_warms_with_pinned_buffers_for_the_running_batch_and_the_next():
    """A worker's first two batches stage their frames into pinned buffers the warm-up left in torch's
    host cache (on the H200 the first batch of a Kafka run pinned fresh memory: 13.8 s against 6.9)."""
    from types import SimpleNamespace

    from worker.config import load_settings
    from worker.engine import Engine

    class Runtime:
        def __init__(self):
            self.calls = []

        def warmup(self, k_values, image_size=None, staged_scenes=1):
            self.calls.append((k_values, staged_scenes))

    engine = Engine(load_settings({"ALPAMAYO_MAX_BATCH_SIZE": "16"}))
    engine.runtime = Runtime()
    engine.warm()
    assert engine.runtime.calls == [(list(engine.settings.k_values), 32)]
    # a batch larger than the cache's rows runs in chunks: two chunks' scenes up front, not 2 x 256
    engine = Engine(load_settings({"ALPAMAYO_MAX_BATCH_SIZE": "256"}))
    engine.runtime, engine.plan = Runtime(), SimpleNamespace(max_rows=16)
    engine.warm()
    assert engine.runtime.calls == [(list(engine.settings.k_values), 32)]
