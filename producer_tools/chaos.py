"""Reliability harness: crashes, broker faults, fuzzed input and soak against a real Kafka.

Every scenario runs the real pipeline - ``python -m worker serve`` subprocesses (a tiny random
checkpoint on CPU, reasoning capped at a few tokens), the producer tools' ``publish`` (run
manifest), ``sink`` (a ``python -m producer_tools sink`` subprocess writing the Parquet lake) and
``audit`` - injects its faults, waits until the pipeline has settled by itself (no manual step),
and prints one row of figures per run::

    python -m producer_tools.chaos crash --scenes 1000 --kills 10 --guarantee both
    python -m producer_tools.chaos broker-restart --scenes 300
    python -m producer_tools.chaos leader-kill --scenes 300
    python -m producer_tools.chaos fuzz --bad 10000 --good 200
    python -m producer_tools.chaos soak --minutes 30 --rate 2

Scenarios
---------
``crash``
    N scenes published up front; the worker is SIGKILLed ``--kills`` times at random moments
    (random progress points drawn one per equal slice of the run, plus a random delay) and
    restarted with the same static member id; optionally the sink is SIGKILLed too
    (``--sink-kills``). Settled = the worker group's committed offsets reached the request
    topic's end, the output topics are read to their end, and the lake holds every output record.
``broker-restart``
    a single-node local Kafka; mid-run the node is stopped (``--hard``: SIGKILLed), kept down
    ``--down-s`` seconds and started again.
``leader-kill``
    a 3-node KRaft cluster on loopback, topics with replication factor 3 and
    ``min.insync.replicas=2``; mid-run the leader of request partition 0 is SIGKILLed, the second
    half of the scenes is published while it is down, and it is restarted after ``--down-s``.
``fuzz``
    ``--bad`` generated bad messages (truncated msgpack, garbage, wrong types, out-of-range
    values, huge arrays, bad base64, bad JPEG/PNG, decompression bombs, NaN/inf egomotion, wrong
    image counts, unknown schema versions, oversize, claim-check escapes, ...) interleaved with
    ``--good`` valid scenes through one worker: the worker must stay up, every bad message must
    come back as a dead letter whose code is one its category allows, every good one as a
    result, and the worker's RSS (``/proc/PID/status``) must grow less than ``--max-rss-growth-mb``.
``soak``
    publishing at ``--rate`` scenes/s for ``--minutes``; the worker's (and sink's) RSS and the
    worker's ``alpamayo_gpu_memory_bytes`` are sampled; growth and slope are reported.

Figures (one row per run; ``--json`` prints them as JSON too)
-------------------------------------------------------------
``published`` request ids acknowledged (run manifest); ``results`` / ``dead letters`` rows in the
lake (fuzz: records on the topics); ``lost`` published ids with no row (``audit``'s missing);
``duplicated`` rows beyond the first per request id, *raw*, before any deduplication (at-least-once
re-deliveries; always 0 in exactly_once); ``after dedup`` the same once each table is read one row
per request id (``read_lake(..., dedupe=True)``; a request answered by a dead letter and later by
a result keeps both rows); ``lake dup`` a Kafka record present twice in the
lake (the sink's exactly-once: must be 0); ``kills`` faults injected (worker SIGKILLs + sink
SIGKILLs + broker stops); ``restarts`` processes started again (worker restarts, planned or after
an unplanned exit, sink and broker restarts); ``exits`` unplanned worker exits (a worker that gave
up by itself, restarted by the harness as a supervisor would).

The run passes (exit 0) when nothing is lost, no Kafka record is twice in the lake, exactly_once
shows no duplicate, every requested fault landed mid-run and the final SIGTERM drained the worker
(exit 0). Long runs are opt-in; the tests in ``tests/test_reliability_*.py`` run short ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import msgspec

import schemas as S
from producer_tools.common import KafkaOptions

log = logging.getLogger("alpamayo.chaos")

ROOT = Path(__file__).resolve().parents[1]
GUARANTEES = ("exactly_once", "at_least_once")
DEFAULT_PARTITIONS = 4
WORKER_INSTANCE = "chaos-w1"

__all__ = [
    "Figures", "Broker", "FuzzCase", "tiny_checkpoint", "fuzz_cases", "format_table", "run_crash",
    "run_broker_restart", "run_leader_kill", "run_fuzz", "run_soak", "rss_bytes", "main",
]


# --------------------------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (``VmRSS`` of /proc/PID/status), None when gone."""
    return _proc_status(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``)."""
    return _proc_status(pid, "VmHWM")


def _mb(n: int | float | None) -> float | None:
    return None if n is None else round(n / (1 << 20), 1)


def _source_hash() -> str:
    h = hashlib.sha256()
    for rel in ("worker/demo/layout.py", "worker/model/checkpoint.py", "worker/model/config.py",
                "worker/model/modules.py"):
        p = ROOT / rel
        h.update(rel.encode())
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()[:12]


def tiny_checkpoint(cache: str | os.PathLike | None = None) -> Path:
    """A tiny random checkpoint of the real layout (``worker.demo.layout.write_random_checkpoint``),
    cached under ``$ALPAMAYO_CACHE/chaos/`` and keyed by the model sources that shape it."""
    from worker.config import cache_dir

    base = Path(cache) if cache else cache_dir() / "chaos"
    ckpt = base / f"tiny-ckpt-{_source_hash()}"
    done = base / f"{ckpt.name}.complete"
    if done.exists() and ckpt.is_dir():
        return ckpt
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and ckpt.is_dir():
            return ckpt
        from worker.demo.layout import write_random_checkpoint

        tmp = base / f".{ckpt.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_checkpoint(tmp)
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)
        done.write_text(f"{time.time()}\n")
    return ckpt


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


@dataclass
class Figures:
    scenario: str
    guarantee: str
    published: int = 0
    results: int = 0
    dead_letters: int = 0
    answered: int = 0                 # distinct request ids with at least one output
    lost: int = 0
    duplicated: int = 0               # raw: output rows beyond the first per request id
    duplicated_after_dedup: int | None = None   # one row per request id (None: no dedup offered)
    lake_duplicates: int = 0          # one Kafka record twice in the lake
    worker_kills: int = 0
    sink_kills: int = 0
    broker_faults: int = 0
    worker_restarts: int = 0
    sink_restarts: int = 0
    broker_restarts: int = 0
    unplanned_exits: int = 0
    kills_requested: int = 0
    final_exit_code: int | None = None
    sink_exit_code: int | None = None
    wall_s: float = 0.0
    settle_s: float | None = None     # from the last fault until settled
    rss_start_mb: float | None = None
    rss_end_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_slope_mb_per_h: float | None = None
    gpu_mem_start_mb: float | None = None
    gpu_mem_end_mb: float | None = None
    sink_rss_start_mb: float | None = None
    sink_rss_end_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.worker_kills + self.sink_kills + self.broker_faults

    @property
    def restarts(self) -> int:
        return self.worker_restarts + self.sink_restarts + self.broker_restarts

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(kills=self.kills, restarts=self.restarts, ok=self.ok)
        return d

    def check(self) -> "Figures":
        """Fill ``failures`` from the figures (the guarantees each scenario promises)."""
        f = self.failures
        if self.lost:
            f.append(f"{self.lost} published request(s) have neither a result nor a dead letter")
        if self.lake_duplicates:
            f.append(f"{self.lake_duplicates} Kafka record(s) are twice in the lake")
        if self.guarantee == "exactly_once" and self.duplicated:
            f.append(f"exactly_once: {self.duplicated} duplicate output(s)")
        if self.duplicated_after_dedup:
            f.append(f"{self.duplicated_after_dedup} duplicate(s) left after deduplication")
        if self.worker_kills + self.sink_kills < self.kills_requested:
            f.append(f"only {self.worker_kills + self.sink_kills} of {self.kills_requested} kills landed mid-run")
        if self.final_exit_code not in (0, None):
            f.append(f"the final SIGTERM drain exited {self.final_exit_code}, not 0")
        if self.sink_exit_code not in (0, None):
            f.append(f"the sink's SIGTERM exit was {self.sink_exit_code}, not 0")
        return self


TABLE_COLUMNS = [
    ("scenario", lambda f: f.scenario), ("guarantee", lambda f: f.guarantee),
    ("published", lambda f: f.published), ("results", lambda f: f.results),
    ("dead letters", lambda f: f.dead_letters), ("lost", lambda f: f.lost),
    ("duplicated", lambda f: f.duplicated),
    ("after dedup", lambda f: "n/a" if f.duplicated_after_dedup is None else f.duplicated_after_dedup),
    ("lake dup", lambda f: f.lake_duplicates), ("kills", lambda f: _kills_text(f)),
    ("restarts", lambda f: _restarts_text(f)), ("exits", lambda f: f.unplanned_exits),
    ("wall s", lambda f: f"{f.wall_s:.0f}"), ("ok", lambda f: "yes" if f.ok else "NO"),
]


def _breakdown(total: int, worker: int, sink: int, broker: int) -> str:
    """'12 (10 worker, 2 sink)': the parts are named when there are several or a broker is one."""
    parts = [f"{n} {what}" for n, what in ((worker, "worker"), (sink, "sink"), (broker, "broker")) if n]
    return f"{total}" + (f" ({', '.join(parts)})" if len(parts) > 1 or broker else "")


def _kills_text(f: Figures) -> str:
    return _breakdown(f.kills, f.worker_kills, f.sink_kills, f.broker_faults)


def _restarts_text(f: Figures) -> str:
    return _breakdown(f.restarts, f.worker_restarts, f.sink_restarts, f.broker_restarts)


def format_table(figs: Iterable[Figures]) -> str:
    """The figures as a Markdown table (plus one line per failure and per RSS measurement)."""
    figs = list(figs)
    head = [c for c, _ in TABLE_COLUMNS]
    rows = [[str(fn(f)) for _, fn in TABLE_COLUMNS] for f in figs]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    for f in figs:
        mem = []
        if f.rss_start_mb is not None:
            mem.append(f"worker RSS {f.rss_start_mb} -> {f.rss_end_mb} MB (peak {f.rss_peak_mb} MB"
                       + (f", slope {f.rss_slope_mb_per_h:+.1f} MB/h" if f.rss_slope_mb_per_h is not None else "")
                       + ")")
        if f.sink_rss_start_mb is not None:
            mem.append(f"sink RSS {f.sink_rss_start_mb} -> {f.sink_rss_end_mb} MB")
        if f.gpu_mem_start_mb is not None:
            mem.append(f"GPU memory {f.gpu_mem_start_mb} -> {f.gpu_mem_end_mb} MB")
        if f.settle_s is not None:
            mem.append(f"settled {f.settle_s:.0f}s after the last fault")
        if mem:
            out.append(f"- {f.scenario}/{f.guarantee}: " + "; ".join(mem))
        for k, v in f.extra.items():
            if k.startswith("_"):
                continue
            out.append(f"- {f.scenario}/{f.guarantee}: {k}: {v}")
        for msg in f.failures:
            out.append(f"- {f.scenario}/{f.guarantee}: FAILED: {msg}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# fuzz cases: generated bad messages (and good ones) with the dead-letter codes each may get
# --------------------------------------------------------------------------------------------


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
        from worker.scenes import generate_scene
        from worker.cli import scene_request

        self.scene = generate_scene(seed)
        req = scene_request(self.scene, "trajectory", 1, request_id="base")
        self.request = req
        self.dict = msgspec.msgpack.decode(_PACK.encode(req))
        self.images = list(self.dict["images"])
        from PIL import Image

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
    import numpy as np

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


# --------------------------------------------------------------------------------------------
# Kafka: the cluster, topics, offsets
# --------------------------------------------------------------------------------------------


class Broker:
    """The cluster a scenario runs on: an external bootstrap (no fault injection) or a
    :class:`deploy.local.cluster.LocalKafka` this harness started (and stops in :meth:`close`)."""

    def __init__(self, bootstrap: str, local=None, *, owned: bool = False, user: str | None = None):
        self.bootstrap = bootstrap
        self.local = local
        self.owned = owned
        self.user = user

    @classmethod
    async def start_local(cls, name: str, nodes: int = 1, security: str = "plaintext",
                          users: dict[str, str] | None = None, timeout: float = 180.0) -> "Broker":
        from deploy.local.cluster import LocalKafka

        kafka = LocalKafka(name=name, nodes=nodes, security=security, users=users, start_timeout=timeout)
        t0 = time.monotonic()
        bootstrap = await asyncio.to_thread(kafka.start, fresh=True)
        log.info("local Kafka %r: %d node(s), %s, ready in %.1fs", name, nodes, security, time.monotonic() - t0)
        return cls(bootstrap, kafka, owned=True, user=next(iter(kafka.users), None) if kafka.users else None)

    async def close(self, remove_state: bool = True) -> None:
        if self.local is not None and self.owned:
            await asyncio.to_thread(self.local.stop)
            if remove_state:
                shutil.rmtree(self.local.state_dir, ignore_errors=True)

    @property
    def sasl(self) -> bool:
        return self.local is not None and self.local.security == "sasl_ssl"

    def client_kw(self) -> dict:
        if self.local is not None and self.sasl:
            return self.local.client_config(self.user)
        return {"bootstrap_servers": self.bootstrap}

    def env(self) -> dict[str, str]:
        """The ALPAMAYO_KAFKA_* variables for the worker and the producer tools."""
        env = {"ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap, "ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
               "ALPAMAYO_KAFKA_SASL_MECHANISM": "", "ALPAMAYO_KAFKA_SASL_USERNAME": "",
               "ALPAMAYO_KAFKA_SASL_PASSWORD": "", "ALPAMAYO_KAFKA_SSL_CAFILE": ""}
        if self.sasl:
            env.update(ALPAMAYO_KAFKA_SECURITY_PROTOCOL="SASL_SSL", ALPAMAYO_KAFKA_SASL_MECHANISM="SCRAM-SHA-512",
                       ALPAMAYO_KAFKA_SASL_USERNAME=self.user, ALPAMAYO_KAFKA_SASL_PASSWORD=self.local.users[self.user],
                       ALPAMAYO_KAFKA_SSL_CAFILE=self.local.ca_file)
        return env

    def options(self, req: str, res: str, dl: str) -> KafkaOptions:
        kw = dict(bootstrap_servers=self.bootstrap, request_topic=req, result_topic=res, dead_letter_topic=dl)
        if self.sasl:
            kw.update(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username=self.user,
                      sasl_password=self.local.users[self.user], ssl_cafile=self.local.ca_file)
        return KafkaOptions(**kw)


@dataclass
class Topics:
    req: str
    res: str
    dl: str
    partitions: int

    @classmethod
    def fresh(cls, tag: str, partitions: int) -> "Topics":
        u = f"{tag}-{os.getpid()}-{int(time.time() * 1000) % 100_000_000}"
        return cls(f"chaos.{u}.requests", f"chaos.{u}.results", f"chaos.{u}.dead-letters", partitions)


async def create_topics(broker: Broker, topics: Topics, replication_factor: int = 1,
                        max_message_bytes: int = 2 << 20) -> None:
    """The three topics through the producer tools (``topics create``)."""
    from producer_tools.topics import create_topics as create, plan_topics

    kafka = broker.options(topics.req, topics.res, topics.dl)
    plans = plan_topics(kafka, partitions=topics.partitions, replication_factor=replication_factor,
                        max_message_bytes=max_message_bytes)
    await create(kafka, plans, timeout_s=60)


async def _consumer(broker: Broker, **kw):
    from aiokafka import AIOKafkaConsumer

    c = AIOKafkaConsumer(**broker.client_kw(), enable_auto_commit=False, request_timeout_ms=15000, **kw)
    await c.start()
    return c


async def request_progress(broker: Broker, topics: Topics, group: str) -> tuple[dict[int, int], dict[int, int]]:
    """({partition: end offset} of the request topic, {partition: the group's committed offset})."""
    from aiokafka import TopicPartition

    c = await _consumer(broker, group_id=group)
    try:
        tps = [TopicPartition(topics.req, p) for p in range(topics.partitions)]
        ends = await c.end_offsets(tps)
        committed = {}
        for tp in tps:
            committed[tp.partition] = (await c.committed(tp)) or 0
        return {tp.partition: o for tp, o in ends.items()}, committed
    finally:
        await c.stop()


async def partition_leader(broker: Broker, topic: str, partition: int = 0) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**broker.client_kw())
    await admin.start()
    try:
        for _ in range(100):
            desc = await admin.describe_topics([topic])
            for p in desc[0].get("partitions", []):
                if p["partition"] == partition and p.get("leader", -1) >= 0:
                    return int(p["leader"])
            await asyncio.sleep(0.2)
    finally:
        await admin.close()
    raise RuntimeError(f"{topic}:{partition} has no leader")


# --------------------------------------------------------------------------------------------
# processes: the worker and the sink, supervised
# --------------------------------------------------------------------------------------------


class Managed:
    """A subprocess the harness starts, kills and restarts. With ``supervise`` on, an exit the
    harness did not cause is counted (``unplanned_exits``) and the process is started again after
    ``backoff`` seconds, as Kubernetes would restart a pod."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, *,
                 ready_url: Callable[[], str | None] | None = None, backoff: float = 1.0):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_dir = log_dir
        self.ready_url = ready_url
        self.backoff = backoff
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0
        self.unplanned_exits = 0
        self.exit_codes: list[int] = []
        self.supervise = False
        self._expect_exit = False
        self._task: asyncio.Task | None = None
        self._log = None
        self.rss_samples: list[tuple[float, int]] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    def log_path(self, n: int | None = None) -> Path:
        return self.log_dir / f"{self.name}-{self.starts if n is None else n}.log"

    def tail(self, n: int = 30) -> str:
        p = self.log_path()
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> None:
        self.starts += 1
        full = {**os.environ, **self.env}
        full["PYTHONPATH"] = str(ROOT) + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path(), "ab")
        self._expect_exit = False
        self.proc = subprocess.Popen(self.argv, env=full, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.info("%s: started pid %d (start #%d)", self.name, self.proc.pid, self.starts)
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def wait_ready(self, timeout: float = 300.0) -> None:
        if self.ready_url is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                if self.supervise:          # the watcher restarts it
                    await asyncio.sleep(0.2)
                    continue
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before ready:\n{self.tail()}")
            url = self.ready_url()
            try:
                ok = await asyncio.to_thread(_http_ok, url + "/v1/health/ready")
            except OSError:
                ok = False
            if ok:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    async def kill(self) -> None:
        """SIGKILL (a crash: no drain, no commit) and reap."""
        if not self.alive:
            return
        self._expect_exit = True
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait)
        self.kills += 1
        self.exit_codes.append(self.proc.returncode)
        log.info("%s: SIGKILLed (kill #%d)", self.name, self.kills)

    async def terminate(self, timeout: float = 120.0) -> int | None:
        """SIGTERM and wait for the exit code (SIGKILL after ``timeout``)."""
        self.supervise = False
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._expect_exit = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
            except TimeoutError:
                log.error("%s: no exit %.0fs after SIGTERM; killing it", self.name, timeout)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        self.exit_codes.append(self.proc.returncode)
        return self.proc.returncode

    async def close(self) -> None:
        self.supervise = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.alive:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self._log is not None:
            self._log.close()
            self._log = None

    def sample_rss(self) -> int | None:
        pid = self.pid
        v = rss_bytes(pid) if pid else None
        if v is not None:
            self.rss_samples.append((time.monotonic(), v))
        return v

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            p = self.proc
            if p is None or p.poll() is None or self._expect_exit:
                continue
            # an exit nobody asked for
            self._expect_exit = True
            self.unplanned_exits += 1
            self.exit_codes.append(p.returncode)
            log.warning("%s: exited by itself with code %s:\n%s", self.name, p.returncode, self.tail(12))
            if self.supervise:
                await asyncio.sleep(self.backoff)
                if self.supervise:
                    self.start()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _http_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.read().decode()
    except OSError:
        return None


def worker_env(broker: Broker, topics: Topics, *, checkpoint: Path, group: str, guarantee: str, port: int,
               reasoning_tokens: int = 4, batch_size: int = 4, device: str = "cpu",
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "NIM_FT_CHECKPOINT": str(checkpoint), "NIM_MODEL_PROFILE": "bf16", "NIM_PRECISION": "",
        "NIM_ALPAMAYO_SPECULATIVE_MODEL": "", "NIM_ALPAMAYO_TRAJ_SAMPLES": "1", "ALPAMAYO_DEVICE": device,
        "ALPAMAYO_REQUEST_TOPIC": topics.req, "ALPAMAYO_RESULT_TOPIC": topics.res,
        "ALPAMAYO_DEAD_LETTER_TOPIC": topics.dl, "ALPAMAYO_GROUP_ID": group,
        "ALPAMAYO_GROUP_INSTANCE_ID": WORKER_INSTANCE, "ALPAMAYO_PROCESSING_GUARANTEE": guarantee,
        "ALPAMAYO_HTTP_HOST": "127.0.0.1", "ALPAMAYO_HTTP_PORT": str(port),
        "ALPAMAYO_MAX_REASONING_TOKENS": str(reasoning_tokens), "ALPAMAYO_MAX_BATCH_SIZE": str(batch_size),
        "ALPAMAYO_MAX_BATCH_WAIT_MS": "20", "ALPAMAYO_DRAIN_TIMEOUT_S": "60", "ALPAMAYO_LOG_LEVEL": "INFO",
        "ALPAMAYO_CLAIM_CHECK_ROOTS": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    env.update(broker.env())
    env.update(extra or {})
    return env


def make_worker(broker: Broker, topics: Topics, work: Path, **kw) -> Managed:
    port = free_port()
    env = worker_env(broker, topics, port=port, **kw)
    w = Managed("worker", [sys.executable, "-m", "worker", "serve"], env, work,
                ready_url=lambda: f"http://127.0.0.1:{env['ALPAMAYO_HTTP_PORT']}")

    orig_start = w.start

    def start() -> None:           # a fresh side port per start: no TIME_WAIT surprises
        env["ALPAMAYO_HTTP_PORT"] = str(free_port())
        orig_start()

    w.start = start                # type: ignore[method-assign]
    return w


def make_sink(broker: Broker, topics: Topics, work: Path, lake: Path, group: str) -> Managed:
    argv = [sys.executable, "-m", "producer_tools", "sink", "--lake", str(lake), "--group-id", group,
            "--rotate-seconds", "1", "--session-timeout-ms", "6000", "--no-progress",
            "--bootstrap-servers", broker.bootstrap, "--result-topic", topics.res,
            "--dead-letter-topic", topics.dl]
    env = {**broker.env(), "OMP_NUM_THREADS": "1"}
    return Managed("sink", argv, env, work)


# --------------------------------------------------------------------------------------------
# the output topics, as a reader sees them (read_committed)
# --------------------------------------------------------------------------------------------


class Monitor:
    """Reads the result and dead-letter topics from the beginning (read_committed) for the whole
    run: outputs per request id and per source record, record counts, end-of-topic status."""

    def __init__(self, broker: Broker, topics: Topics, isolation: str = "read_committed"):
        self.broker = broker
        self.topics = topics
        self.isolation = isolation
        self.by_id: Counter = Counter()
        self.by_source: dict[tuple[str, int, int], list[tuple[str, str | None]]] = defaultdict(list)
        self.records = 0
        self.results = 0
        self.dead_letters = 0
        self.codes: Counter = Counter()
        self.undecodable = 0
        self.header_mismatch = 0
        self.at_end = False
        self.errors = 0
        self._task: asyncio.Task | None = None
        self._consumer = None
        self._stop = False

    @property
    def answered(self) -> int:
        return len(self.by_id)

    async def start(self) -> None:
        from aiokafka import TopicPartition

        self._consumer = await _consumer(self.broker, isolation_level=self.isolation,
                                         max_partition_fetch_bytes=8 << 20)
        self._tps = [TopicPartition(t, p) for t in (self.topics.res, self.topics.dl)
                     for p in range(self.topics.partitions)]
        self._consumer.assign(self._tps)
        await self._consumer.seek_to_beginning(*self._tps)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        from aiokafka.errors import KafkaError

        c = self._consumer
        last_check = 0.0
        while not self._stop:
            try:
                data = await c.getmany(timeout_ms=300, max_records=5000)
                for tp, recs in data.items():
                    for r in recs:
                        self._add(tp.topic, r)
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    ends = await c.end_offsets(self._tps)
                    self.at_end = all([await c.position(tp) >= ends[tp] for tp in self._tps]) and not data
            except KafkaError as exc:
                self.errors += 1
                self.at_end = False
                log.debug("monitor: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    def _add(self, topic: str, r) -> None:
        self.records += 1
        try:
            if topic == self.topics.res:
                msg = S.decode_result(r.value, list(r.headers))
                src = (msg.lineage.topic, msg.lineage.partition, msg.lineage.offset) if msg.lineage else None
                rid, code = msg.request_id, None
                self.results += 1
            else:
                msg = S.decode_dead_letter(r.value, list(r.headers))
                src = (msg.source.topic, msg.source.partition, msg.source.offset)
                rid, code = msg.request_id, msg.error_code.value
                self.dead_letters += 1
                self.codes[code] += 1
                hdr = dict((k, v) for k, v in r.headers).get("error-code")
                if hdr != code.encode():
                    self.header_mismatch += 1
        except Exception:  # noqa: BLE001 - counted, reported
            self.undecodable += 1
            return
        self.by_id[rid if rid is not None else f"@{src}"] += 1
        if src is not None:
            self.by_source[src].append(("result" if code is None else "dead_letter", code))

    async def wait_at_end(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.at_end = False
            await asyncio.sleep(1.2)
            if self.at_end:
                return True
        return False

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()


def lake_rows(lake: Path) -> int:
    """Rows in the lake's data files (results + dead letters), from the Parquet footers."""
    import pyarrow.parquet as pq

    n = 0
    for table in ("results", "dead_letters"):
        root = lake / table
        if not root.is_dir():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                if name.endswith(".parquet") and not name.startswith("."):
                    with contextlib.suppress(OSError, Exception):
                        n += pq.read_metadata(os.path.join(dirpath, name)).num_rows
    return n


# --------------------------------------------------------------------------------------------
# one pipeline run: topics, worker, sink, monitor, publish, settle, figures
# --------------------------------------------------------------------------------------------


_SCENES: list = []


def _scenes(k: int = 8) -> list:
    if not _SCENES:
        from worker.scenes import generate_scene

        _SCENES.extend(generate_scene(s) for s in range(k))
    return _SCENES


class Pipeline:
    """Topics + a supervised worker + (optionally) a sink subprocess + a monitor on the outputs.
    Use as ``async with Pipeline(...) as pl:``; figures accumulate in ``pl.fig``."""

    def __init__(self, broker: Broker, *, scenario: str, guarantee: str, work: Path,
                 partitions: int = DEFAULT_PARTITIONS, replication_factor: int = 1, checkpoint: Path | None = None,
                 reasoning_tokens: int = 4, batch_size: int = 4, sink: bool = True,
                 worker_extra: dict[str, str] | None = None, device: str | None = None):
        self.broker = broker
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.topics = Topics.fresh(scenario, partitions)
        tag = self.topics.req.split(".")[1]
        self.group = f"chaos-workers-{tag}"
        self.sink_group = f"chaos-sink-{tag}"
        self.run_id = f"chaos-{tag}"
        self.lake = self.work / "lake"
        self.runs = self.work / "runs"
        self.replication_factor = replication_factor
        self.checkpoint = checkpoint
        self.reasoning_tokens = reasoning_tokens
        self.batch_size = batch_size
        self.want_sink = sink
        self.worker_extra = dict(worker_extra or {})
        self.device = device or os.environ.get("ALPAMAYO_CHAOS_DEVICE") or "cpu"
        if checkpoint is None and os.environ.get("ALPAMAYO_CHAOS_CHECKPOINT"):
            self.checkpoint = Path(os.environ["ALPAMAYO_CHAOS_CHECKPOINT"])
        self.guarantee = guarantee
        self.fig = Figures(scenario, guarantee)
        self.fig.extra["_topics"] = (self.topics.req, self.topics.res, self.topics.dl)
        self.worker: Managed | None = None
        self.sink: Managed | None = None
        self.monitor: Monitor | None = None
        self.raw: Monitor | None = None
        self.published = 0
        self._t0 = time.monotonic()

    async def __aenter__(self) -> "Pipeline":
        await create_topics(self.broker, self.topics, self.replication_factor)
        ckpt = self.checkpoint or await asyncio.to_thread(tiny_checkpoint)
        self.worker = make_worker(self.broker, self.topics, self.work, checkpoint=ckpt, group=self.group,
                                  guarantee=self.guarantee, reasoning_tokens=self.reasoning_tokens,
                                  batch_size=self.batch_size, device=self.device, extra=self.worker_extra)
        if self.want_sink:
            self.sink = make_sink(self.broker, self.topics, self.work, self.lake, self.sink_group)
        self.monitor = Monitor(self.broker, self.topics)
        await self.monitor.start()
        if self.guarantee == "exactly_once":    # what a reader ignoring transactions would see
            self.raw = Monitor(self.broker, self.topics, isolation="read_uncommitted")
            await self.raw.start()
        self._t0 = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        for m in (self.worker, self.sink):
            if m is not None:
                await m.close()
        for mon in (self.monitor, self.raw):
            if mon is not None:
                await mon.stop()
        self.fig.wall_s = round(time.monotonic() - self._t0, 1)

    # ------------------------------------------------------------------ processes
    async def start_worker(self, timeout: float = 300.0) -> None:
        self.worker.supervise = True
        self.worker.start()
        await self.worker.wait_ready(timeout)

    def start_sink(self) -> None:
        if self.sink is not None:
            self.sink.supervise = True
            self.sink.start()

    async def restart_worker(self, timeout: float = 300.0) -> None:
        """SIGKILL, then start again (same static member id and transactional id) until ready."""
        await self.worker.kill()
        self.worker.start()
        await self.worker.wait_ready(timeout)

    async def restart_sink(self) -> None:
        await self.sink.kill()
        self.sink.start()

    # ------------------------------------------------------------------ publishing
    def items(self, start: int, stop: int) -> list:
        from producer_tools.publish import scene_item

        scenes = _scenes()
        return [scene_item(scenes[i % len(scenes)], scene_id=f"sc{i:06d}") for i in range(start, stop)]

    async def publish(self, start: int, stop: int, rate: float | None = None) -> dict:
        """Scenes ``start..stop-1`` as trajectory requests of this run (the publish tool; its run
        manifest is what ``audit`` reconciles)."""
        from producer_tools import publish as P

        kafka = self.broker.options(self.topics.req, self.topics.res, self.topics.dl)
        opts = P.PublishOptions(tasks=["trajectory"], run_id=self.run_id, runs_dir=str(self.runs), progress=False,
                                rate=rate, max_inflight=256, source=f"chaos:{self.fig.scenario}")
        summary = await P.publish(kafka, self.items(start, stop), opts)
        self.published += summary["published"]
        log.info("published %d (%d..%d) in %.1fs", summary["published"], start, stop - 1, summary.get("elapsed_s", 0))
        return summary

    # ------------------------------------------------------------------ waiting
    async def wait_answered(self, n: int, timeout: float = 600.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.monitor.answered < n:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def settle(self, timeout: float = 600.0) -> bool:
        """Until the worker group committed the whole request topic, the monitor read the output
        topics to their end and the lake holds every output record."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                ends, committed = await request_progress(self.broker, self.topics, self.group)
            except Exception as exc:  # noqa: BLE001 - the broker may be down: keep polling
                last = f"offsets unavailable ({type(exc).__name__})"
                await asyncio.sleep(1.0)
                continue
            behind = {p: ends[p] - committed.get(p, 0) for p in ends if committed.get(p, 0) < ends[p]}
            if behind:
                last = f"worker lag {behind}"
            elif not await self.monitor.wait_at_end(15):
                last = "output topics not read to the end"
            elif self.sink is not None:
                rows = await asyncio.to_thread(lake_rows, self.lake)
                if rows >= self.monitor.records:
                    return True
                last = f"lake rows {rows} < output records {self.monitor.records}"
            else:
                return True
            await asyncio.sleep(1.0)
        self.fig.failures.append(f"did not settle within {timeout:.0f}s: {last}")
        log.error("did not settle: %s\nworker:\n%s", last, self.worker.tail())
        return False

    # ------------------------------------------------------------------ the end
    async def finish(self) -> Figures:
        """SIGTERM the worker (drain) and the sink; figures from the lake, audit and the topics."""
        f = self.fig
        f.final_exit_code = await self.worker.terminate(120)
        if self.sink is not None:
            f.sink_exit_code = await self.sink.terminate(60)
        await self.monitor.stop()
        if self.raw is not None:
            await self.raw.wait_at_end(10)
            await self.raw.stop()
            aborted = self.raw.records - self.monitor.records
            raw_dup = sum(c - 1 for c in self.raw.by_id.values() if c > 1)
            f.extra["aborted outputs"] = (f"{aborted} output records of aborted transactions (a reader ignoring "
                                          f"transactions would see {raw_dup} duplicates)")
            f.extra["_aborted"] = aborted
        f.worker_restarts = self.worker.restarts
        f.unplanned_exits = self.worker.unplanned_exits
        if self.sink is not None:
            f.sink_restarts = self.sink.restarts
            f.extra["sink unplanned exits"] = self.sink.unplanned_exits
            self._lake_figures()
        elif not f.published:          # (fuzz fills its own, per message)
            self._topic_figures()
        if self.monitor.undecodable:
            f.failures.append(f"{self.monitor.undecodable} output records could not be decoded")
        if self.monitor.header_mismatch:
            f.failures.append(f"{self.monitor.header_mismatch} dead letters whose error-code header differs")
        f.wall_s = round(time.monotonic() - self._t0, 1)
        return f.check()

    def _topic_figures(self) -> None:
        f, m = self.fig, self.monitor
        f.results, f.dead_letters = m.results, m.dead_letters
        f.duplicated = sum(c - 1 for c in m.by_id.values() if c > 1)

    def _lake_figures(self) -> None:
        from producer_tools.audit import audit_run
        from producer_tools.publish import RunManifest
        from producer_tools.lake import read_lake

        f = self.fig
        cols = ["request_id", "kafka_topic", "kafka_partition", "kafka_offset"]
        res = read_lake(str(self.lake), "results", columns=cols).to_pylist()
        dls = read_lake(str(self.lake), "dead_letters", columns=cols).to_pylist()
        published = RunManifest.for_run(self.runs, self.run_id).published_ids()
        ids = Counter(r["request_id"] for r in res + dls)
        coords = Counter((r["kafka_topic"], r["kafka_partition"], r["kafka_offset"]) for r in res + dls)
        f.published = len(published)
        f.results, f.dead_letters = len(res), len(dls)
        f.answered = len(published & set(ids))
        lost = published - set(ids)
        f.lost = len(lost)
        f.duplicated = sum(c - 1 for c in ids.values() if c > 1)
        f.lake_duplicates = sum(c - 1 for c in coords.values() if c > 1)
        deduped = Counter(r["request_id"] for t in ("results", "dead_letters")
                          for r in read_lake(str(self.lake), t, columns=["request_id"], dedupe=True).to_pylist())
        f.duplicated_after_dedup = sum(c - 1 for c in deduped.values() if c > 1)
        rep = audit_run(self.run_id, str(self.lake), runs_dir=str(self.runs))
        f.extra["audit"] = ("COMPLETE" if rep.complete else "INCOMPLETE") + \
            f" (missing {len(rep.missing)}, failed {len(rep.failed)}, redelivered {len(rep.duplicated)})"
        if set(rep.missing) != lost:
            f.failures.append(f"audit's missing ({len(rep.missing)}) differs from the lake's ({len(lost)})")
        if rep.lake_duplicates:
            f.failures.append(f"audit found lake duplicates: {rep.lake_duplicates[:5]}")
        if len(res) + len(dls) != self.monitor.records:
            f.failures.append(f"the lake holds {len(res) + len(dls)} rows, the topics {self.monitor.records} records")
        if rep.unexpected:
            f.failures.append(f"{len(rep.unexpected)} unexpected request ids in the lake")
        if lost:
            f.extra["lost ids (sample)"] = sorted(lost)[:10]


def _thresholds(total: int, n: int, rng: random.Random, lo: float = 0.05, hi: float = 0.9) -> list[int]:
    """``n`` progress points in (lo, hi) of ``total``, one drawn in each equal slice."""
    if n <= 0:
        return []
    a, b = lo * total, hi * total
    step = (b - a) / n
    return [max(1, int(a + step * i + rng.uniform(0.15, 0.85) * step)) for i in range(n)]


def _work_dir(work: str | os.PathLike | None, name: str) -> Path:
    if work is not None:
        p = Path(work)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return Path(tempfile.mkdtemp(prefix=f"alpamayo-chaos-{name}-"))


# --------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------


async def run_crash(broker: Broker, *, scenes: int = 80, kills: int = 3, guarantee: str = "exactly_once",
                    sink_kills: int = 0, seed: int = 0, work: str | os.PathLike | None = None,
                    partitions: int = DEFAULT_PARTITIONS, jitter_s: float = 0.3, timeout: float = 900.0,
                    reasoning_tokens: int = 4, batch_size: int = 4) -> Figures:
    """Publish ``scenes``, SIGKILL the worker ``kills`` times (and the sink ``sink_kills`` times) at
    random moments mid-run, restart it each time; settle; sink + audit."""
    rng = random.Random(seed)
    work = _work_dir(work, "crash")
    async with Pipeline(broker, scenario="crash", guarantee=guarantee, work=work / guarantee, partitions=partitions,
                        reasoning_tokens=reasoning_tokens, batch_size=batch_size) as pl:
        pl.fig.kills_requested = kills + sink_kills
        await pl.publish(0, scenes)
        pl.start_sink()
        await pl.start_worker()
        last_fault = time.monotonic()

        async def worker_faults() -> None:
            nonlocal last_fault
            for th in _thresholds(scenes, kills, rng, hi=0.75):
                if not await pl.wait_answered(th, timeout):
                    pl.fig.failures.append(f"no progress to {th} answered before a kill")
                    return
                await asyncio.sleep(rng.uniform(0.0, jitter_s))
                if pl.monitor.answered >= scenes:
                    log.warning("kill skipped: the run is already answered")
                    return
                last_fault = time.monotonic()
                await pl.restart_worker()
                pl.fig.worker_kills += 1

        async def sink_faults() -> None:
            nonlocal last_fault
            for th in _thresholds(scenes, sink_kills, rng, lo=0.1, hi=0.95):
                if not await pl.wait_answered(th, timeout):
                    return
                await asyncio.sleep(rng.uniform(0.0, 2.0))
                if pl.monitor.answered >= scenes:
                    return
                last_fault = time.monotonic()
                await pl.restart_sink()
                pl.fig.sink_kills += 1

        await asyncio.gather(worker_faults(), sink_faults())
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


async def run_broker_restart(broker: Broker, *, scenes: int = 80, guarantee: str = "exactly_once",
                             down_s: float = 5.0, hard: bool = False, at: float = 0.3,
                             work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                             timeout: float = 900.0, reasoning_tokens: int = 4, batch_size: int = 4) -> Figures:
    """Mid-run, stop (``hard``: SIGKILL) the single broker node, keep it down ``down_s``, start it."""
    if broker.local is None:
        raise ValueError("broker-restart needs a LocalKafka the harness controls")
    node = broker.local.ids[0]
    work = _work_dir(work, "broker-restart")
    async with Pipeline(broker, scenario="broker-restart", guarantee=guarantee, work=work / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size) as pl:
        await pl.publish(0, scenes)
        pl.start_sink()
        await pl.start_worker()
        if not await pl.wait_answered(max(1, int(at * scenes)), timeout):
            pl.fig.failures.append("no progress before the broker fault")
        before = pl.monitor.answered
        t_fault = time.monotonic()
        await asyncio.to_thread(broker.local.kill_node if hard else broker.local.stop_node, node)
        pl.fig.broker_faults += 1
        pl.fig.extra["broker fault"] = f"node {node} {'SIGKILLed' if hard else 'stopped'} at {before}/{scenes} " \
                                      f"answered, down {down_s:.0f}s"
        await asyncio.sleep(down_s)
        await asyncio.to_thread(broker.local.start_node, node)
        pl.fig.broker_restarts += 1
        pl.fig.extra["broker down"] = f"{time.monotonic() - t_fault:.1f}s"
        last_fault = time.monotonic()
        if before >= scenes:
            pl.fig.failures.append("the broker fault came after the run was answered")
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


async def run_leader_kill(broker: Broker, *, scenes: int = 80, guarantee: str = "exactly_once",
                          down_s: float = 10.0, at: float = 0.3, work: str | os.PathLike | None = None,
                          partitions: int = DEFAULT_PARTITIONS, timeout: float = 900.0, reasoning_tokens: int = 4,
                          batch_size: int = 4) -> Figures:
    """3 brokers, RF 3, min ISR 2: SIGKILL the leader of request partition 0 mid-run, publish the
    second half of the scenes while it is down, restart it after ``down_s``."""
    if broker.local is None or broker.local.nodes < 3:
        raise ValueError("leader-kill needs a LocalKafka of 3 nodes the harness controls")
    work = _work_dir(work, "leader-kill")
    first = scenes // 2
    async with Pipeline(broker, scenario="leader-kill", guarantee=guarantee, work=work / guarantee,
                        partitions=partitions, replication_factor=3, reasoning_tokens=reasoning_tokens,
                        batch_size=batch_size) as pl:
        await pl.publish(0, first)
        pl.start_sink()
        await pl.start_worker()
        if not await pl.wait_answered(max(1, int(at * first)), timeout):
            pl.fig.failures.append("no progress before the broker fault")
        before = pl.monitor.answered
        leader = await partition_leader(broker, pl.topics.req, 0)
        t_fault = time.monotonic()
        await asyncio.to_thread(broker.local.kill_node, leader)
        pl.fig.broker_faults += 1
        pl.fig.extra["broker fault"] = (f"leader of {pl.topics.req.split('.')[-1]}:0 = node {leader} SIGKILLed at "
                                        f"{before}/{scenes} answered; {scenes - first} scenes published while down")
        await pl.publish(first, scenes)
        pl.fig.extra["publish during the fault"] = f"{time.monotonic() - t_fault:.1f}s for {scenes - first} scenes"
        await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t_fault)))
        await asyncio.to_thread(broker.local.start_node, leader)
        pl.fig.broker_restarts += 1
        pl.fig.extra["broker down"] = f"{time.monotonic() - t_fault:.1f}s"
        last_fault = time.monotonic()
        if before >= first:
            pl.fig.failures.append("the leader kill came after the first half was answered")
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


def _gpu_memory(url: str) -> int | None:
    text = _http_text(url + "/v1/metrics")
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("alpamayo_gpu_memory_bytes"):
            with contextlib.suppress(ValueError, IndexError):
                return int(float(line.split()[-1]))
    return None


async def run_fuzz(broker: Broker, *, bad: int = 1000, good: int = 20, seed: int = 0,
                   guarantee: str = "at_least_once", work: str | os.PathLike | None = None,
                   partitions: int = DEFAULT_PARTITIONS, max_rss_growth_mb: float = 200.0, warmup: int = 8,
                   max_request_bytes: int = 256 << 10, timeout: float = 900.0) -> Figures:
    """Bad messages of every category interleaved with good ones through one worker."""
    work = _work_dir(work, "fuzz")
    claim_root = prepare_claim_root(Path(work) / "claims")
    extra = {"ALPAMAYO_MAX_REQUEST_BYTES": str(max_request_bytes),
             "ALPAMAYO_CLAIM_CHECK_ROOTS": f"file://{claim_root}/"}
    async with Pipeline(broker, scenario="fuzz", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, sink=False, worker_extra=extra, batch_size=8) as pl:
        f = pl.fig
        from aiokafka import AIOKafkaProducer

        await pl.start_worker()
        producer = AIOKafkaProducer(**broker.client_kw(), acks="all", enable_idempotence=True, linger_ms=5,
                                    max_request_size=4 << 20)
        await producer.start()
        try:
            # warm-up: good requests until the RSS baseline is taken
            warm = list(fuzz_cases(0, warmup, seed=seed + 1, prefix="warm")) if warmup else []
            for c in warm:
                await producer.send_and_wait(pl.topics.req, c.value, key=c.key, headers=c.headers)
            if not await pl.wait_answered(len(warm), timeout):
                f.failures.append("warm-up requests were not answered")
            await asyncio.sleep(1.0)
            f.rss_start_mb = _mb(pl.worker.sample_rss())
            peak = [pl.worker.sample_rss() or 0]
            sampling = True

            async def sample() -> None:
                while sampling:
                    v = pl.worker.sample_rss()
                    if v:
                        peak[0] = max(peak[0], v)
                    await asyncio.sleep(0.25)

            sampler = asyncio.ensure_future(sample())
            t_send = time.monotonic()
            cases: dict[tuple[str, int, int], FuzzCase] = {}
            pending: list = []
            gen = fuzz_cases(bad, good, seed=seed, claim_root=claim_root, max_request_bytes=max_request_bytes)
            for c in gen:
                fut = await producer.send(pl.topics.req, c.value, key=c.key, headers=c.headers)
                pending.append((fut, c))
                if len(pending) >= 500:
                    for fu, cc in pending:
                        md = await fu
                        cases[(md.topic, md.partition, md.offset)] = cc
                    pending = []
            for fu, cc in pending:
                md = await fu
                cases[(md.topic, md.partition, md.offset)] = cc
            f.extra["send"] = f"{len(cases)} messages in {time.monotonic() - t_send:.1f}s"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all(src in pl.monitor.by_source for src in cases):
                    break
                if not pl.worker.alive and not pl.worker.supervise:
                    break
                await asyncio.sleep(0.5)
            f.extra["processed"] = f"in {time.monotonic() - t_send:.1f}s"
            await pl.monitor.wait_at_end(15)
            sampling = False
            await sampler
            f.rss_end_mb = _mb(pl.worker.sample_rss())
            hwm = peak_rss_bytes(pl.worker.pid) if pl.worker.pid else None
            f.rss_peak_mb = _mb(max(peak[0], hwm or 0))
        finally:
            await producer.stop()
        # -- verdicts per message --------------------------------------------------------------
        wrong: list[str] = []
        per_cat: dict[str, Counter] = defaultdict(Counter)
        lost = dup = 0
        for src, c in cases.items():
            outs = pl.monitor.by_source.get(src, [])
            if not outs:
                lost += 1
                per_cat[c.category]["missing"] += 1
                continue
            dup += len(outs) - 1
            _kind, code = outs[0]
            if c.good:
                ok = all(k == "result" for k, _ in outs)
            else:
                ok = all(k == "dead_letter" and cd in c.expected for k, cd in outs)
            per_cat[c.category][code or "result"] += 1
            if not ok:
                allowed = sorted(c.expected or ["result"])
                wrong.append(f"{c.category} at {src[1]}:{src[2]} -> {outs} (allowed {allowed})")
        f.published = len(cases)
        outs_all = [o for src in cases for o in pl.monitor.by_source.get(src, [])]
        f.results = sum(1 for k, _ in outs_all if k == "result")
        f.dead_letters = sum(1 for k, _ in outs_all if k == "dead_letter")
        f.extra["warm-up results (not counted)"] = len(warm)
        f.answered = len(cases) - lost
        f.lost, f.duplicated = lost, dup
        n_good_sent = sum(1 for c in cases.values() if c.good)
        f.extra["bad/good sent"] = f"{len(cases) - n_good_sent}/{n_good_sent}"
        f.extra["dead-letter codes"] = dict(sorted(pl.monitor.codes.items()))
        f.extra["_per_category"] = {k: dict(v) for k, v in sorted(per_cat.items())}
        f.extra["_wrong"] = wrong
        if wrong:
            f.failures.append(f"{len(wrong)} messages answered wrongly, e.g. {wrong[:3]}")
        if pl.worker.unplanned_exits or not pl.worker.alive:
            f.failures.append(f"the worker did not stay up ({pl.worker.unplanned_exits} unplanned exits)")
        if f.rss_start_mb is not None and f.rss_end_mb is not None:
            growth = f.rss_end_mb - f.rss_start_mb
            f.extra["RSS growth"] = f"{growth:+.1f} MB (limit {max_rss_growth_mb:.0f} MB)"
            if growth > max_rss_growth_mb:
                f.failures.append(f"worker RSS grew {growth:.0f} MB (> {max_rss_growth_mb:.0f} MB)")
        return await pl.finish()


async def run_soak(broker: Broker, *, minutes: float = 3.0, rate: float = 2.0, guarantee: str = "exactly_once",
                   work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                   sample_s: float = 5.0, warmup_fraction: float = 0.1, timeout: float = 900.0,
                   reasoning_tokens: int = 4, batch_size: int = 4) -> Figures:
    """Steady load for ``minutes``; RSS (worker, sink) and GPU memory sampled every ``sample_s``."""
    work = _work_dir(work, "soak")
    n = max(1, int(minutes * 60 * rate))
    async with Pipeline(broker, scenario="soak", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size) as pl:
        f = pl.fig
        pl.start_sink()
        await pl.start_worker()
        samples: list[tuple[float, int, int | None, int | None]] = []
        done = False

        async def sample() -> None:
            t0 = time.monotonic()
            while not done:
                w = pl.worker.sample_rss()
                s = pl.sink.sample_rss() if pl.sink else None
                g = await asyncio.to_thread(_gpu_memory, pl.worker.ready_url()) if pl.worker.alive else None
                if w:
                    samples.append((time.monotonic() - t0, w, s, g))
                await asyncio.sleep(sample_s)

        sampler = asyncio.ensure_future(sample())
        t_pub = time.monotonic()
        await pl.publish(0, n, rate=rate)
        f.extra["load"] = f"{n} scenes at {rate}/s over {(time.monotonic() - t_pub) / 60:.1f} min"
        await pl.settle(timeout)
        done = True
        await sampler
        if samples:
            t_end = samples[-1][0]
            steady = [x for x in samples if x[0] >= warmup_fraction * t_end] or samples
            f.rss_start_mb, f.rss_end_mb = _mb(steady[0][1]), _mb(steady[-1][1])
            f.rss_peak_mb = _mb(max(x[1] for x in samples))
            if len(steady) >= 3 and steady[-1][0] - steady[0][0] >= 600:   # shorter: noise, not a trend
                ts = [x[0] for x in steady]
                ys = [x[1] / (1 << 20) for x in steady]
                mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
                var = sum((t - mt) ** 2 for t in ts)
                if var > 0:
                    f.rss_slope_mb_per_h = round(sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600, 1)
            sinks = [x[2] for x in steady if x[2]]
            if sinks:
                f.sink_rss_start_mb, f.sink_rss_end_mb = _mb(sinks[0]), _mb(sinks[-1])
            gpus = [x[3] for x in steady if x[3] is not None]
            if gpus:
                f.gpu_mem_start_mb, f.gpu_mem_end_mb = _mb(gpus[0]), _mb(gpus[-1])
            f.extra["_samples"] = [(round(t, 1), _mb(w), _mb(s), _mb(g)) for t, w, s, g in samples]
        return await pl.finish()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _guarantees(text: str) -> list[str]:
    if text == "both":
        return list(GUARANTEES)
    if text not in GUARANTEES:
        raise argparse.ArgumentTypeError(f"use exactly_once, at_least_once or both, not {text!r}")
    return [text]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m producer_tools.chaos", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["crash", "broker-restart", "leader-kill", "fuzz", "soak"])
    ap.add_argument("--scenes", type=int, default=None, help="scenes to publish (crash/broker faults)")
    ap.add_argument("--kills", type=int, default=None, help="crash: worker SIGKILLs (default 3)")
    ap.add_argument("--sink-kills", type=int, default=0, help="crash: sink SIGKILLs as well (default 0)")
    ap.add_argument("--guarantee", type=_guarantees, default=None,
                    help="exactly_once | at_least_once | both (default: both for crash, exactly_once otherwise; "
                         "at_least_once for fuzz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS)
    ap.add_argument("--reasoning-tokens", type=int, default=4, help="ALPAMAYO_MAX_REASONING_TOKENS (default 4)")
    ap.add_argument("--batch-size", type=int, default=4, help="ALPAMAYO_MAX_BATCH_SIZE (default 4)")
    ap.add_argument("--down-s", type=float, default=None, help="broker faults: seconds down (default 5 / 10)")
    ap.add_argument("--hard", action="store_true", help="broker-restart: SIGKILL the node instead of stopping it")
    ap.add_argument("--bad", type=int, default=10_000, help="fuzz: bad messages (default 10000)")
    ap.add_argument("--good", type=int, default=200, help="fuzz: good messages (default 200)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=200.0, help="fuzz: allowed worker RSS growth")
    ap.add_argument("--minutes", type=float, default=30.0, help="soak: duration (default 30)")
    ap.add_argument("--rate", type=float, default=2.0, help="soak: scenes per second (default 2)")
    ap.add_argument("--checkpoint", help="NIM_FT_CHECKPOINT for the worker (default: the cached tiny random one)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="ALPAMAYO_DEVICE (default cpu)")
    ap.add_argument("--bootstrap-servers", help="use this broker (crash/fuzz/soak) instead of starting a local one")
    ap.add_argument("--work-dir", help="logs, lake, run manifests (default: a temp dir, kept on failure)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--timeout", type=float, default=1800.0, help="settle timeout per run (s)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument("-v", "--verbose", action="count", default=0)
    return ap


async def _main(args) -> list[Figures]:
    sc = args.scenario
    guarantees = args.guarantee or (list(GUARANTEES) if sc == "crash" else
                                    ["at_least_once"] if sc == "fuzz" else ["exactly_once"])
    work = _work_dir(args.work_dir, sc)
    args._work = work
    print(f"# work dir: {work}", file=sys.stderr)
    nodes = 3 if sc == "leader-kill" else 1
    if args.bootstrap_servers and sc in ("broker-restart", "leader-kill"):
        raise SystemExit(f"error: {sc} needs a local cluster the harness controls: leave out --bootstrap-servers")
    if args.checkpoint:
        os.environ["ALPAMAYO_CHAOS_CHECKPOINT"] = str(Path(args.checkpoint).resolve())
    os.environ["ALPAMAYO_CHAOS_DEVICE"] = args.device
    if args.bootstrap_servers:
        broker = Broker(args.bootstrap_servers)
    else:
        broker = await Broker.start_local(f"chaos-{sc}-{os.getpid()}", nodes=nodes)
    figs = []
    try:
        for g in guarantees:
            common = dict(guarantee=g, work=work, partitions=args.partitions, timeout=args.timeout)
            if sc == "crash":
                fig = await run_crash(broker, scenes=args.scenes or 1000,
                                      kills=10 if args.kills is None else args.kills, sink_kills=args.sink_kills,
                                      seed=args.seed, reasoning_tokens=args.reasoning_tokens,
                                      batch_size=args.batch_size, **common)
            elif sc == "broker-restart":
                fig = await run_broker_restart(broker, scenes=args.scenes or 300, down_s=args.down_s or 5.0,
                                               hard=args.hard, reasoning_tokens=args.reasoning_tokens,
                                               batch_size=args.batch_size, **common)
            elif sc == "leader-kill":
                fig = await run_leader_kill(broker, scenes=args.scenes or 300, down_s=args.down_s or 10.0,
                                            reasoning_tokens=args.reasoning_tokens, batch_size=args.batch_size,
                                            **common)
            elif sc == "fuzz":
                fig = await run_fuzz(broker, bad=args.bad, good=args.good, seed=args.seed,
                                     max_rss_growth_mb=args.max_rss_growth_mb, **common)
            else:
                fig = await run_soak(broker, minutes=args.minutes, rate=args.rate,
                                     reasoning_tokens=args.reasoning_tokens, batch_size=args.batch_size, **common)
            figs.append(fig)
            print(format_table([fig]), file=sys.stderr, flush=True)
    finally:
        await broker.close()
    return figs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL if args.verbose < 2 else logging.DEBUG)
    if args.verbose == 0:
        log.setLevel(logging.INFO)
    t0 = time.monotonic()
    try:
        figs = asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_table(figs))
    print(f"\n({args.scenario}: {time.monotonic() - t0:.0f}s in all; python -m producer_tools.chaos "
          f"{' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.json:
        print(json.dumps([f.to_json() for f in figs], indent=2, default=str))
    ok = all(f.ok for f in figs)
    work = getattr(args, "_work", None)
    if work is not None and ok and not args.keep and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif work is not None:
        print(f"# work dir kept: {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
