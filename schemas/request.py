"""The request message (``alpamayo.requests``): an envelope plus the NIM ``/v1/infer`` body.

Decoding (``schemas.codec.decode_request``) enforces types and ranges through msgspec ``Meta``
constraints; :func:`validate_request` adds the checks a type system cannot express (egomotion
shapes and finiteness, image count/format/size consistency, task-dependent required fields,
served K values). Everything raises :class:`~schemas.errors.ContractError` only.

No torch/numpy import: producers use this module.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Literal, NamedTuple, get_args

import msgspec
from msgspec import Meta

from .errors import ContractError, ErrorCode

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "Task",
    "TASKS",
    "TASKS_NEEDING_EGOMOTION",
    "TASKS_NEEDING_QUESTION",
    "CameraName",
    "Camera",
    "CAMERAS",
    "CAMERA_IDS_BY_NAME",
    "DEFAULT_CAMERA_ORDER",
    "VQA_CAMERA_ORDER",
    "TASK_CAMERA_ORDER",
    "camera_names_for",
    "NUM_HISTORY_POSES",
    "NUM_FUTURE_POSES",
    "ID_PATTERN",
    "MAX_IMAGES",
    "IMAGE_CONTENT_TYPES",
    "ImageRef",
    "Egomotion",
    "FutureEgomotion",
    "InferRequest",
    "validate_request",
    "request_warnings",
    "sniff_image_format",
    "image_dimensions",
    "check_image_blobs",
    "verify_claim_check",
]

SCHEMA_VERSION: int = 1
"""The schema version this build writes."""
SUPPORTED_SCHEMA_VERSIONS: frozenset[int] = frozenset({1})
"""The schema versions this build reads."""

Task = Literal["trajectory", "meta_action", "auto_labeling", "vqa", "grounding"]
TASKS: tuple[str, ...] = get_args(Task)
TASKS_NEEDING_EGOMOTION: frozenset[str] = frozenset({"trajectory", "meta_action", "auto_labeling"})
TASKS_NEEDING_QUESTION: frozenset[str] = frozenset({"vqa", "grounding"})

NUM_HISTORY_POSES = 16
"""Ego history: 16 poses at 0.1 s, t0-1.5 s .. t0, in the ego frame at t0."""
NUM_FUTURE_POSES = 64
"""Ego future / predicted trajectory: 64 poses at 0.1 s, t0+0.1 s .. t0+6.4 s."""

ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
"""``request_id`` / ``run_id``: 1..128 characters of ``[A-Za-z0-9._:-]``."""
MAX_IMAGES = 64
IMAGE_CONTENT_TYPES: frozenset[str] = frozenset({"image/jpeg", "image/png", "image/webp", "image/bmp"})

# --------------------------------------------------------------------------------------------
# Cameras (alpamayo2-model.md 2.1/2.2, upstream common/constants.py and input_profiles.py)
# --------------------------------------------------------------------------------------------

CameraName = Literal[
    "camera_cross_left_120fov",
    "camera_front_wide_120fov",
    "camera_cross_right_120fov",
    "camera_rear_left_70fov",
    "camera_rear_tele_30fov",
    "camera_rear_right_70fov",
    "camera_front_tele_30fov",
]


class Camera(NamedTuple):
    """One camera of the 7-camera rig."""

    id: int
    """Model camera id (0..6); the prompt orders cameras by ascending id."""
    name: str
    """Dataset name, as used in ``InferRequest.camera_order``."""
    display_name: str
    """Name the prompt shows when ``include_camera_ids`` is on."""


CAMERAS: Mapping[int, Camera] = MappingProxyType(
    {
        0: Camera(0, "camera_cross_left_120fov", "Front left camera"),
        1: Camera(1, "camera_front_wide_120fov", "Front camera"),
        2: Camera(2, "camera_cross_right_120fov", "Front right camera"),
        3: Camera(3, "camera_rear_left_70fov", "Rear left camera"),
        4: Camera(4, "camera_rear_tele_30fov", "Rear camera"),
        5: Camera(5, "camera_rear_right_70fov", "Rear right camera"),
        6: Camera(6, "camera_front_tele_30fov", "Front telephoto camera"),
    }
)
"""Camera id -> (id, dataset name, display name)."""
CAMERA_IDS_BY_NAME: Mapping[str, int] = MappingProxyType({c.name: c.id for c in CAMERAS.values()})

DEFAULT_CAMERA_ORDER: tuple[int, ...] = (0, 1, 2, 3, 5, 6)
"""Camera ids of the default layout (trajectory, meta_action, auto_labeling, grounding)."""
VQA_CAMERA_ORDER: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
"""Camera ids of the VQA profile (rear_tele instead of front_tele)."""
TASK_CAMERA_ORDER: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {t: (VQA_CAMERA_ORDER if t == "vqa" else DEFAULT_CAMERA_ORDER) for t in TASKS}
)
"""Task -> camera ids used when a request has no ``camera_order``."""
DEFAULT_FRAMES_PER_CAMERA = 4


def camera_names_for(task: str, camera_order: Sequence[str] | None = None) -> list[str]:
    """The camera dataset names a request's images are laid out in (camera-major)."""
    if camera_order is not None:
        return list(camera_order)
    return [CAMERAS[i].name for i in TASK_CAMERA_ORDER.get(task, DEFAULT_CAMERA_ORDER)]


# --------------------------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------------------------

Vec = list[float]
Mat = list[list[float]]


class ImageRef(msgspec.Struct, kw_only=True, frozen=True):
    """Claim-check reference to one compressed image stored outside Kafka."""

    uri: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=4096,
            description="Where the image bytes live (file://, s3://, http(s)://, ... as the "
            "worker's claim-check fetcher supports).",
        ),
    ]
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{64}$", description="Hex SHA-256 of the image bytes.")]
    size: Annotated[int, Meta(ge=1, le=1 << 31, description="Length of the image bytes.")]
    content_type: Annotated[
        str | None,
        Meta(description="image/jpeg, image/png, image/webp or image/bmp; None = sniffed."),
    ] = None


class Egomotion(msgspec.Struct, kw_only=True, frozen=True):
    """Ego history: 16 poses at 0.1 s (t0-1.5 s .. t0), ego frame at t0, x fwd / y left / z up, metres.

    Exactly one of ``ego_history_rot`` and ``ego_history_quat`` is given.
    """

    ego_history_xyz: Annotated[list[Vec], Meta(description="16 x [x, y, z] positions in metres.")]
    ego_history_rot: Annotated[
        list[Mat] | None, Meta(description="16 row-major 3x3 rotation matrices (or use quat).")
    ] = None
    ego_history_quat: Annotated[
        list[Vec] | None, Meta(description="16 unit quaternions [w, x, y, z] (or use rot).")
    ] = None


class FutureEgomotion(msgspec.Struct, kw_only=True, frozen=True):
    """Ground-truth future: 64 poses at 0.1 s (t0+0.1 .. t0+6.4 s), ego frame at t0 (auto_labeling).

    Exactly one of ``ego_future_rot`` and ``ego_future_quat`` is given.
    """

    ego_future_xyz: Annotated[list[Vec], Meta(description="64 x [x, y, z] positions in metres.")]
    ego_future_rot: Annotated[
        list[Mat] | None, Meta(description="64 row-major 3x3 rotation matrices (or use quat).")
    ] = None
    ego_future_quat: Annotated[
        list[Vec] | None, Meta(description="64 unit quaternions [w, x, y, z] (or use rot).")
    ] = None


class InferRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One scene job. Envelope fields first, then the body of the NIM ``POST /v1/infer``."""

    # -- envelope ---------------------------------------------------------------------------
    schema_version: Annotated[
        int, Meta(description="Contract version of this message; this build reads 1.")
    ] = SCHEMA_VERSION
    request_id: Annotated[
        str,
        Meta(
            pattern=ID_PATTERN,
            description="Caller-chosen unique id (1..128 of [A-Za-z0-9._:-]); the Kafka key of the "
            "request, its result and its dead letter.",
        ),
    ]
    run_id: Annotated[
        Annotated[str, Meta(pattern=ID_PATTERN)] | None,
        Meta(description="Optional batch/run the request belongs to (same character set)."),
    ] = None
    submitted_at: Annotated[
        Annotated[float, Meta(ge=0)] | None, Meta(description="Unix seconds when the producer sent it (queue-time metrics).")
    ] = None
    labels: Annotated[
        dict[
            Annotated[str, Meta(min_length=1, max_length=128)],
            Annotated[str, Meta(max_length=1024)],
        ],
        Meta(max_length=64, description="Free string labels, copied unchanged to the result."),
    ] = {}
    # -- body (NIM /v1/infer) ---------------------------------------------------------------
    task: Annotated[
        Task, Meta(description="trajectory | meta_action | auto_labeling | vqa | grounding.")
    ] = "trajectory"
    images: Annotated[
        list[bytes | ImageRef],
        Meta(
            max_length=MAX_IMAGES,
            description="Compressed JPEG/PNG/WebP/BMP images, camera-major, oldest frame first, all "
            "the same size; each inline bytes (msgpack bin / base64 in JSON) or an ImageRef.",
        ),
    ]
    camera_order: Annotated[
        Annotated[list[CameraName], Meta(min_length=1, max_length=7)] | None,
        Meta(
            description="Camera dataset names of the image layout; None = the task's default "
            "(ids 0,1,2,3,5,6; vqa 0..5).",
        ),
    ] = None
    num_frames_per_camera: Annotated[
        int, Meta(ge=1, le=8, description="Frames per camera (oldest first).")
    ] = DEFAULT_FRAMES_PER_CAMERA
    egomotion: Annotated[
        Egomotion | None,
        Meta(description="Ego history; required for trajectory, meta_action, auto_labeling."),
    ] = None
    future_egomotion: Annotated[
        FutureEgomotion | None, Meta(description="Ground-truth future; required for auto_labeling.")
    ] = None
    num_traj_samples: Annotated[
        int, Meta(ge=1, le=16, description="K samples; must be one the deployment serves.")
    ] = 1
    temperature: Annotated[
        float, Meta(ge=0.0, le=2.0, description="Sampling temperature; 0 = greedy (K must be 1).")
    ] = 0.6
    top_p: Annotated[float, Meta(gt=0.0, le=1.0, description="Nucleus sampling mass.")] = 0.98
    top_k: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description="Top-k sampling; None = off.")] = None
    seed: Annotated[
        Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None,
        Meta(description="Sampling seed (0..2**63-1); None = the deployment's default."),
    ] = None
    max_tokens: Annotated[
        Annotated[int, Meta(ge=1, le=1024)] | None,
        Meta(description="Generated-token cap 1..1024 (not used for trajectory)."),
    ] = None
    nav_text: Annotated[
        Annotated[str, Meta(max_length=4096)] | None, Meta(description="Navigation instruction.")
    ] = None
    question: Annotated[
        Annotated[str, Meta(max_length=8192)] | None,
        Meta(description="Question (vqa) / query (grounding); required for those tasks."),
    ] = None


_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def _valid_id(value: str) -> bool:
    return 1 <= len(value) <= 128 and all(ch in _ID_CHARS for ch in value)


# --------------------------------------------------------------------------------------------
# Images: sniffing and header dimensions (no Pillow needed)
# --------------------------------------------------------------------------------------------


def sniff_image_format(data: bytes | bytearray | memoryview) -> str | None:
    """``image/jpeg`` | ``image/png`` | ``image/webp`` | ``image/bmp`` from the magic bytes, else None."""
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"BM"):
        return "image/bmp"
    return None


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def image_dimensions(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(width, height) read from the image header, or None if the header is not understood."""
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    fmt = sniff_image_format(buf)
    try:
        if fmt == "image/png":
            if bytes(buf[12:16]) != b"IHDR":
                return None
            w, h = struct.unpack(">II", bytes(buf[16:24]))
        elif fmt == "image/jpeg":
            i, n = 2, len(buf)
            while True:
                while i < n and buf[i] != 0xFF:  # tolerate fill bytes / garbage between segments
                    i += 1
                while i < n and buf[i] == 0xFF:
                    i += 1
                if i >= n:
                    return None
                marker = buf[i]
                i += 1
                if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                    continue  # standalone markers
                if marker in (0xD9, 0xDA):
                    return None  # end of image / start of scan before any frame header
                if i + 2 > n:
                    return None
                (seglen,) = struct.unpack(">H", bytes(buf[i : i + 2]))
                if marker in _JPEG_SOF:
                    if i + 7 > n:
                        return None
                    h, w = struct.unpack(">HH", bytes(buf[i + 3 : i + 7]))
                    break
                if seglen < 2:
                    return None
                i += seglen
        elif fmt == "image/webp":
            chunk = bytes(buf[12:16])
            if chunk == b"VP8 ":
                if bytes(buf[23:26]) != b"\x9d\x01\x2a":
                    return None
                w, h = struct.unpack("<HH", bytes(buf[26:30]))
                w, h = w & 0x3FFF, h & 0x3FFF
            elif chunk == b"VP8L":
                if buf[20] != 0x2F:
                    return None
                b0, b1, b2, b3 = (int(x) for x in buf[21:25])
                w = 1 + (((b1 & 0x3F) << 8) | b0)
                h = 1 + (((b3 & 0x0F) << 10) | (b2 << 2) | ((b1 & 0xC0) >> 6))
            elif chunk == b"VP8X":
                w = 1 + int.from_bytes(bytes(buf[24:27]), "little")
                h = 1 + int.from_bytes(bytes(buf[27:30]), "little")
            else:
                return None
        elif fmt == "image/bmp":
            (hdr,) = struct.unpack("<I", bytes(buf[14:18]))
            if hdr == 12:
                w, h = struct.unpack("<HH", bytes(buf[18:22]))
            else:
                w, h = struct.unpack("<ii", bytes(buf[18:26]))
            h = abs(h)
        else:
            return None
    except (struct.error, IndexError, ValueError):
        return None
    if w <= 0 or h <= 0:
        return None
    return int(w), int(h)


def check_image_blobs(
    blobs: Sequence[bytes | bytearray | memoryview | None],
    *,
    field: str = "$.images",
    expected_size: tuple[int, int] | None = None,
) -> list[tuple[int, int] | None]:
    """Check images' format and that they share one size; return each (width, height).

    ``None`` entries (e.g. claim-check images not fetched yet) are skipped. Raises
    ``bad_image`` at ``{field}[i]`` for an empty/unknown/unreadable image and
    ``image_size_mismatch`` at ``{field}[i]`` for the first image whose size differs from the first
    readable one (or from ``expected_size``).
    """
    sizes: list[tuple[int, int] | None] = []
    ref = expected_size
    for i, blob in enumerate(blobs):
        if blob is None:
            sizes.append(None)
            continue
        path = f"{field}[{i}]"
        if len(blob) == 0:
            raise ContractError(ErrorCode.BAD_IMAGE, path, "image is empty")
        fmt = sniff_image_format(blob)
        if fmt is None:
            raise ContractError(
                ErrorCode.BAD_IMAGE, path, "not a JPEG, PNG, WebP or BMP image (unknown magic bytes)"
            )
        dims = image_dimensions(blob)
        if dims is None:
            raise ContractError(ErrorCode.BAD_IMAGE, path, f"cannot read the {fmt} header")
        if ref is None:
            ref = dims
        elif dims != ref:
            raise ContractError(
                ErrorCode.IMAGE_SIZE_MISMATCH,
                path,
                f"image is {dims[0]}x{dims[1]}, expected {ref[0]}x{ref[1]} like the others",
            )
        sizes.append(dims)
    return sizes


def verify_claim_check(ref: ImageRef, data: bytes, *, field: str = "$.images") -> None:
    """Check fetched claim-check bytes against the reference (``claim_check_failed`` otherwise)."""
    import hashlib

    if len(data) != ref.size:
        raise ContractError(
            ErrorCode.CLAIM_CHECK_FAILED, field, f"{ref.uri}: expected {ref.size} bytes, got {len(data)}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256.lower():
        raise ContractError(
            ErrorCode.CLAIM_CHECK_FAILED, field, f"{ref.uri}: sha256 {digest} != {ref.sha256.lower()}"
        )


# --------------------------------------------------------------------------------------------
# Structural validation
# --------------------------------------------------------------------------------------------


def _check_matrix(rows: list, n: int, width: int, path: str, what: str) -> None:
    if len(rows) != n:
        raise ContractError(ErrorCode.BAD_EGOMOTION, path, f"{what}: expected {n} rows, got {len(rows)}")
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ContractError(
                ErrorCode.BAD_EGOMOTION, f"{path}[{i}]", f"{what}: expected {width} values, got {len(row)}"
            )
        for j, v in enumerate(row):
            if not math.isfinite(v):
                raise ContractError(ErrorCode.BAD_EGOMOTION, f"{path}[{i}][{j}]", f"{what}: {v} is not finite")


def _check_rotations(mats: list, n: int, path: str) -> None:
    if len(mats) != n:
        raise ContractError(ErrorCode.BAD_EGOMOTION, path, f"expected {n} 3x3 matrices, got {len(mats)}")
    for i, m in enumerate(mats):
        _check_matrix(m, 3, 3, f"{path}[{i}]", "rotation matrix")


def _check_quats(quats: list, n: int, path: str) -> None:
    _check_matrix(quats, n, 4, path, "quaternions [w, x, y, z]")
    for i, q in enumerate(quats):
        if math.fsum(v * v for v in q) < 1e-12:
            raise ContractError(ErrorCode.BAD_EGOMOTION, f"{path}[{i}]", "zero-norm quaternion")


def _check_poses(xyz, rot, quat, n: int, base: str, prefix: str) -> None:
    _check_matrix(xyz, n, 3, f"{base}.{prefix}_xyz", "positions [x, y, z]")
    if (rot is None) == (quat is None):
        raise ContractError(
            ErrorCode.BAD_EGOMOTION,
            base,
            f"give exactly one of {prefix}_rot and {prefix}_quat",
        )
    if rot is not None:
        _check_rotations(rot, n, f"{base}.{prefix}_rot")
    else:
        _check_quats(quat, n, f"{base}.{prefix}_quat")


def validate_request(req: InferRequest, *, k_values: Collection[int] | None = None) -> None:
    """Checks decoding cannot express. Raises :class:`ContractError`; returns None when valid.

    Order: ids, egomotion shape/finiteness, future shape, task requirements, sampling, cameras and
    image count, inline image format/size. ``k_values`` (the deployment's served K list) enables
    the ``k_not_served`` check.
    """
    if req.run_id is not None and not _valid_id(req.run_id):
        raise ContractError(ErrorCode.OUT_OF_RANGE, "$.run_id", f"run_id must match {ID_PATTERN}")
    if req.submitted_at is not None and not (math.isfinite(req.submitted_at) and req.submitted_at >= 0):
        raise ContractError(ErrorCode.OUT_OF_RANGE, "$.submitted_at", "submitted_at must be finite unix seconds >= 0")

    ego = req.egomotion
    if ego is not None:
        _check_poses(
            ego.ego_history_xyz, ego.ego_history_rot, ego.ego_history_quat,
            NUM_HISTORY_POSES, "$.egomotion", "ego_history",
        )
    fut = req.future_egomotion
    if fut is not None:
        _check_poses(
            fut.ego_future_xyz, fut.ego_future_rot, fut.ego_future_quat,
            NUM_FUTURE_POSES, "$.future_egomotion", "ego_future",
        )

    task = req.task
    if task in TASKS_NEEDING_EGOMOTION and ego is None:
        raise ContractError(ErrorCode.MISSING_EGOMOTION, "$.egomotion", f"task {task} needs egomotion")
    if task == "auto_labeling" and fut is None:
        raise ContractError(
            ErrorCode.MISSING_FUTURE_EGOMOTION, "$.future_egomotion", "task auto_labeling needs future_egomotion"
        )
    if task in TASKS_NEEDING_QUESTION and not (req.question and req.question.strip()):
        raise ContractError(ErrorCode.MISSING_FIELD, "$.question", f"task {task} needs a non-empty question")

    k = req.num_traj_samples
    if k > 1 and req.temperature == 0:
        raise ContractError(
            ErrorCode.K_REQUIRES_TEMPERATURE,
            "$.temperature",
            f"num_traj_samples={k} needs temperature > 0 (temperature 0 allows only K=1)",
        )
    if k_values is not None and k not in k_values:
        served = ",".join(str(v) for v in sorted(k_values))
        raise ContractError(ErrorCode.K_NOT_SERVED, "$.num_traj_samples", f"K={k} is not served (k_values: {served})")

    if req.camera_order is not None:
        seen: set[str] = set()
        for i, name in enumerate(req.camera_order):
            if name in seen:
                raise ContractError(ErrorCode.OUT_OF_RANGE, f"$.camera_order[{i}]", f"camera {name} listed twice")
            seen.add(name)
    if task == "meta_action":
        if req.num_frames_per_camera != DEFAULT_FRAMES_PER_CAMERA:
            raise ContractError(
                ErrorCode.OUT_OF_RANGE, "$.num_frames_per_camera", "meta_action requires exactly 4 frames per camera"
            )
        if req.camera_order is not None and req.camera_order != camera_names_for(task):
            raise ContractError(
                ErrorCode.OUT_OF_RANGE,
                "$.camera_order",
                "meta_action requires the default 6-camera layout (ids 0,1,2,3,5,6)",
            )
    n_cams = len(camera_names_for(task, req.camera_order))
    expected = n_cams * req.num_frames_per_camera
    if len(req.images) != expected:
        raise ContractError(
            ErrorCode.IMAGE_COUNT_MISMATCH,
            "$.images",
            f"expected {n_cams} cameras x {req.num_frames_per_camera} frames = {expected} images, "
            f"got {len(req.images)}",
        )

    for i, img in enumerate(req.images):
        if isinstance(img, ImageRef) and img.content_type is not None:
            if img.content_type.split(";")[0].strip().lower() not in IMAGE_CONTENT_TYPES:
                raise ContractError(
                    ErrorCode.BAD_IMAGE,
                    f"$.images[{i}].content_type",
                    f"unsupported image content type {img.content_type!r}",
                )
    check_image_blobs([img if isinstance(img, bytes) else None for img in req.images])


def request_warnings(req: InferRequest, unknown_fields: Collection[str] = ()) -> list[str]:
    """Non-fatal caveats for the result's ``warnings`` list (fields that will be ignored)."""
    out: list[str] = []
    for name in sorted(unknown_fields):
        out.append(f"unknown field {name!r} ignored")
    task = req.task
    if task == "trajectory" and req.max_tokens is not None:
        out.append("max_tokens is ignored for task trajectory")
    if task not in TASKS_NEEDING_QUESTION and req.question is not None:
        out.append(f"question is ignored for task {task}")
    if task != "auto_labeling" and req.future_egomotion is not None:
        out.append(f"future_egomotion is ignored for task {task}")
    return out
