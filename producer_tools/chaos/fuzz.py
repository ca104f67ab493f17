"""Fuzz corpus: generated bad messages (and good ones), each with the dead-letter codes it may get."""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import msgspec
import numpy as np
from PIL import Image

from worker.scenes import generate_scene
from worker.scenes.request import build_request


@dataclass
class FuzzCase:
    """One message to send. ``expected``: the dead-letter codes the worker may answer with; None
    for a good message (a result is expected)."""

    category: str
    value: bytes | None
    headers: list[tuple[str, bytes]]
    key: bytes | None
    expected: frozenset[str] | None

    @property
    def good(self) -> bool:
        return self.expected is None


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(width: int, height: int, *, bit_depth: int = 8, color_type: int = 2, body: bool = True,
              fill: int = 0) -> bytes:
    """A PNG of ``width`` x ``height`` whose pixels are all ``fill`` (zlib-streamed: a huge image
    costs only its compressed size, a few KB per 4096x4096 1-bit image). ``body=False``: header
    only (an IDAT cut short), e.g. to declare 50000x50000 without paying for it."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    row = 1 + math.ceil(width * channels * bit_depth / 8)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    out = [b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", ihdr)]
    if body:
        comp = zlib.compressobj(9)
        line = b"\x00" + bytes([fill]) * (row - 1)
        parts, block = [], line * max(1, (1 << 20) // row)
        rows_left = height
        while rows_left > 0:
            n = min(rows_left, max(1, (1 << 20) // row))
            parts.append(comp.compress(block[: n * row]))
            rows_left -= n
        parts.append(comp.flush())
        out.append(_chunk(b"IDAT", b"".join(parts)))
    else:
        out.append(_chunk(b"IDAT", zlib.compress(b"\x00" * 64)))
    out.append(_chunk(b"IEND", b""))
    return b"".join(out)


def jpeg_header(width: int, height: int) -> bytes:
    """A JPEG whose SOF0 declares ``width`` x ``height`` and that has no image data."""
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" \
        + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


def bmp_header(width: int, height: int) -> bytes:
    """A BMP whose header declares ``width`` x ``height`` (24-bit) and that has no pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40, 0, 0, 14 + 40) + info


_PACK = msgspec.msgpack.Encoder()
_JSON = msgspec.json.Encoder()
_MSGPACK_CT = [("content-type", b"application/msgpack")]
_JSON_CT = [("content-type", b"application/json")]


class _Base:
    """A valid trajectory request of a synthetic scene, as a plain dict (bytes stay bytes)."""

    def __init__(self, seed: int = 7):
        self.scene = generate_scene(seed)
        req = build_request(self.scene, "trajectory", 1, request_id="base")
        self.request = req
        self.dict = msgspec.msgpack.decode(_PACK.encode(req))
        self.images = list(self.dict["images"])
        self.size = Image.open(io.BytesIO(self.images[0])).size
        jpgs = []
        for blob in self.images:
            buf = io.BytesIO()
            Image.open(io.BytesIO(blob)).convert("RGB").save(buf, "JPEG", quality=80)
            jpgs.append(buf.getvalue())
        self.jpegs = jpgs
        w, h = self.size
        self.other_size_png = png_bytes(w + 8, h, fill=90)
        self.bomb_4k = png_bytes(4096, 4096, bit_depth=1, color_type=0)     # 16.7 Mpx, ~2 KB

    def copy(self, request_id: str) -> dict:
        d = msgspec.msgpack.decode(_PACK.encode(self.dict))
        d["request_id"] = request_id
        return d


def _pack(d: Any) -> bytes:
    return _PACK.encode(d)


def _set_path(d: dict, path: list, value) -> None:
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value


# each generator: (rng, base, rid, ctx) -> (value, headers, expected codes)
_WRONG_TYPES = [
    (["temperature"], "hot"), (["num_traj_samples"], "two"), (["images"], "not-a-list"), (["egomotion"], 7),
    (["labels"], [1, 2]), (["seed"], "x"), (["top_p"], [0.5]), (["task"], 5), (["camera_order"], 3),
    (["nav_text"], 12), (["num_frames_per_camera"], "4"), (["submitted_at"], "yesterday"),
    (["egomotion", "ego_history_xyz"], "xyz"), (["images", 3], 12345), (["labels"], {"k": 5}),
    (["max_tokens"], 1.5),
]
_OUT_OF_RANGE = [
    (["temperature"], 3.5), (["top_p"], 0.0), (["num_traj_samples"], 0), (["num_traj_samples"], 17),
    (["seed"], -5), (["request_id"], "bad id!"), (["num_frames_per_camera"], 9), (["max_tokens"], 5000),
    (["top_k"], 0), (["camera_order"], ["camera_nowhere"] * 6), (["run_id"], "spaces are not ok"),
    (["submitted_at"], -1.0), (["request_id"], "x" * 129), (["nav_text"], "n" * 5000),
]


def _g_truncated(rng, b, rid, ctx):
    enc = _pack(b.copy(rid))
    cut = int(rng.integers(1, len(enc) - 1))
    return enc[:cut], [("request-id", rid.encode())] if rng.random() < 0.5 else [], {"undecodable_bytes"}


def _g_garbage(rng, b, rid, ctx):
    n = int(rng.integers(1, 4096))
    raw = rng.bytes(n)
    return raw, [], {"undecodable_bytes", "wrong_type", "missing_field", "out_of_range",
                     "unsupported_schema_version"}


def _g_empty(rng, b, rid, ctx):
    return (None if rng.random() < 0.5 else b""), [("request-id", rid.encode())], {"undecodable_bytes"}


def _g_not_a_map(rng, b, rid, ctx):
    v = [[1, 2, 3], "a string", 42, None, 1.5, True, [b.copy(rid)]][int(rng.integers(0, 7))]
    if rng.random() < 0.3:
        return _JSON.encode(v), _JSON_CT, {"wrong_type"}
    return _pack(v), [], {"wrong_type"}


def _g_deep_nesting(rng, b, rid, ctx):
    depth = int(rng.integers(2000, 100_000))
    kind = int(rng.integers(0, 4))
    if kind == 0:        # top level: an array, not a map
        return b"[" * depth + b"]" * depth, _JSON_CT, {"undecodable_bytes", "wrong_type"}
    if kind == 1:
        return b"\x91" * depth + b"\xc0", [], {"undecodable_bytes", "wrong_type"}
    if kind == 2:        # deep inside a field of an otherwise plausible request
        head = _JSON.encode({"request_id": rid, "schema_version": 1})[:-1]
        return head + b',"labels":' + b"[" * depth + b"]" * depth + b"}", _JSON_CT, \
            {"undecodable_bytes", "wrong_type"}
    d = b.copy(rid)
    d["labels"] = "@@NEST@@"
    enc = _pack(d)
    marker = _pack("@@NEST@@")
    return enc.replace(marker, b"\x91" * depth + b"\xc0", 1), [], {"undecodable_bytes", "wrong_type"}


def _g_wrong_type(rng, b, rid, ctx):
    d = b.copy(rid)
    path, value = _WRONG_TYPES[int(rng.integers(0, len(_WRONG_TYPES)))]
    _set_path(d, path, value)
    return _pack(d), [], {"wrong_type", "bad_egomotion"} if path[0] == "egomotion" else {"wrong_type"}


def _g_out_of_range(rng, b, rid, ctx):
    d = b.copy(rid)
    path, value = _OUT_OF_RANGE[int(rng.integers(0, len(_OUT_OF_RANGE)))]
    _set_path(d, path, value)
    hdr = [("request-id", rid.encode())] if path == ["request_id"] else []
    return _pack(d), hdr, {"out_of_range"}


def _g_huge_array(rng, b, rid, ctx):
    d = b.copy(rid)
    kind = int(rng.integers(0, 5))
    # sizes stay below the broker's message limit; above the worker's limit "oversize" is right too
    if kind == 0:
        d["images"] = [b"x"] * int(rng.integers(65, 100_000))
        codes = {"out_of_range"}
    elif kind == 1:
        d["labels"] = {f"k{i}": "v" for i in range(int(rng.integers(65, 30_000)))}
        codes = {"out_of_range"}
    elif kind == 2:
        d["egomotion"]["ego_history_xyz"] = [[0.0, 0.0, 0.0]] * int(rng.integers(17, 8_000))
        codes = {"bad_egomotion"}
    elif kind == 3:
        d["camera_order"] = ["camera_front_wide_120fov"] * int(rng.integers(8, 20_000))
        codes = {"out_of_range"}
    else:
        d["egomotion"]["ego_history_rot"] = [[[1.0, 0.0, 0.0]] * 3] * int(rng.integers(17, 3_000))
        codes = {"bad_egomotion"}
    return _pack(d), [], codes | {"oversize"}


def _g_bad_base64(rng, b, rid, ctx):
    d = b.copy(rid)
    d = msgspec.json.decode(_JSON.encode(d))         # bytes -> base64 strings
    i = int(rng.integers(0, len(d["images"])))
    d["images"][i] = ["!!!not base64!!!", "QUJD=", "a", "====", "\u00e9\u00e9"][int(rng.integers(0, 5))]
    return _JSON.encode(d), _JSON_CT, {"wrong_type", "bad_image"}


def _g_bad_image(rng, b, rid, ctx):
    d = b.copy(rid)
    i = int(rng.integers(0, len(d["images"])))
    kind = int(rng.integers(0, 5))
    if kind == 0:        # JPEG magic, then garbage (which may happen to read as a header of any size)
        d["images"][i] = b"\xff\xd8\xff" + rng.bytes(int(rng.integers(0, 200)))
        return _pack(d), [], {"bad_image", "image_size_mismatch", "oversize"}
    elif kind == 1:
        d["images"][i] = b"GIF89a" + rng.bytes(40)
    elif kind == 2:
        d["images"][i] = b""
    elif kind == 3:
        good = d["images"][i]
        d["images"][i] = good[:40] + b"\x00" * (len(good) - 40)            # header fine, body garbage
    else:
        d["images"] = list(b.jpegs)
        j = b.jpegs[i]
        d["images"][i] = j[: len(j) // 2]                                  # truncated JPEG body
    return _pack(d), [], {"bad_image"}


def _g_bomb(rng, b, rid, ctx):
    d = b.copy(rid)
    kind = int(rng.integers(0, 4))
    if kind == 0:
        blob = png_bytes(50_000, 50_000, body=False)
    elif kind == 1:
        blob = jpeg_header(65_000, 65_000)
    elif kind == 2:
        blob = bmp_header(100_000, 100_000)
    else:
        blob = b.bomb_4k                     # a real one: 24 x 16.7 Mpx over the request's pixel budget
    d["images"] = [blob] * len(d["images"])
    return _pack(d), [], {"oversize"}


def _g_nonfinite(rng, b, rid, ctx):
    d = b.copy(rid)
    bad = [float("nan"), float("inf"), float("-inf")][int(rng.integers(0, 3))]
    ego = d["egomotion"]
    if rng.random() < 0.6:
        i, j = int(rng.integers(0, 16)), int(rng.integers(0, 3))
        ego["ego_history_xyz"][i][j] = bad
    else:
        i, j, k = int(rng.integers(0, 16)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
        ego["ego_history_rot"][i][j][k] = bad
    return _pack(d), [], {"bad_egomotion"}


def _g_bad_rotation(rng, b, rid, ctx):
    d = b.copy(rid)
    ego = d["egomotion"]
    kind = int(rng.integers(0, 3))
    if kind == 0:        # zero quaternions
        ego["ego_history_rot"] = None
        ego["ego_history_quat"] = [[0.0, 0.0, 0.0, 0.0]] * 16
    elif kind == 1:      # both forms
        ego["ego_history_quat"] = [[1.0, 0.0, 0.0, 0.0]] * 16
    else:                # neither
        ego["ego_history_rot"] = None
    return _pack(d), [], {"bad_egomotion"}


def _g_image_count(rng, b, rid, ctx):
    d = b.copy(rid)
    n = [0, 1, 23, 25, 48, 64][int(rng.integers(0, 6))]
    d["images"] = [d["images"][0]] * n
    return _pack(d), [], {"image_count_mismatch", "missing_field", "out_of_range"}


def _g_image_size(rng, b, rid, ctx):
    d = b.copy(rid)
    d["images"][int(rng.integers(1, len(d["images"])))] = b.other_size_png
    return _pack(d), [], {"image_size_mismatch"}


def _g_schema_version(rng, b, rid, ctx):
    d = b.copy(rid)
    d["schema_version"] = [0, 2, 3, 99, -1, 1 << 40][int(rng.integers(0, 6))]
    if rng.random() < 0.3:
        return _JSON.encode(d), _JSON_CT, {"unsupported_schema_version"}
    return _pack(d), [], {"unsupported_schema_version"}


def _g_oversize(rng, b, rid, ctx):
    d = b.copy(rid)
    limit = ctx["max_request_bytes"]
    d["padding"] = b"p" * int(limit + rng.integers(1, max(2, min(limit, ctx["oversize_room"]))))
    return _pack(d), [("request-id", rid.encode())], {"oversize"}


def _g_content_type(rng, b, rid, ctx):
    cts = [b"text/plain", b"application/xml", b"image/png", b"application/msgpack+zstd", b"json"]
    ct = cts[int(rng.integers(0, len(cts)))]
    return _pack(b.copy(rid)), [("content-type", ct)], {"unsupported_content_type"}


def _g_missing(rng, b, rid, ctx):
    d = b.copy(rid)
    kind = int(rng.integers(0, 4))
    if kind == 0:
        del d["request_id"]
        return _pack(d), [], {"missing_field"}
    if kind == 1:
        del d["images"]
        return _pack(d), [], {"missing_field"}
    if kind == 2:
        d["egomotion"] = None
        return _pack(d), [], {"missing_egomotion"}
    d["task"] = "vqa"
    d["question"] = None
    return _pack(d), [], {"missing_field"}


def _g_task_and_k(rng, b, rid, ctx):
    d = b.copy(rid)
    kind = int(rng.integers(0, 4))
    if kind == 0:
        d["task"] = ["drive", "", "TRAJECTORY", "fly"][int(rng.integers(0, 4))]
        return _pack(d), [], {"unknown_task"}
    if kind == 1:
        d["num_traj_samples"], d["temperature"] = 2, 0.0
        return _pack(d), [], {"k_requires_temperature"}
    if kind == 2:
        d["num_traj_samples"], d["temperature"] = 4, 0.7
        return _pack(d), [], {"k_not_served"}
    d["task"] = "auto_labeling"
    d["future_egomotion"] = None
    return _pack(d), [], {"missing_future_egomotion"}


def _g_claim_check(rng, b, rid, ctx):
    d = b.copy(rid)
    root = ctx["claim_root"]
    blob = d["images"][0]
    sha = hashlib.sha256(blob).hexdigest()
    uri = [f"file://{root}/../../etc/passwd", "file:///etc/passwd", f"file://{root}/%2e%2e/%2e%2e/etc/hostname",
           f"file://{root}/escape-link/passwd", f"s3://bucket{root}/img.png", f"http://127.0.0.1:1{root}/img.png",
           f"file://other-host{root}/img.png", f"file://{root}/missing.png", f"file://{root}/ok.png?x=1",
           f"ftp://example.com/{sha}.png", f"file://{root}/ok.png"][int(rng.integers(0, 11))]
    size = len(blob)
    if uri.endswith("/ok.png"):       # present inside the root, but the declared digest is wrong
        sha = "0" * 64
    d["images"][int(rng.integers(0, len(d["images"])))] = {"uri": uri, "sha256": sha, "size": size}
    return _pack(d), [], {"claim_check_failed"}


FUZZ_GENERATORS: dict[str, tuple[float, Callable]] = {
    "truncated_msgpack": (1.0, _g_truncated),
    "garbage_bytes": (1.0, _g_garbage),
    "empty_value": (0.3, _g_empty),
    "not_a_map": (0.5, _g_not_a_map),
    "deep_nesting": (0.3, _g_deep_nesting),
    "wrong_type": (1.0, _g_wrong_type),
    "out_of_range": (1.0, _g_out_of_range),
    "huge_array": (0.5, _g_huge_array),
    "bad_base64": (0.5, _g_bad_base64),
    "bad_image": (1.0, _g_bad_image),
    "decompression_bomb": (0.7, _g_bomb),
    "nonfinite_egomotion": (1.0, _g_nonfinite),
    "bad_rotation": (0.5, _g_bad_rotation),
    "image_count": (0.7, _g_image_count),
    "image_size_mismatch": (0.5, _g_image_size),
    "schema_version": (0.7, _g_schema_version),
    "oversize": (0.1, _g_oversize),
    "content_type": (0.3, _g_content_type),
    "missing_field": (0.7, _g_missing),
    "task_and_k": (0.7, _g_task_and_k),
    "claim_check_escape": (0.7, _g_claim_check),
}


def prepare_claim_root(root: str | os.PathLike) -> Path:
    """The claim-check root the fuzz run allows: one real image and a symlink escaping to /etc."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    base = _Base()
    (root / "ok.png").write_bytes(base.images[0])
    link = root / "escape-link"
    if not link.exists():
        os.symlink("/etc", link)
    return root


def fuzz_cases(n_bad: int, n_good: int, *, seed: int = 0, claim_root: str | os.PathLike = "/nonexistent",
               max_request_bytes: int = 256 << 10, oversize_room: int = 400 << 10,
               categories: Iterable[str] | None = None, prefix: str = "fz") -> Iterator[FuzzCase]:
    """``n_bad`` bad messages of every category (weighted) with ``n_good`` valid requests spread
    evenly among them. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    base = _Base()
    cats = [c for c in (categories or FUZZ_GENERATORS)]
    weights = np.array([FUZZ_GENERATORS[c][0] for c in cats], dtype=float)
    weights /= weights.sum()
    ctx = {"claim_root": str(claim_root), "max_request_bytes": max_request_bytes, "oversize_room": oversize_room}
    total = n_bad + n_good
    good_at = set(np.linspace(0, total - 1, n_good).round().astype(int).tolist()) if n_good else set()
    bad_i = good_i = 0
    for pos in range(total):
        if pos in good_at and good_i < n_good:
            rid = f"{prefix}-good-{good_i:05d}"
            d = base.copy(rid)
            d["seed"] = good_i
            good_i += 1
            yield FuzzCase("good", _pack(d), list(_MSGPACK_CT), rid.encode(), None)
            continue
        cat = cats[int(rng.choice(len(cats), p=weights))]
        rid = f"{prefix}-bad-{bad_i:05d}"
        bad_i += 1
        value, headers, codes = FUZZ_GENERATORS[cat][1](rng, base, rid, ctx)
        key = rid.encode() if rng.random() < 0.8 or value is None else None   # Kafka: a tombstone needs a key
        yield FuzzCase(cat, value, list(headers), key, frozenset(codes))
