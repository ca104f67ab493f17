"""worker.demo_cache: the shipped demo checkpoint and head (verified against their manifest), the
cache of recipe builds, and the serving side building a missing head of a built checkpoint in a
child interpreter (python -m worker.dflash.train) instead of importing the training code."""

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


def test_the_shipped_checkpoint_and_head_match_their_manifest_and_are_served_without_a_builder(monkeypatch):
    """make demo / make test train nothing: the served checkpoint and head are the shipped files,
    checked against MANIFEST.sha256 (<= 40 MB in all)."""
    def no_child(*args, **kwargs):
        raise AssertionError("the shipped files must not start a builder")

    monkeypatch.setattr(demo_cache, "_run_builder", no_child)
    shipped = demo_cache.shipped_dir()
    demo_cache._verified.clear()
    ckpt = demo_cache.demo_checkpoint()
    assert ckpt == shipped / "checkpoint" and demo_cache.demo_head(ckpt) == shipped / "head"
    listed = [line.split("  ", 1)[1] for line in (shipped / demo_cache.MANIFEST).read_text().splitlines()]
    assert "bars.json" in listed and "checkpoint/config.json" in listed and "head/model.safetensors" in listed
    check = subprocess.run(["sha256sum", "--quiet", "-c", demo_cache.MANIFEST], cwd=shipped, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert sum(p.stat().st_size for p in shipped.rglob("*") if p.is_file()) <= 40 * 1024 * 1024


def test_a_changed_missing_or_extra_shipped_file_is_refused_in_one_line(tmp_path):
    d = tmp_path / "shipped"
    (d / "checkpoint").mkdir(parents=True)
    (d / "checkpoint" / "config.json").write_text("{}")
    (d / "bars.json").write_text("{}")
    demo_cache.write_manifest(d)
    demo_cache.verify_manifest(d)
    demo_cache._verified.clear()
    (d / "bars.json").write_text('{"light_named": 1.0}')
    with pytest.raises(demo_cache.ShippedFilesError, match=r"bars\.json does not match MANIFEST\.sha256") as e:
        demo_cache.verify_manifest(d)
    assert "\n" not in str(e.value)
    demo_cache.write_manifest(d)
    (d / "checkpoint" / "extra.bin").write_bytes(b"x")
    with pytest.raises(demo_cache.ShippedFilesError, match=r"extra\.bin is not in MANIFEST\.sha256"):
        demo_cache.verify_manifest(d)
    (d / "checkpoint" / "extra.bin").unlink()
    (d / "checkpoint" / "config.json").unlink()
    with pytest.raises(demo_cache.ShippedFilesError, match=r"config\.json does not match MANIFEST\.sha256 \(missing"):
        demo_cache.verify_manifest(d)


def test_a_missing_head_of_a_built_checkpoint_is_built_by_a_child_whose_failure_is_reported(tmp_path):
    """A checkpoint built by the recipes (not the shipped one) gets its head from a child
    (python -m worker.dflash.train); a directory that is no checkpoint makes the child fail at
    once, and the serving side raises with its exit status and last stderr line."""
    from worker.demo.layout import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text("not json")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"building the demo DFlash2 head failed \(python -m "
                                           r"worker\.dflash\.train exited 1\): \w+"):
        demo_cache.demo_head(ckpt, tmp_path)
    assert time.perf_counter() - t0 < 120


def test_the_head_builder_entry_point_takes_the_arguments_the_serving_side_passes():
    p = subprocess.run([sys.executable, "-m", "worker.dflash.train", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert p.returncode == 0, p.stderr
    for flag in ("--checkpoint", "--cache-dir", "--quiet", "--recipe", "--device", "--out"):
        assert flag in p.stdout
