"""Frames: compressed camera images -> one (N, H, W, 3) uint8 array, decoded in child processes.

Why processes: on the H200 (32B shape, fp8-dflash2, 2026-12-01, docs/benchmarks.md) the
engine's batch of 16 scenes took 7.31 s alone and 8.67 s while the worker's intake decoded the
next 16 scenes' JPEGs on threads of the same process (19.68 s with intake decoding nonstop): the
engine thread waits for the interpreter lock behind the decoding threads. Here no decoding runs
in the worker's interpreter: each frame is decoded by a process of `FrameDecoder`'s pool
straight into its slot of a shared-memory file (/dev/shm), from which the worker reads the
scene's frames array (file reads release the GIL; no pickled pixels; a CPU runtime's resize
frame by frame) and drops the file at once, so
/dev/shm holds only the scenes being decoded (a few hundred MB at full HD; where it has less
room, e.g. Docker's default 64 MB, the files go to the temporary directory instead). A decoder
process that dies (a crafted image that crashes the codec) fails its request (`bad_image`), and
the pool restarts.

This module imports no torch: the decoder processes start from it alone (forkserver).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import secrets
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from PIL import Image

__all__ = ["decode_image", "ALLOWED_IMAGE_FORMATS", "FrameDecoder", "FrameError", "DECODER", "DECODE_PROCESSES",
           "DECODER_NICENESS"]

ALLOWED_IMAGE_FORMATS = {"JPEG", "PNG", "WEBP", "BMP"}
DECODE_PROCESSES = min(16, os.cpu_count() or 1)
"""Frames decoded at once (one per decoder process)."""
DECODER_NICENESS = 10
"""The decoder processes' niceness above the worker's: decoding is background work for scenes
that wait anyway, and must not take the cores the running batch needs (the engine thread that
launches it, the staging of its frames). On the H200 (16 cores, 16 decoders, 2026-12-02) the first
batch of 16 scenes after a worker started on a backlog prefilled at 598 ms a scene, the later ones
at about 348, while the decoders worked through the next scenes at equal priority."""
SHM_DIR = "/dev/shm"
SCRATCH_PREFIX = "alpamayo-frames-"  # + the writing worker's process tag (`process_tag`) + "-" + a random token
ORPHAN_AFTER_S = 60.0                # a scratch file lives < 1 s; an older one whose writer is gone is an orphan


def process_tag(pid: int) -> str | None:
    """"pid.start-time" of a running process (start time in clock ticks since boot, from
    /proc/<pid>/stat), so a later process that reuses the pid (a restarted container's PID 1)
    has another tag; None when no such process runs (or /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}.{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


_own_tag: tuple[int, str] | None = None      # (pid, tag): the scratch files' writer tag, read once per process


def _tag() -> str:
    global _own_tag
    pid = os.getpid()
    if _own_tag is None or _own_tag[0] != pid:
        _own_tag = (pid, process_tag(pid) or str(pid))
    return _own_tag[1]


def remove_orphan_scratch() -> int:
    """Delete the scratch files of workers that no longer run (killed while decoding: nothing
    else removes them) once ORPHAN_AFTER_S old; files of workers running beside this one stay
    (also those of another PID namespace sharing /dev/shm, by their age). -> how many."""
    removed, now = 0, time.time()
    for d in {SHM_DIR, tempfile.gettempdir()}:
        try:
            names = [n for n in os.listdir(d) if n.startswith(SCRATCH_PREFIX)]
        except OSError:
            continue
        for name in names:
            tag = name[len(SCRATCH_PREFIX):].rsplit("-", 1)[0]
            path = os.path.join(d, name)
            try:
                if process_tag(int(tag.split(".")[0])) != tag and now - os.stat(path).st_mtime > ORPHAN_AFTER_S:
                    os.unlink(path)
                    removed += 1
            except (OSError, ValueError):
                pass
    return removed


def _scratch_dir(nbytes: int) -> str:
    """/dev/shm when it has room for `nbytes` twice over, else the temporary directory."""
    try:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return SHM_DIR
    except OSError:
        pass
    return tempfile.gettempdir()


def decode_image(data: bytes, max_pixels: int = 4096 * 4096, max_bytes: int = 32 << 20) -> np.ndarray:
    """Compressed JPEG/PNG/WebP/BMP bytes -> (H, W, 3) uint8 RGB.

    Bounded before decoding: bytes <= max_bytes and the header's width x height <= max_pixels,
    so decompression bombs are refused without allocating. Raises ValueError with the reason.
    """
    if len(data) > max_bytes:
        raise ValueError(f"image is {len(data)} bytes, limit {max_bytes}")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in ALLOWED_IMAGE_FORMATS:
                raise ValueError(f"image format {im.format} not accepted (JPEG, PNG, WebP, BMP)")
            w, h = im.size
            if w * h > max_pixels or w < 1 or h < 1:
                raise ValueError(f"image is {w}x{h} pixels, limit {max_pixels}")
            im.draft("RGB", (w, h))
            arr = np.asarray(im.convert("RGB"))
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types for corrupt data
        raise ValueError(f"image cannot be decoded ({type(e).__name__}: {e})") from None
    if arr.shape[0] != h or arr.shape[1] != w:
        raise ValueError("image decoded to an unexpected size")
    return arr


class FrameError(ValueError):
    """Frame `index` (the request's image index; None: the request's images as a whole) could
    not be decoded: `reason`."""

    def __init__(self, index: int | None, reason: str):
        super().__init__(reason)
        self.index = index


def _decode_into(path: str, slot: int, blob: bytes, size: tuple[int, int], max_pixels: int) -> str | None:
    """In a decoder process: decode `blob` into slot `slot` of the (N, H, W, 3) file at `path`
    -> None, or why it failed."""
    try:
        arr = decode_image(blob, max_pixels=max_pixels, max_bytes=len(blob) + 1)
    except ValueError as exc:
        return str(exc)
    w, h = size
    if arr.shape[:2] != (h, w):
        return f"decoded to {arr.shape[1]}x{arr.shape[0]}, header says {w}x{h}"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, np.ascontiguousarray(arr).data, slot * h * w * 3)
    finally:
        os.close(fd)
    return None


def _read_into(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise FrameError(None, "the decoded frames were cut short")
        done += got


class FrameDecoder:
    """The worker's pool of decoder processes (one per worker process, `DECODER`), started on
    first use."""

    def __init__(self, processes: int = DECODE_PROCESSES):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload([__name__])
                self._pool = ProcessPoolExecutor(self.processes, mp_context=ctx, initializer=os.nice,
                                                 initargs=(DECODER_NICENESS,))
            return self._pool

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Start every decoder process now (the worker calls this while its model loads, so the
        first request does not wait for them), after removing the scratch files of killed workers."""
        remove_orphan_scratch()
        pool = self._executor()
        for f in [pool.submit(os.getpid) for _ in range(self.processes)]:
            f.result()

    def pids(self) -> list[int]:
        """The decoder processes now running (tests)."""
        pool = self._pool
        return [p.pid for p in (pool._processes or {}).values()] if pool is not None else []

    def decode(self, blobs: list[bytes], sizes: list[tuple[int, int]], slots: list[int], max_pixels: int,
               shrink=None) -> np.ndarray:
        """Image i (its header's (width, height) sizes[i], all equal) into slot slots[i] of one
        (N, H, W, 3) uint8 array; with `shrink` (frame -> smaller frame: the CPU runtime's resize),
        each frame is shrunk as it is read, so only one full-size frame is ever in this process's
        memory. Raises FrameError for the first failing image in request order."""
        w, h = sizes[0]
        n = len(blobs)
        nbytes = n * h * w * 3
        path = os.path.join(_scratch_dir(nbytes), f"{SCRATCH_PREFIX}{_tag()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            pool = self._executor()
            try:
                futures = [pool.submit(_decode_into, path, slots[i], blobs[i], sizes[i], max_pixels)
                           for i in range(n)]
                reasons = [f.result() for f in futures]
            except BrokenProcessPool:
                self._restart(pool)
                raise FrameError(None, "an image decoder process died decoding this request's images") from None
            for i, reason in enumerate(reasons):
                if reason is not None:
                    raise FrameError(i, reason)
            with open(os.dup(fd), "rb", buffering=0) as f:          # reads release the GIL
                frames = _read_frames(f, n, h, w, shrink)
        finally:
            os.close(fd)
            os.unlink(path)
        return frames


def _read_frames(f, n: int, h: int, w: int, shrink) -> np.ndarray:
    """n decoded (h, w, 3) frames from f -> (n, ...) array, each shrunk as it is read. shrink
    decides by a frame's size, which a request's frames share: where it keeps the first frame as
    is (no shrink, a CUDA runtime's, frames already small), the rest are read straight into one
    array, not into a fresh frame each stacked at the end: at full HD 24 allocations of 6 MB
    (each its own mapping in a serving process, `process._return_large_buffers_to_the_os`),
    unmapped again with the interpreter lock held, and a copy of the scene. (py-spy on the H200,
    2026-12-02: the intake threads held the lock in 140 of 4,000 samples of a Kafka run, 115 of
    them allocating, reading or returning those frames.)"""
    first = np.empty((h, w, 3), np.uint8)
    _read_into(f, memoryview(first).cast("B"))
    kept = first if shrink is None else shrink(first)
    if kept is first:
        frames = np.empty((n, h, w, 3), np.uint8)
        frames[0] = first
        if n > 1:
            _read_into(f, memoryview(frames[1:]).cast("B"))
        return frames
    shrunk = [kept]
    del first                                  # one full-size frame in memory at a time (kept may be a view)
    for _ in range(n - 1):                     # a fresh frame each: shrink may keep (a view of) it
        frame = np.empty((h, w, 3), np.uint8)
        _read_into(f, memoryview(frame).cast("B"))
        shrunk.append(shrink(frame))
    return np.stack(shrunk)


DECODER = FrameDecoder()
