"""Cameras and rendering: stylised camera pictures of a scene (two front chase cameras, side
and rear cameras), the lead vehicle box, deterministic PNG/JPEG encoding."""

from __future__ import annotations

import functools
import io
import math
import struct
import zlib
from typing import Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from worker.scenes.planner import history_s
from worker.scenes.road import arc_point, arc_points
from worker.scenes.structs import DEFAULT_IMAGE_SIZE, FRAME_OFFSETS_S, LANE_WIDTH, ROAD_HALF_WIDTH, SceneFacts


class _Cam:
    __slots__ = ("cid", "front", "cos", "sin", "px", "py", "f", "cx", "yh", "h", "z0", "a", "b",
                 "light_a", "light_b", "base", "W", "H")  # fmt: skip

    def __init__(self, cid: int, W: int, H: int, *, yaw_deg: float = 0.0, hfov_deg: float = 90.0,
                 px: float = 0.0, py: float = 0.0, h: float = 1.6, yh: float = 0.5,
                 front: bool = False, f_rel: float = 0.0, z0: float = 0.0, a: float = 0.0,
                 b: float = 0.0, light_a: float = 0.0, light_b: float = 0.0) -> None:  # fmt: skip
        self.cid, self.W, self.H, self.front = cid, W, H, front
        yaw = math.radians(yaw_deg)
        self.cos, self.sin = math.cos(yaw), math.sin(yaw)
        self.cx = W / 2.0
        self.yh = yh * H
        self.base = float(min(W, H))
        if front:
            # Virtual chase viewpoint z0 metres behind the ego origin; ground at x=0 maps to the
            # bottom row. Object sizes follow base * (a + b * z0 / depth).
            self.f = f_rel * W
            self.px, self.py = -z0, 0.0
            self.h = (H - self.yh) * z0 / self.f
        else:
            self.f = (W / 2.0) / math.tan(math.radians(hfov_deg) / 2.0)
            self.px, self.py, self.h = px, py, h
        self.z0, self.a, self.b, self.light_a, self.light_b = z0, a, b, light_a, light_b

    def to_cam(self, X, Y):
        dx, dy = X - self.px, Y - self.py
        return dx * self.cos + dy * self.sin, dx * self.sin - dy * self.cos


@functools.lru_cache(maxsize=16)
def _cameras(W: int, H: int) -> dict[int, _Cam]:
    return {
        0: _Cam(0, W, H, yaw_deg=60.0, hfov_deg=120.0, px=1.5, py=0.9, h=1.6, yh=0.45),
        1: _Cam(1, W, H, front=True, yh=0.42, f_rel=1.08, z0=12.0, a=0.09, b=0.30,
                light_a=0.26, light_b=0.25),
        2: _Cam(2, W, H, yaw_deg=-60.0, hfov_deg=120.0, px=1.5, py=-0.9, h=1.6, yh=0.45),
        3: _Cam(3, W, H, yaw_deg=150.0, hfov_deg=70.0, px=0.8, py=1.0, h=1.2, yh=0.45),
        4: _Cam(4, W, H, yaw_deg=180.0, hfov_deg=30.0, px=-1.0, py=0.0, h=1.5, yh=0.45),
        5: _Cam(5, W, H, yaw_deg=-150.0, hfov_deg=70.0, px=0.8, py=-1.0, h=1.2, yh=0.45),
        6: _Cam(6, W, H, front=True, yh=0.42, f_rel=3.24, z0=30.0, a=0.12, b=0.45,
                light_a=0.30, light_b=0.20),
    }  # fmt: skip


_COLORS: dict[str, tuple[int, int, int]] = {
    "white": (240, 240, 240),
    "red": (200, 25, 30),
    "blue": (30, 70, 210),
    "black": (20, 20, 24),
    "silver": (165, 170, 178),
}
_LIGHT_RGB = {"red": (255, 20, 20), "yellow": (255, 215, 0), "green": (0, 235, 80)}
_LIGHT_SLOT = {"red": 0.04, "yellow": 0.25, "green": 0.46}
_SKY = {
    ("clear", "day"): (120, 175, 235),
    ("cloudy", "day"): (170, 176, 188),
    ("rain", "day"): (125, 130, 142),
    ("clear", "dusk"): (150, 120, 170),
    ("cloudy", "dusk"): (135, 120, 145),
    ("rain", "dusk"): (100, 98, 115),
}
_GROUND = {"clear": (104, 128, 76), "cloudy": (96, 116, 74), "rain": (82, 98, 66)}
_ROAD = {"clear": (88, 88, 94), "cloudy": (84, 84, 90), "rain": (66, 66, 72)}
_LINE = (236, 236, 236)
_WINDOW = (42, 46, 58)
_BUMPER = (28, 28, 30)
_PED_SHIRT = (235, 30, 205)
_PED_LEGS = (40, 40, 70)
_PED_HEAD = (240, 200, 160)
_BARRIER = (255, 120, 0)
_HOUSING = (24, 24, 24)
_BUILDINGS = ((150, 140, 130), (120, 112, 124), (172, 160, 140), (132, 140, 150))

_NEAR = 0.5  # near clipping distance in camera depth, m


def _clip_segments(c1, r1, c2, r2):
    """Clip ground segments (camera coords) to depth >= _NEAR. Returns clipped arrays and mask."""
    ok = (c1 >= _NEAR) | (c2 >= _NEAR)
    t1 = np.where(c1 < _NEAR, (_NEAR - c1) / np.where(c2 - c1 == 0, 1e-9, c2 - c1), 0.0)
    t2 = np.where(c2 < _NEAR, (_NEAR - c2) / np.where(c1 - c2 == 0, 1e-9, c1 - c2), 0.0)
    nc1, nr1 = c1 + (c2 - c1) * t1, r1 + (r2 - r1) * t1
    nc2, nr2 = c2 + (c1 - c2) * t2, r2 + (r1 - r2) * t2
    return nc1, nr1, nc2, nr2, ok


def _clip_polygon(cs: list[float], rs: list[float]) -> list[tuple[float, float]]:
    """Sutherland-Hodgman clip of a ground polygon (camera coords) against depth >= _NEAR."""
    out: list[tuple[float, float]] = []
    n = len(cs)
    for i in range(n):
        c1, r1, c2, r2 = cs[i - 1], rs[i - 1], cs[i], rs[i]
        in1, in2 = c1 >= _NEAR, c2 >= _NEAR
        if in2:
            if not in1:
                t = (_NEAR - c1) / (c2 - c1)
                out.append((_NEAR, r1 + (r2 - r1) * t))
            out.append((c2, r2))
        elif in1:
            t = (_NEAR - c1) / (c2 - c1)
            out.append((_NEAR, r1 + (r2 - r1) * t))
    return out


def _ground_px(cam: _Cam, c: float, r: float) -> tuple[float, float]:
    return cam.cx + cam.f * r / c, cam.yh + cam.f * cam.h / c


class _World:
    """Scene geometry shared by all cameras and frames (t0 road frame)."""

    def __init__(self, f: SceneFacts, ego_s_frames: Sequence[float], rng: np.random.Generator):
        self.f = f
        self.k = f.road_curvature
        self.ego_s = list(ego_s_frames)
        k = abs(self.k)
        self.s_hi = min(150.0, 1.4 / k) if k > 1e-9 else 150.0
        s_pos = np.geomspace(1.0, self.s_hi, 22)
        self.s_line = np.concatenate((-np.geomspace(1.0, 80.0, 12)[::-1], [0.0], s_pos))
        # Roadside buildings and poles (cosmetic, static).
        self.scenery: list[tuple[float, float, float, float, tuple[int, int, int]]] = []
        for _ in range(6):
            s = float(rng.uniform(-60.0, 90.0))
            side = 1.0 if rng.random() < 0.5 else -1.0
            d = side * float(rng.uniform(9.0, 16.0))
            w, h = float(rng.uniform(5.0, 12.0)), float(rng.uniform(4.0, 12.0))
            col = _BUILDINGS[int(rng.integers(len(_BUILDINGS)))]
            self.scenery.append((s, d, w, h, col))


def _draw_static(cam: _Cam, world: _World, sky, ground, road) -> Image.Image:
    W, H = cam.W, cam.H
    img = Image.new("RGB", (W, H), sky)
    dr = ImageDraw.Draw(img)
    dr.rectangle((0, int(round(cam.yh)), W, H), fill=ground)
    s = world.s_line
    if cam.front:
        s = s[s > -cam.z0 + 1.0]
    xl, yl = arc_points(world.k, s, ROAD_HALF_WIDTH)
    xr, yr = arc_points(world.k, s, -ROAD_HALF_WIDTH)
    cl, rl = cam.to_cam(xl, yl)
    cr, rr = cam.to_cam(xr, yr)
    poly = _clip_polygon(
        cl.tolist() + cr[::-1].tolist(), rl.tolist() + rr[::-1].tolist()
    )
    if len(poly) >= 3:
        dr.polygon([_ground_px(cam, c, r) for c, r in poly], fill=road)
    lw = max(1, int(round(W / 220)))
    for c_arr, r_arr in ((cl, rl), (cr, rr)):
        c1, r1, c2, r2, ok = _clip_segments(c_arr[:-1], r_arr[:-1], c_arr[1:], r_arr[1:])
        for i in np.flatnonzero(ok).tolist():
            dr.line((_ground_px(cam, c1[i], r1[i]), _ground_px(cam, c2[i], r2[i])), fill=_LINE, width=lw)
    return img


def _obj_rect(cam: _Cam, c: float, r: float, kind: str, w_m: float = 1.9, h_m: float = 1.5):
    """Pixel rectangle (x1, y1, x2, y2) of a billboard object standing at camera coords (c, r)."""
    col, row = _ground_px(cam, c, r)
    if cam.front:
        w = cam.base * (cam.a + cam.b * cam.z0 / c)
        if kind == "vehicle":
            ww, hh = w, 0.8 * w
        elif kind == "pedestrian":
            ww, hh = 0.42 * w, 1.1 * w
        elif kind == "barrier":
            ww, hh = 1.1 * w, 0.5 * w
        else:  # building: plain perspective
            ww, hh = cam.f * w_m / c, cam.f * h_m / c
    else:
        ww, hh = 1.3 * cam.f * w_m / c, 1.3 * cam.f * h_m / c
    return col - ww / 2.0, row - hh, col + ww / 2.0, row


def front_box_norm(k: float, s: float, d: float, kind: str) -> tuple[float, float, float, float] | None:
    """Box of an object at (s, d) in the front-wide camera, normalised to [0, 1] (no clipping)."""
    cam = _cameras(1000, 1000)[1]
    x, y = arc_point(k, s, d)
    c, r = cam.to_cam(x, y)
    if c < _NEAR:
        return None
    x1, y1, x2, y2 = _obj_rect(cam, c, r, kind)
    return x1 / 1000.0, y1 / 1000.0, x2 / 1000.0, y2 / 1000.0


def lead_bbox(f: SceneFacts, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE) -> tuple[int, int, int, int] | None:
    """The lead vehicle's box in the front-wide camera, last frame (t0), Qwen 0-1000 scale."""
    if not f.lead_present:
        return None
    W, H = image_size
    cam = _cameras(W, H)[1]
    x, y = arc_point(f.road_curvature, f.lead_gap, 0.0)
    c, r = cam.to_cam(x, y)
    x1, y1, x2, y2 = _obj_rect(cam, c, r, "vehicle")
    x1, x2 = min(max(x1, 0.0), W), min(max(x2, 0.0), W)
    y1, y2 = min(max(y1, 0.0), H), min(max(y2, 0.0), H)
    return (
        int(round(x1 / W * 1000)), int(round(y1 / H * 1000)),
        int(round(x2 / W * 1000)), int(round(y2 / H * 1000)),
    )  # fmt: skip


def _draw_vehicle(dr: ImageDraw.ImageDraw, box, color) -> None:
    x1, y1, x2, y2 = box
    h = y2 - y1
    dr.rectangle((x1, y1, x2, y2), fill=color)
    dr.rectangle((x1 + 0.12 * (x2 - x1), y1 + 0.1 * h, x2 - 0.12 * (x2 - x1), y1 + 0.42 * h), fill=_WINDOW)
    dr.rectangle((x1, y2 - 0.12 * h, x2, y2), fill=_BUMPER)


def _draw_pedestrian(dr: ImageDraw.ImageDraw, box) -> None:
    x1, y1, x2, y2 = box
    h, w = y2 - y1, x2 - x1
    dr.rectangle((x1 + 0.2 * w, y1, x2 - 0.2 * w, y1 + 0.2 * h), fill=_PED_HEAD)
    dr.rectangle((x1, y1 + 0.2 * h, x2, y1 + 0.6 * h), fill=_PED_SHIRT)
    dr.rectangle((x1 + 0.1 * w, y1 + 0.6 * h, x2 - 0.1 * w, y2), fill=_PED_LEGS)


def _draw_barrier(dr: ImageDraw.ImageDraw, box) -> None:
    x1, y1, x2, y2 = box
    dr.rectangle(box, fill=_BARRIER)
    w = x2 - x1
    for u in (0.2, 0.6):
        dr.rectangle((x1 + u * w, y1, x1 + (u + 0.2) * w, y2), fill=(250, 250, 250))


def _draw_frame(cam: _Cam, world: _World, static: Image.Image, frame: int) -> Image.Image:
    f = world.f
    img = static.copy()
    dr = ImageDraw.Draw(img)
    t = FRAME_OFFSETS_S[frame]
    es = world.ego_s[frame]  # ego along-road position at this frame (<= 0)
    k = world.k
    W = cam.W
    lw = max(1, int(round(W / 220)))

    # Dashed lane boundaries (4 m dashes every 12 m, fixed in the world -> they move with ego).
    lo = -80.0 if not cam.front else -cam.z0 + 1.0
    first = math.floor((lo + es) / 12.0) * 12.0
    starts = np.arange(first, es + world.s_hi, 12.0) - es
    if starts.size:
        ends = np.minimum(starts + 4.0, world.s_hi)
        for dlat in (0.5 * LANE_WIDTH, -0.5 * LANE_WIDTH):
            xa, ya = arc_points(k, starts, dlat)
            xb, yb = arc_points(k, ends, dlat)
            ca, ra = cam.to_cam(xa, ya)
            cb, rb = cam.to_cam(xb, yb)
            c1, r1, c2, r2, ok = _clip_segments(ca, ra, cb, rb)
            for i in np.flatnonzero(ok).tolist():
                dr.line((_ground_px(cam, c1[i], r1[i]), _ground_px(cam, c2[i], r2[i])), fill=_LINE, width=lw)

    # Ground markings: stop line and crosswalk.
    quads = []
    if f.traffic_light != "none":
        sl = f.stop_line_distance - es
        quads.append((sl - 0.5, sl + 0.5, -ROAD_HALF_WIDTH, ROAD_HALF_WIDTH))
    if f.pedestrian_crossing:
        pc = f.pedestrian_distance - es
        for j in range(7):
            d0 = -ROAD_HALF_WIDTH + j * 1.5
            quads.append((pc - 1.5, pc + 1.5, d0, d0 + 0.8))
    for s0, s1, d0, d1 in quads:
        xs, ys = [], []
        for s, d in ((s0, d0), (s1, d0), (s1, d1), (s0, d1)):
            x, y = arc_point(k, s, d)
            xs.append(x)
            ys.append(y)
        cc, rr = cam.to_cam(np.array(xs), np.array(ys))
        poly = _clip_polygon(cc.tolist(), rr.tolist())
        if len(poly) >= 3:
            dr.polygon([_ground_px(cam, c, r) for c, r in poly], fill=_LINE)

    # Billboard objects, painted far to near.
    objs: list[tuple[float, float, float, str, object, float, float]] = []

    def add(s: float, d: float, kind: str, payload: object, w_m: float = 1.9, h_m: float = 1.5):
        x, y = arc_point(k, s, d)
        if cam.front and x < 1.0:
            return
        c, r = cam.to_cam(x, y)
        if c < 1.0:
            return
        objs.append((c, r, s, kind, payload, w_m, h_m))

    # Apparent width of a vehicle: rear face for cameras looking along the road, side otherwise.
    side_w = 1.9 * abs(cam.cos) + 4.5 * abs(cam.sin)
    for s, d, w, h, col in world.scenery:
        add(s - es, d, "building", col, w, h)
    for ov in f.other_vehicles:
        dlat = {"left": LANE_WIDTH, "right": -LANE_WIDTH, "ego": 0.0}[ov.lane]
        add(ov.offset + ov.speed * t - es, dlat, "vehicle", _COLORS[ov.color], side_w, 1.5)
    if f.blocked_lane:
        dlat = 0.0
        if f.blocked_lane_kind == "adjacent":
            dlat = LANE_WIDTH if f.blocked_lane_side == "left" else -LANE_WIDTH
        add(f.blocked_distance - es, dlat, "barrier", None, 3.0, 1.2)
    if f.pedestrian_crossing:
        direction = -1.0 if f.pedestrian_side == "left" else 1.0  # left -> walking right
        d_ped = -direction * 2.0 + direction * 1.2 * t
        add(f.pedestrian_distance - es, d_ped, "pedestrian", None, 0.6, 1.75)
    if f.lead_present:
        add(f.lead_gap + f.lead_speed * t - es, 0.0, "vehicle", _COLORS[f.lead_color], side_w, 1.5)

    objs.sort(key=lambda o: -o[0])
    for c, r, s, kind, payload, w_m, h_m in objs:
        box = _obj_rect(cam, c, r, kind, w_m, h_m)
        if box[2] < 0 or box[0] > W or box[3] < 0 or box[1] > cam.H:
            continue
        if kind == "vehicle":
            _draw_vehicle(dr, box, payload)
        elif kind == "pedestrian":
            _draw_pedestrian(dr, box)
        elif kind == "barrier":
            _draw_barrier(dr, box)
        else:
            dr.rectangle(box, fill=payload, outline=(70, 70, 70))

    # Traffic light: a large housing with one big lit lamp (red top, yellow middle, green
    # bottom), in the top-right region above the horizon so it never hides road objects.
    if cam.front and f.traffic_light != "none":
        sl = f.stop_line_distance - es
        x, y = arc_point(k, sl, -0.8 * LANE_WIDTH)
        c, r = cam.to_cam(x, y)
        if c > 1.0:
            hh = min(cam.base * (cam.light_a + cam.light_b * cam.z0 / c), cam.yh - 0.05 * cam.H)
            hw = 0.8 * hh
            col = cam.cx + cam.f * r / c
            col = min(max(col, 0.62 * W), 0.92 * W - hw / 2.0)
            x1, y1 = col - hw / 2.0, 0.02 * cam.H
            dr.rectangle((x1, y1, x1 + hw, y1 + hh), fill=_HOUSING)
            ly = y1 + _LIGHT_SLOT[f.traffic_light] * hh
            dr.rectangle((x1 + 0.1 * hw, ly, x1 + 0.9 * hw, ly + 0.5 * hh), fill=_LIGHT_RGB[f.traffic_light])
    return img


@functools.lru_cache(maxsize=4)
def _noise_tile(W: int, H: int, amp: int) -> np.ndarray:
    """Fixed sparse sensor speckle (about 2% of the samples are off by up to +-amp)."""
    rng = np.random.default_rng(20240229)
    vals = rng.integers(-amp, amp + 1, size=(H, W + 61, 3), dtype=np.int16)
    return np.where(rng.random((H, W + 61, 3)) < 0.02, vals, 0).astype(np.int16)


def _encode_png(arr: np.ndarray) -> bytes:
    """Minimal deterministic PNG writer (RGB8, filter 0, zlib level 1)."""
    h, w, _ = arr.shape
    raw = np.empty((h, w * 3 + 1), np.uint8)
    raw[:, 0] = 0
    raw[:, 1:] = arr.reshape(h, w * 3)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 1))
        + chunk(b"IEND", b"")
    )


def _encode(img: Image.Image, image_format: str, noise: int, offset: int, jpeg_quality: int) -> bytes:
    if noise > 0 or image_format == "png":
        arr = np.asarray(img)
        if noise > 0:
            W, H = img.size
            o = offset % 61
            arr = np.clip(arr + _noise_tile(W, H, noise)[:, o : o + W], 0, 255).astype(np.uint8)
        if image_format == "png":
            return _encode_png(arr)
        img = Image.fromarray(arr)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=jpeg_quality)
    return buf.getvalue()


def render_images(f: SceneFacts, camera_ids: Iterable[int], image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
                  *, seed: int = 0, image_format: str = "png", noise: int | None = None,
                  jpeg_quality: int = 90) -> dict[int, list[bytes]]:  # fmt: skip
    """Encoded frames (oldest first) per camera id. Deterministic in (facts, seed, options)."""
    if image_format not in ("png", "jpeg"):
        raise ValueError(f"image_format must be 'png' or 'jpeg', not {image_format!r}")
    W, H = int(image_size[0]), int(image_size[1])
    if W < 16 or H < 16:
        raise ValueError(f"image_size too small: {image_size}")
    if noise is None:
        noise = 0 if W * H <= 256 * 256 else 4
    rng = np.random.default_rng([seed, 0x5CE7E])
    ego_s = [history_s(f.ego_speed, f.ego_accel, t) if t < 0 else 0.0 for t in FRAME_OFFSETS_S]
    world = _World(f, ego_s, rng)
    cams = _cameras(W, H)
    sky = _SKY[(f.weather, f.time_of_day)]
    ground, road = _GROUND[f.weather], _ROAD[f.weather]
    noise_base = int(rng.integers(0, 1 << 16))
    out: dict[int, list[bytes]] = {}
    for cid in camera_ids:
        cam = cams[cid]
        static = _draw_static(cam, world, sky, ground, road)
        out[cid] = [
            _encode(_draw_frame(cam, world, static, fr), image_format, noise,
                    noise_base + 7 * cid + 13 * fr, jpeg_quality)  # fmt: skip
            for fr in range(len(FRAME_OFFSETS_S))
        ]
    return out
