"""The embedded demo checkpoint and its packaged DFlash2 head in the cache (``ALPAMAYO_CACHE``):
where they live, whether they are complete, and building them when they are not.

    checkpoint_dir(root) = <root>/demo-checkpoint-v<DEMO_VERSION>
    head_dir(checkpoint, root) = <root>/demo-dflash2-head-v<HEAD_VERSION>-<hash of its config and weights>

A directory is complete once its ``complete`` marker exists (the last file a builder writes).
The builders (``worker.demo.build``, ``worker.dflash.train``) are training code, which the
serving process never imports: :func:`demo_checkpoint` and :func:`demo_head` run them in a child
interpreter (``python -m worker.demo.build`` / ``python -m worker.dflash.train``) when the
directory is missing, then return it.
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

__all__ = ["DEMO_VERSION", "HEAD_VERSION", "COMPLETE_MARKER", "cache_root", "checkpoint_dir", "head_dir",
           "is_complete", "file_lock", "demo_checkpoint", "demo_head"]

log = logging.getLogger("alpamayo.engine")

DEMO_VERSION = 2        # bump whenever anything that changes the demo checkpoint's weights changes
HEAD_VERSION = 2        # bump whenever anything that changes the packaged head's weights changes
COMPLETE_MARKER = "complete"
REPO_ROOT = Path(__file__).resolve().parents[1]


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


def demo_checkpoint(root: str | os.PathLike | None = None) -> Path:
    """The embedded demo checkpoint (seed 0), built on first use (about three CPU-minutes)."""
    path = checkpoint_dir(root)
    if not is_complete(path):
        _run_builder("the embedded demo checkpoint", path,
                     ["worker.demo.build", "--quiet", "--cache-dir", str(cache_root(root).resolve())])
    return path


def demo_head(checkpoint: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The packaged DFlash2 head of the demo checkpoint, built on first use (about two minutes)."""
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
