"""The embedded demo checkpoint and its DFlash2 head: shipped in the repository, verified, served.

    shipped_dir()              = worker/demo/shipped/{checkpoint,head,bars.json} + MANIFEST.sha256
    demo_checkpoint()          = shipped_dir() / "checkpoint" once every file matches the manifest
    demo_head(shipped ckpt)    = shipped_dir() / "head"

Both were trained on a GPU by the project's own recipes (`alpamayo-worker demo-checkpoint --recipe
gpu --device cuda`, `python -m worker.dflash.train --recipe gpu --device cuda`; docs/demo-model.md)
and shipped with `alpamayo-worker demo-checkpoint --ship CKPT HEAD`. Serving and `make demo` train
nothing: they check each shipped file's sha256 against MANIFEST.sha256 (`sha256sum -c` reads it
too) and refuse a mismatch in one line.

Other checkpoints built by the recipes (tests, `--recipe cpu`) live in the cache
(``ALPAMAYO_CACHE``): checkpoint_dir(root) = <root>/demo-checkpoint-v<DEMO_VERSION>, and
head_dir(checkpoint, root) = <root>/demo-dflash2-head-v<HEAD_VERSION>-<hash of its config and
weights>. A directory is complete once its ``complete`` marker exists (the last file a builder
writes). :func:`demo_head` of such a checkpoint runs the head builder (``python -m
worker.dflash.train``) in a child interpreter when its head is missing: the serving process never
imports training code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from worker.config import cache_dir
from worker.errors import Refusal

__all__ = ["DEMO_VERSION", "HEAD_VERSION", "COMPLETE_MARKER", "MANIFEST", "cache_root", "checkpoint_dir", "head_dir",
           "is_complete", "file_lock", "shipped_dir", "write_manifest", "verify_manifest", "ShippedFilesError",
           "demo_checkpoint", "demo_head"]

log = logging.getLogger("alpamayo.engine")

DEMO_VERSION = 2        # bump whenever anything that changes the demo checkpoint's weights changes
HEAD_VERSION = 3        # bump whenever anything that changes the packaged head's weights changes
COMPLETE_MARKER = "complete"
MANIFEST = "MANIFEST.sha256"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DIR = REPO_ROOT / "worker" / "demo" / "shipped"


def cache_root(root: str | os.PathLike | None = None) -> Path:
    """``root``, or ALPAMAYO_CACHE (worker.config.cache_dir)."""
    return Path(root).expanduser() if root is not None else cache_dir()


def checkpoint_dir(root: str | os.PathLike | None = None, seed: int = 0) -> Path:
    name = f"demo-checkpoint-v{DEMO_VERSION}" + ("" if seed == 0 else f"-seed{seed}")
    return cache_root(root) / name


def head_dir(checkpoint: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The packaged head of ``checkpoint``: keyed by HEAD_VERSION, the checkpoint's config and
    the weights the head is distilled from."""
    # torch (worker.model.config imports it through worker.model.action_space): kept local so that
    # worker.demo.build answers from a cached checkpoint without importing torch
    from worker.model.config import AlpamayoConfig

    checkpoint = Path(checkpoint)
    digest = hashlib.sha256(AlpamayoConfig.from_dir(checkpoint).sha256.encode())
    for shard in sorted(checkpoint.glob("*.safetensors")):
        digest.update(shard.read_bytes())
    return cache_root(root) / f"demo-dflash2-head-v{HEAD_VERSION}-{digest.hexdigest()[:12]}"


def is_complete(directory: str | os.PathLike) -> bool:
    return (Path(directory) / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created with its parents): concurrent builders build once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ShippedFilesError(Refusal):
    """The shipped demo files do not match their manifest."""


def shipped_dir() -> Path:
    return SHIPPED_DIR


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: str | os.PathLike) -> Path:
    """MANIFEST.sha256 of every file under `directory` (`sha256sum` format: "<hex>  <path>")."""
    d = Path(directory)
    (d / MANIFEST).write_text("".join(f"{_sha256(d / f)}  {f}\n" for f in _files(d)))
    return d / MANIFEST


_verified: set[Path] = set()


def verify_manifest(directory: str | os.PathLike) -> None:
    """Every file the manifest names has its sha256 and no other file is there; raises
    ShippedFilesError naming the first file that differs. Checked once per process."""
    d = Path(directory).resolve()
    if d in _verified:
        return
    restore = f"restore it with `git checkout -- {d.relative_to(REPO_ROOT) if d.is_relative_to(REPO_ROOT) else d}`"
    if not (d / MANIFEST).is_file():
        raise ShippedFilesError(f"the shipped demo files have no {MANIFEST} in {d}: {restore}")
    want = {}
    for line in (d / MANIFEST).read_text().splitlines():
        digest, _, name = line.partition("  ")
        want[name] = digest
    for name in sorted(set(want) | set(_files(d))):
        if name not in want:
            raise ShippedFilesError(f"{d / name} is not in {MANIFEST}: remove it, or {restore}")
        if not (d / name).is_file() or _sha256(d / name) != want[name]:
            raise ShippedFilesError(f"{d / name} does not match {MANIFEST} (missing or changed): {restore}")
    _verified.add(d)


def demo_checkpoint() -> Path:
    """The shipped demo checkpoint, verified against the manifest."""
    verify_manifest(SHIPPED_DIR)
    return SHIPPED_DIR / "checkpoint"


def demo_head(checkpoint: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The shipped head of the shipped checkpoint; for a checkpoint built by the recipes, its
    cached head, built on first use (about two minutes)."""
    if Path(checkpoint).resolve() == (SHIPPED_DIR / "checkpoint").resolve():
        verify_manifest(SHIPPED_DIR)
        return SHIPPED_DIR / "head"
    path = head_dir(checkpoint, root)
    if not is_complete(path):
        _run_builder("the demo DFlash2 head", path,
                     ["worker.dflash.train", "--quiet", "--checkpoint", str(Path(checkpoint).resolve()),
                      "--cache-dir", str(cache_root(root).resolve())])
    return path


def _run_builder(what: str, path: Path, module_args: list[str]) -> None:
    """``python -m <module_args>`` in a child interpreter of this one (from the repository root,
    so it imports this copy of worker/); raises RuntimeError when it fails or leaves ``path``
    incomplete."""
    log.info("building %s into %s in a child process (python -m %s)", what, path, " ".join(module_args))
    child = subprocess.run([sys.executable, "-m", *module_args], cwd=REPO_ROOT, capture_output=True, text=True)
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"building {what} failed (python -m {module_args[0]} exited {child.returncode}): {last}")
    if not is_complete(path):
        raise RuntimeError(f"building {what}: python -m {module_args[0]} left {path} incomplete")
