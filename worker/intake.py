"""Kafka record -> validated :class:`Job` (or a :class:`~schemas.DeadLetter`).

Order of checks (the first failure wins and becomes a dead letter with its code and field path):

1. wire decode + structural validation (:func:`schemas.decode_request_with_warnings` with the
   served ``k_values``): size (``oversize``), content type, ``unsupported_schema_version``, types
   and ranges, egomotion shapes, task requirements (``missing_egomotion``,
   ``missing_future_egomotion``, ``question``), ``k_requires_temperature``, ``k_not_served``,
   cameras x frames = image count, inline image formats and sizes;
2. claim checks: every :class:`~schemas.ImageRef` fetched through :mod:`worker.claim_check`
   (``claim_check_failed`` at ``$.images[i]``);
3. all images (inline and fetched) share one format-readable size (``bad_image`` /
   ``image_size_mismatch``), bounded per image and per request before any pixel is decoded
   (``oversize``);
4. pixel decode (``bad_image`` at ``$.images[i]`` for bytes whose header is fine but whose body
   is not).

Replay lineage: the ``attempt`` and ``replay-of`` headers that ``dlq replay`` writes are read
(:func:`replay_lineage`) into the job, its result's ``lineage`` and any dead letter; malformed
ones are ignored (with a warning on the result).

Blocking (file I/O, image decode): the service runs :meth:`Intake.process` on a worker thread.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from schemas import (
    CAMERA_IDS_BY_NAME,
    HEADER_ATTEMPT,
    HEADER_REPLAY_OF,
    TASK_CAMERA_ORDER,
    ContractError,
    DeadLetter,
    ErrorCode,
    ImageRef,
    InferRequest,
    Lineage,
    check_image_blobs,
    dead_letter_from_error,
    decode_request_with_warnings,
    header_value,
)
from worker.claim_check import ClaimCheckFetcher
from worker.config import Settings
from worker.frames import DECODER, FrameError

__all__ = ["Record", "RawRecord", "Job", "Intake", "MAX_IMAGE_PIXELS", "MAX_REQUEST_PIXELS", "MAX_ATTEMPT",
           "replay_lineage"]

MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest single image (width x height) decoded."""
MAX_REQUEST_PIXELS = 24 * 3840 * 2160
"""Largest total pixel count of one request's images (24 frames of 4K)."""
MAX_ATTEMPT = 1_000_000
"""Largest ``attempt`` header value taken (a larger or malformed one is ignored)."""
_COORDS = re.compile(r"[A-Za-z0-9._-]{1,249}:[0-9]{1,10}:[0-9]{1,19}")
"""``topic:partition:offset`` (Kafka's topic name characters and length)."""


def replay_lineage(headers: list[tuple[str, bytes]]) -> tuple[int, str | None, list[str]]:
    """(attempt, replay_of, warnings) from the ``attempt`` / ``replay-of`` headers; a malformed
    header is ignored (attempt 1, replay_of None) and named in the warnings."""
    warnings = []
    attempt, replay_of = 1, None
    raw = header_value(headers, HEADER_ATTEMPT)
    if raw is not None:
        if raw.isascii() and raw.isdigit() and len(raw) <= 7 and 1 <= int(raw) <= MAX_ATTEMPT:
            attempt = int(raw)
        else:
            warnings.append(f"header {HEADER_ATTEMPT!r} ignored: not an integer 1..{MAX_ATTEMPT}")
    raw = header_value(headers, HEADER_REPLAY_OF)
    if raw is not None:
        if _COORDS.fullmatch(raw):
            replay_of = raw
        else:
            warnings.append(f"header {HEADER_REPLAY_OF!r} ignored: not topic:partition:offset")
    return attempt, replay_of, warnings


class Record(Protocol):
    """What intake needs of a Kafka record (aiokafka's ConsumerRecord has all of it)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any
    timestamp: int | None


@dataclass(frozen=True)
class RawRecord:
    """A plain record (tests, ``run-scene``)."""

    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = None
    headers: tuple = ()
    timestamp: int | None = None


@dataclass(eq=False)
class Job:
    """One validated request, ready for the batcher."""

    request: InferRequest
    scene: Any                   # worker.model.runtime.SceneRequest
    warnings: list[str]
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: list[tuple[str, bytes]]
    value: bytes                 # kept for a dead letter if inference fails later
    received_at: float           # unix seconds when the worker fetched it
    origin_at: float             # unix seconds the queue time counts from (record time / submitted_at)
    image_prep_ms: float = 0.0   # claim-check fetch + decode in intake
    epoch: int = 0               # the partition's assignment epoch when fetched (set by the service)
    attempt: int = 1             # delivery attempt (the ``attempt`` header of a replay)
    replay_of: str | None = None  # dead letter replayed (the ``replay-of`` header)

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @property
    def group(self) -> tuple[str, int]:
        """What may share a forward batch: (task, K)."""
        return (self.request.task, self.request.num_traj_samples)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def lineage(self, worker_id: str) -> Lineage:
        """The result's lineage: source coordinates, worker, attempt, replay_of."""
        return Lineage(topic=self.topic, partition=self.partition, offset=self.offset, worker_id=worker_id,
                       attempt=self.attempt, replay_of=self.replay_of)

    def dead_letter(self, error: ContractError | BaseException, worker_id: str) -> DeadLetter:
        """The whole original value, key and headers; cut to the topic's limit when published
        (:func:`worker.output_limits.fit_dead_letter`)."""
        if isinstance(error, ContractError):
            error.with_ids(self.request.request_id, self.request.run_id)
        else:
            error = ContractError(ErrorCode.INTERNAL_ERROR, "$", f"{type(error).__name__}: {error}"[:2000],
                                  request_id=self.request.request_id, run_id=self.request.run_id)
        return dead_letter_from_error(error, value=self.value, key=self.key, headers=self.headers,
                                      topic=self.topic, partition=self.partition, offset=self.offset,
                                      worker_id=worker_id, attempt=self.attempt, replay_of=self.replay_of)


def _headers(raw: Any) -> list[tuple[str, bytes]]:
    out = []
    for item in raw or ():
        k, v = item[0], item[1]
        if isinstance(k, bytes):
            k = k.decode("utf-8", "replace")
        out.append((str(k), b"" if v is None else bytes(v)))
    return out


class Intake:
    """Turns records into jobs. ``default_seed(request_id) -> int`` seeds requests without a seed."""

    def __init__(self, settings: Settings, default_seed, fetcher: ClaimCheckFetcher | None = None,
                 max_image_pixels: int = MAX_IMAGE_PIXELS, max_request_pixels: int = MAX_REQUEST_PIXELS,
                 shrink_frame: Callable[[np.ndarray], np.ndarray] | None = None):
        self.settings = settings
        self.shrink_frame = shrink_frame      # the model's resize, so queued jobs hold small frames
        self.k_values = tuple(settings.k_values)
        self.default_seed = default_seed
        self.fetcher = fetcher if fetcher is not None else ClaimCheckFetcher(settings.claim_check_roots)
        self.max_image_pixels = max_image_pixels
        self.max_request_pixels = max_request_pixels
        self.worker_id = settings.worker_id

    # ------------------------------------------------------------------ entry point
    def process(self, record: Record, received_at: float | None = None) -> Job | DeadLetter:
        """Never raises: anything unexpected becomes an ``internal_error`` dead letter."""
        received_at = time.time() if received_at is None else received_at
        headers = _headers(getattr(record, "headers", ()))
        value = record.value
        try:
            req, warnings = decode_request_with_warnings(
                value, headers, self.settings.max_request_bytes, k_values=self.k_values)
            t0 = time.perf_counter()
            try:
                scene = self._scene(req, *self._frames(req))
            except ContractError as err:
                raise err.with_ids(req.request_id, req.run_id) from None
            except Exception as exc:
                raise ContractError(ErrorCode.INTERNAL_ERROR, "$", f"{type(exc).__name__}: {exc}"[:2000],
                                    request_id=req.request_id, run_id=req.run_id) from None
            prep_ms = (time.perf_counter() - t0) * 1000.0
        except ContractError as err:
            return self.dead_letter(err, record)
        except Exception as exc:  # a bug: never lose the record
            return self.dead_letter(exc, record)
        ts = getattr(record, "timestamp", None)
        if isinstance(ts, (int, float)) and ts > 0:
            origin = ts / 1000.0
        elif req.submitted_at is not None:
            origin = float(req.submitted_at)
        else:
            origin = received_at
        attempt, replay_of, lineage_warnings = replay_lineage(headers)
        return Job(request=req, scene=scene, warnings=warnings + lineage_warnings, topic=record.topic,
                   partition=record.partition, offset=record.offset, key=record.key, headers=headers,
                   value=bytes(value) if value is not None else b"", received_at=received_at,
                   origin_at=min(origin, received_at), image_prep_ms=prep_ms, attempt=attempt, replay_of=replay_of)

    def dead_letter(self, err: BaseException, record: Record) -> DeadLetter:
        """The dead letter of a record that failed with ``err`` (a non-ContractError -> internal_error):
        the whole original value, key and headers (cut to the topic's limit when published)."""
        headers = _headers(getattr(record, "headers", ()))
        value = record.value
        attempt, replay_of, _ = replay_lineage(headers)
        return dead_letter_from_error(
            err, value=bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None,
            key=record.key, headers=headers, topic=record.topic, partition=record.partition,
            offset=record.offset, worker_id=self.worker_id, attempt=attempt, replay_of=replay_of)

    # ------------------------------------------------------------------ images
    def _frames(self, req: InferRequest) -> tuple[np.ndarray, tuple[int, ...]]:
        """The request's images decoded (by the decoder processes, worker/frames.py) in the
        model's order, cameras by ascending id, camera-major -> ((N, H, W, 3) uint8, camera ids
        in that order); shrunk when the engine asks."""
        if req.camera_order is not None:
            cams = [CAMERA_IDS_BY_NAME[name] for name in req.camera_order]
        else:
            cams = list(TASK_CAMERA_ORDER[req.task])
        nf = req.num_frames_per_camera
        # the model reads cameras in ascending id order, camera-major: reorder whole camera blocks
        order = sorted(range(len(cams)), key=lambda c: cams[c])
        blobs: list[bytes] = []
        for i, img in enumerate(req.images):
            if isinstance(img, ImageRef):
                blobs.append(self.fetcher.fetch(img, field=f"$.images[{i}]"))
            else:
                blobs.append(img)
        sizes = check_image_blobs(blobs)           # formats + one common size, from the headers
        total = 0
        for i, (w, h) in enumerate(sizes):
            if w * h > self.max_image_pixels:
                raise ContractError(ErrorCode.OVERSIZE, f"$.images[{i}]",
                                    f"image is {w}x{h} pixels, limit {self.max_image_pixels} pixels")
            total += w * h
        if total > self.max_request_pixels:
            raise ContractError(ErrorCode.OVERSIZE, "$.images",
                                f"images hold {total} pixels in all, limit {self.max_request_pixels}")
        rank = {c: r for r, c in enumerate(order)}
        slots = [rank[i // nf] * nf + i % nf for i in range(len(blobs))]
        try:
            frames = DECODER.decode(blobs, sizes, slots, self.max_image_pixels, self.shrink_frame)
        except FrameError as exc:
            field = "$.images" if exc.index is None else f"$.images[{exc.index}]"
            raise ContractError(ErrorCode.BAD_IMAGE, field, str(exc)) from None
        return frames, tuple(cams[c] for c in order)

    # ------------------------------------------------------------------ the runtime's request
    def _scene(self, req: InferRequest, frames: np.ndarray, camera_ids: tuple[int, ...]):
        from worker.model.runtime import SceneRequest

        nf = req.num_frames_per_camera
        hist_xyz = hist_rot = fut_xyz = fut_rot = None
        if req.egomotion is not None:
            e = req.egomotion
            hist_xyz = np.asarray(e.ego_history_xyz, np.float32)
            hist_rot = _rotations(e.ego_history_rot, e.ego_history_quat, "$.egomotion")
        if req.task == "auto_labeling" and req.future_egomotion is not None:
            f = req.future_egomotion
            fut_xyz = np.asarray(f.ego_future_xyz, np.float32)
            fut_rot = _rotations(f.ego_future_rot, f.ego_future_quat, "$.future_egomotion")
        text_task = req.task != "trajectory"
        return SceneRequest(
            request_id=req.request_id, task=req.task, frames=frames,
            camera_ids=camera_ids, num_frames=nf,
            ego_history_xyz=hist_xyz, ego_history_rot=hist_rot, ego_future_xyz=fut_xyz, ego_future_rot=fut_rot,
            num_samples=req.num_traj_samples, temperature=float(req.temperature), top_p=float(req.top_p),
            top_k=req.top_k, seed=int(req.seed) if req.seed is not None else int(self.default_seed(req.request_id)),
            max_tokens=req.max_tokens if text_task else None, nav_text=req.nav_text, question=req.question)


def _rotations(mats, quats, path: str) -> np.ndarray:
    """(N, 3, 3) matrices, or (N, 4) unit quaternions [w, x, y, z] (normalised here)."""
    if mats is not None:
        return np.asarray(mats, np.float32)
    q = np.asarray(quats, np.float64)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    if not np.isfinite(q).all():
        raise ContractError(ErrorCode.BAD_EGOMOTION, path, "quaternions cannot be normalised")
    return q.astype(np.float32)
