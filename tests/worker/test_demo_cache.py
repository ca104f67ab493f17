"""worker.demo_cache: where the embedded demo checkpoint and its DFlash2 head are cached, and the
serving side building a missing one in a child interpreter (python -m worker.demo.build /
worker.dflash.train) instead of importing the training code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker import demo_cache
from worker.config import cache_dir

from tests import REPO_ROOT


def test_cache_layout(tmp_path, monkeypatch):
    assert demo_cache.checkpoint_dir(tmp_path) == tmp_path / f"demo-checkpoint-v{demo_cache.DEMO_VERSION}"
    assert demo_cache.checkpoint_dir(tmp_path, seed=3).name.endswith("-seed3")
    monkeypatch.setenv("ALPAMAYO_CACHE", "~/alpamayo-cache-test")
    assert demo_cache.cache_root() == cache_dir() == Path.home() / "alpamayo-cache-test"
    d = tmp_path / "d"
    d.mkdir()
    assert not demo_cache.is_complete(d)
    (d / demo_cache.COMPLETE_MARKER).write_text("")
    assert demo_cache.is_complete(d)


def test_head_dir_is_keyed_by_the_checkpoint_weights(tmp_path):
    from worker.demo.layout import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    first = demo_cache.head_dir(ckpt, tmp_path)
    assert first == demo_cache.head_dir(ckpt, tmp_path)
    assert first.parent == tmp_path and first.name.startswith(f"demo-dflash2-head-v{demo_cache.HEAD_VERSION}-")
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert demo_cache.head_dir(ckpt, tmp_path) != first


def test_a_complete_checkpoint_is_served_without_a_child(tmp_path, monkeypatch):
    path = demo_cache.checkpoint_dir(tmp_path)
    path.mkdir(parents=True)
    (path / demo_cache.COMPLETE_MARKER).write_text("")

    def no_child(*args, **kwargs):
        raise AssertionError("a complete checkpoint must not start a builder")

    monkeypatch.setattr(demo_cache, "_run_builder", no_child)
    assert demo_cache.demo_checkpoint(tmp_path) == path


def test_a_missing_checkpoint_is_built_by_a_child_whose_failure_is_reported(tmp_path):
    """A cache root that is a file: the child (python -m worker.demo.build) fails at once, and the
    serving side raises with the child's exit status and last stderr line."""
    root = tmp_path / "not-a-directory"
    root.write_text("")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"building the embedded demo checkpoint failed \(python -m "
                                           r"worker\.demo\.build exited 1\): \w+Error"):
        demo_cache.demo_checkpoint(root)
    assert time.perf_counter() - t0 < 60


def test_the_head_builder_entry_point_takes_the_arguments_the_serving_side_passes():
    p = subprocess.run([sys.executable, "-m", "worker.dflash.train", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert p.returncode == 0, p.stderr
    for flag in ("--checkpoint", "--cache-dir", "--quiet"):
        assert flag in p.stdout
