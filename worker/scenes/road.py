"""Road geometry: the ego lane centre line on an arc of constant curvature, its Frenet
inverse, the planner cruise speed, and the evasive lane-change shape."""

from __future__ import annotations

import math

import numpy as np

from worker.scenes.structs import LANE_WIDTH, LAT_ACCEL_COMFORT, V_MAX, SceneFacts


def arc_point(k: float, s: float, d: float) -> tuple[float, float]:
    """Point at arc length s along the ego lane centre line (t0 frame), offset d to the left."""
    if abs(k) < 1e-9:
        return s, d
    th = k * s
    sn, cs = math.sin(th), math.cos(th)
    return sn / k - d * sn, (1.0 - cs) / k + d * cs


def arc_points(k: float, s: np.ndarray, d: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    if abs(k) < 1e-9:
        return s.astype(np.float64), np.broadcast_to(np.asarray(d, np.float64), s.shape)
    th = k * s
    sn, cs = np.sin(th), np.cos(th)
    return sn / k - d * sn, (1.0 - cs) / k + d * cs


def frenet(k: float, x: float, y: float) -> tuple[float, float]:
    """Inverse of arc_point: (s, d) of a t0-frame point (valid for |k s| < pi)."""
    if abs(k) < 1e-9:
        return x, y
    dx, dy = x, y - 1.0 / k
    phi = math.atan2(k * dx, -k * dy)
    r = math.hypot(dx, dy)
    return phi / k, 1.0 / k - math.copysign(r, k)


def desired_speed(curvature: float) -> float:
    """Planner cruise speed: V_MAX on straights, lower on curves (lateral accel 2.5 m/s^2)."""
    if abs(curvature) < 1e-9:
        return V_MAX
    return min(V_MAX, math.sqrt(LAT_ACCEL_COMFORT / abs(curvature)))


def smootherstep(u: float) -> float:
    if u <= 0.0:
        return 0.0
    if u >= 1.0:
        return 1.0
    return u * u * u * (u * (6.0 * u - 15.0) + 10.0)


def lane_change_geometry(f: SceneFacts) -> tuple[float, float, float]:
    """(start s, length, signed final offset) of the evasive lane change; zeros when none."""
    if f.blocked_lane_kind != "ego":
        return 0.0, 0.0, 0.0
    side = 1.0 if f.blocked_lane_side == "left" else -1.0
    start = 2.0
    length = min(max(2.5 * f.ego_speed + 8.0, 20.0), f.blocked_distance - 12.0)
    return start, max(length, 8.0), side * LANE_WIDTH
