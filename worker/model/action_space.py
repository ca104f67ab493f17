"""Unicycle (acceleration, curvature) action space of the Alpamayo 2 Super expert.

Docs: alpamayo2-model.md section 4.4 (formulas) and 1.3 (`action_space_cfg`).

The expert predicts a *normalised* action ``x`` of shape ``(B, 64, 2)``: channel 0 is the
acceleration, channel 1 the curvature, each standardised with the config mean/std. Decoding
integrates a unicycle at ``dt = 0.1`` s from an initial speed ``v0`` that is estimated from the
16 history poses by regularised least squares. Encoding (``trajectory_to_action``) goes the other
way with a chain of small regularised least-squares fits; it is used to tokenise a future
trajectory for the auto-labeling prompt (section 2.7).

Conventions:

* Poses are in the ego frame at t0 (x forward, y left, z up); the last history pose is the
  origin with identity rotation.
* Heading ``theta = atan2(R[1, 0], R[0, 0])`` (:func:`yaw_from_rotation`).
* Every function computes in float32 with autocast disabled, whatever the input dtype, and
  returns float32. Leading batch dimensions are written ``B`` below; any number of leading
  dimensions works as long as the arguments agree on them.

Regularised least squares, shared notation. For an unknown sequence ``x`` (length n) the
smoothness penalty of order ``k`` with weight ``lam`` is ``(lam / dt**(2k)) * ||D_k x||^2`` where
``D_k`` is the k-th forward-difference operator (rows ``[-1, 1]``, ``[1, -2, 1]``,
``[-1, 3, -3, 1]``); the ridge term is ``ridge * ||x||^2`` on the free unknowns only. A fixed
first element ``x_0`` is moved to the right-hand side. Normal equations are solved by Cholesky.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "UnicycleActionSpaceConfig",
    "CURVATURE_MIN_SPEED",
    "estimate_initial_speed",
    "action_to_trajectory",
    "trajectory_to_action",
    "is_within_bounds",
    "normalize_action",
    "denormalize_action",
    "quat_wxyz_to_matrix",
    "yaw_from_rotation",
    "rotation_from_yaw",
    "unwrap_angle",
]

#: Curvature is set to 0 on a step whose speed at either end is below this (m/s).
CURVATURE_MIN_SPEED = 0.6


@dataclass(frozen=True)
class UnicycleActionSpaceConfig:
    """`expert_config.action_space_cfg` (`UnicycleAccelCurvatureActionSpace`).

    Defaults are the release values: 64 waypoints at 0.1 s, bounds (+-9.8 m/s^2, +-0.33 1/m),
    the full-precision normalisation statistics, and the code-default smoothing terms.
    """

    n_waypoints: int = 64
    dt: float = 0.1
    accel_bounds: tuple[float, float] = (-9.8, 9.8)
    curvature_bounds: tuple[float, float] = (-0.33, 0.33)
    accel_mean: float = 0.02902694707164455
    accel_std: float = 0.6810426736454882
    curvature_mean: float = 0.0002692167976330542
    curvature_std: float = 0.026148280660833106
    theta_lambda: float = 1e-6
    theta_ridge: float = 1e-8
    v_lambda: float = 1e-6
    v_ridge: float = 1e-4
    a_lambda: float = 1e-4
    a_ridge: float = 1e-4
    kappa_lambda: float = 1e-4
    kappa_ridge: float = 1e-4
    curvature_min_speed: float = CURVATURE_MIN_SPEED

    def __post_init__(self) -> None:
        if self.n_waypoints <= 0:
            raise ValueError(f"action space: n_waypoints={self.n_waypoints}, expected > 0")
        if not self.dt > 0:
            raise ValueError(f"action space: dt={self.dt}, expected > 0")
        if not (self.accel_std > 0 and self.curvature_std > 0):
            raise ValueError(
                f"action space: accel_std={self.accel_std}, curvature_std={self.curvature_std}, "
                "expected both > 0"
            )
        for name in ("accel_bounds", "curvature_bounds"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ValueError(f"action space: {name}=({lo}, {hi}), expected low <= high")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "UnicycleActionSpaceConfig":
        """Build from the checkpoint's ``action_space_cfg`` dict.

        ``_target_`` and unknown keys are ignored; missing keys keep their defaults. Bounds may be
        given as lists.
        """
        if not d:
            return cls()
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d or d[f.name] is None:
                continue
            value = d[f.name]
            if f.name in ("accel_bounds", "curvature_bounds"):
                lo, hi = value
                value = (float(lo), float(hi))
            elif f.name == "n_waypoints":
                value = int(value)
            else:
                value = float(value)
            kwargs[f.name] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["accel_bounds"] = list(self.accel_bounds)
        d["curvature_bounds"] = list(self.curvature_bounds)
        return d


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _no_autocast(device: torch.device):
    """Context that disables autocast for `device`'s type (a no-op for unknown types)."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except (RuntimeError, ValueError):  # pragma: no cover - exotic device types
        return contextlib.nullcontext()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def unwrap_angle(phi: torch.Tensor) -> torch.Tensor:
    """Unwrap angles along the last dim so that consecutive differences lie in [-pi, pi].

    ``phi (..., T) -> (..., T)``; the first element is kept as is.
    """
    d = torch.diff(phi, dim=-1)
    d = torch.atan2(torch.sin(d), torch.cos(d))
    return torch.cat([phi[..., :1], phi[..., :1] + torch.cumsum(d, dim=-1)], dim=-1)


def yaw_from_rotation(rot: torch.Tensor) -> torch.Tensor:
    """Heading of rotation matrices: ``atan2(R[1, 0], R[0, 0])``. ``(..., 3, 3) -> (...)``."""
    return torch.atan2(rot[..., 1, 0], rot[..., 0, 0])


def rotation_from_yaw(theta: torch.Tensor) -> torch.Tensor:
    """Yaw-only rotation ``Rz(theta) = [[c, -s, 0], [s, c, 0], [0, 0, 1]]``.

    ``(...) -> (..., 3, 3)``.
    """
    c, s = torch.cos(theta), torch.sin(theta)
    zero, one = torch.zeros_like(theta), torch.ones_like(theta)
    return torch.stack(
        [
            torch.stack([c, -s, zero], dim=-1),
            torch.stack([s, c, zero], dim=-1),
            torch.stack([zero, zero, one], dim=-1),
        ],
        dim=-2,
    )


def quat_wxyz_to_matrix(q: torch.Tensor) -> torch.Tensor:
    """Unit quaternion ``(w, x, y, z)`` to rotation matrix. ``(..., 4) -> (..., 3, 3)``.

    The quaternion is normalised first (a zero quaternion gives NaNs). Computed in float32
    unless the input is float64.
    """
    if q.shape[-1] != 4:
        raise ValueError(f"quat_wxyz_to_matrix: shape={tuple(q.shape)}, expected (..., 4)")
    if q.dtype != torch.float64:
        q = _f32(q)
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    w, x, y, z = q.unbind(-1)
    xx, yy, zz = x * x, y * y, z * z
    xy, xz, yz = x * y, x * z, y * z
    wx, wy, wz = w * x, w * y, w * z
    return torch.stack(
        [
            torch.stack([1 - 2 * (yy + zz), 2 * (xy - wz), 2 * (xz + wy)], dim=-1),
            torch.stack([2 * (xy + wz), 1 - 2 * (xx + zz), 2 * (yz - wx)], dim=-1),
            torch.stack([2 * (xz - wy), 2 * (yz + wx), 1 - 2 * (xx + yy)], dim=-1),
        ],
        dim=-2,
    )


def _diff_gram(n: int, order: int, weight: float, device: torch.device) -> torch.Tensor:
    """``weight * D_k^T D_k`` for the order-k forward-difference operator on n points. (n, n)."""
    eye = torch.eye(n, dtype=torch.float32, device=device)
    if order <= 0 or n <= order:
        return torch.zeros(n, n, dtype=torch.float32, device=device)
    d = torch.diff(eye, n=order, dim=0)  # (n - order, n)
    return weight * (d.T @ d)


def _cholesky_solve(lhs: torch.Tensor, rhs: torch.Tensor, ridge: float, what: str) -> torch.Tensor:
    """Solve ``(lhs + ridge I) x = rhs`` for SPD systems. lhs (..., n, n), rhs (..., n) -> (..., n).

    If the factorisation fails (ill-conditioned input) the ridge is raised tenfold, up to 6
    times, for the whole batch; non-finite input raises ``ValueError``.
    """
    n = lhs.shape[-1]
    eye = torch.eye(n, dtype=lhs.dtype, device=lhs.device)
    if not (torch.isfinite(lhs).all() and torch.isfinite(rhs).all()):
        raise ValueError(f"{what}: non-finite input to the least-squares solve")
    r = float(ridge)
    for _ in range(7):
        chol, info = torch.linalg.cholesky_ex(lhs + r * eye)
        if not bool((info != 0).any()):
            return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
        r = max(r * 10.0, 1e-8)
    raise ValueError(f"{what}: least-squares system is not positive definite (ridge up to {r:g})")


def _trapezoid_normal_equations(
    dxy: torch.Tensor, theta: torch.Tensor, dt: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal equations of the trapezoid speed model.

    For intervals k = 0..N-1: ``v_k u_k + v_{k+1} u_{k+1} = 2 (p_{k+1} - p_k) / dt`` with
    ``u = (cos theta, sin theta)``; unknowns v_0..v_N.

    dxy (..., N, 2), theta (..., N+1) -> (A^T A (..., N+1, N+1), A^T b (..., N+1)).
    """
    *lead, n, _ = dxy.shape
    u = torch.stack([torch.cos(theta), torch.sin(theta)], dim=-1)  # (..., N+1, 2)
    eye = torch.eye(n + 1, dtype=torch.float32, device=dxy.device)
    sel_k, sel_k1 = eye[:-1, None, :], eye[1:, None, :]  # (N, 1, N+1): columns k and k+1
    a = u[..., :-1, :, None] * sel_k + u[..., 1:, :, None] * sel_k1  # (..., N, 2, N+1)
    a = a.reshape(*lead, 2 * n, n + 1)
    b = (2.0 / dt) * dxy.reshape(*lead, 2 * n)
    ata = a.transpose(-1, -2) @ a
    atb = (a.transpose(-1, -2) @ b.unsqueeze(-1)).squeeze(-1)
    return ata, atb


def _check_traj(name: str, xyz: torch.Tensor, rot: torch.Tensor | None, n: int | None) -> None:
    if xyz.ndim < 2 or xyz.shape[-1] != 3 or (n is not None and xyz.shape[-2] != n):
        exp = f"(B, {n}, 3)" if n is not None else "(B, T, 3)"
        raise ValueError(f"{name}_xyz: shape={tuple(xyz.shape)}, expected={exp}")
    if rot is not None and (rot.shape[-2:] != (3, 3) or rot.shape[:-2] != xyz.shape[:-1]):
        raise ValueError(
            f"{name}_rot: shape={tuple(rot.shape)}, expected={tuple(xyz.shape[:-1]) + (3, 3)}"
        )


# --------------------------------------------------------------------------------------------
# normalisation
# --------------------------------------------------------------------------------------------


def denormalize_action(
    action: torch.Tensor, cfg: UnicycleActionSpaceConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised (B, N, 2) -> physical (accel (B, N) m/s^2, curvature (B, N) 1/m), unclamped."""
    action = _f32(action)
    accel = action[..., 0] * cfg.accel_std + cfg.accel_mean
    kappa = action[..., 1] * cfg.curvature_std + cfg.curvature_mean
    return accel, kappa


def normalize_action(
    accel: torch.Tensor, kappa: torch.Tensor, cfg: UnicycleActionSpaceConfig
) -> torch.Tensor:
    """Physical accel (B, N), curvature (B, N) -> normalised action (B, N, 2)."""
    a = (_f32(accel) - cfg.accel_mean) / cfg.accel_std
    k = (_f32(kappa) - cfg.curvature_mean) / cfg.curvature_std
    return torch.stack([a, k], dim=-1)


def is_within_bounds(action: torch.Tensor, cfg: UnicycleActionSpaceConfig) -> torch.Tensor:
    """Whether every waypoint of a normalised action (B, N, 2) is in bounds. -> (B,) bool."""
    accel, kappa = denormalize_action(action, cfg)
    ok = (accel >= cfg.accel_bounds[0]) & (accel <= cfg.accel_bounds[1])
    ok &= (kappa >= cfg.curvature_bounds[0]) & (kappa <= cfg.curvature_bounds[1])
    return ok.all(dim=-1)


# --------------------------------------------------------------------------------------------
# initial speed
# --------------------------------------------------------------------------------------------


def estimate_initial_speed(
    hist_xyz: torch.Tensor,
    hist_rot: torch.Tensor,
    cfg: UnicycleActionSpaceConfig | None = None,
) -> torch.Tensor:
    """Speed at t0 from the history poses (`estimate_t0_states`).

    Headings ``theta_k = atan2(R_k[1,0], R_k[0,0])`` unwrapped; per interval k = 0..T-2 the
    trapezoid model ``(dt/2)(v_k u_k + v_{k+1} u_{k+1}) = p_{k+1} - p_k`` (x, y only). Solves
    ``(A^T A + (v_lambda/dt^6) D3^T D3 + v_ridge I) v = A^T (2 dp / dt)`` by Cholesky and returns
    the last speed ``v_{T-1}`` (``v_15`` for 16 poses).

    Args:
        hist_xyz: (B, T, 3) history positions, T >= 2 (16 in the release).
        hist_rot: (B, T, 3, 3) history rotations.
        cfg: action-space config (``dt``, ``v_lambda``, ``v_ridge``).

    Returns:
        v0: (B,) float32, m/s (signed along the heading).
    """
    cfg = cfg or UnicycleActionSpaceConfig()
    _check_traj("hist", hist_xyz, hist_rot, None)
    if hist_xyz.shape[-2] < 2:
        raise ValueError(f"hist_xyz: shape={tuple(hist_xyz.shape)}, expected at least 2 poses")
    with _no_autocast(hist_xyz.device):
        xy = _f32(hist_xyz)[..., :2]
        dxy = xy[..., 1:, :] - xy[..., :-1, :]
        theta = unwrap_angle(yaw_from_rotation(_f32(hist_rot)))
        ata, atb = _trapezoid_normal_equations(dxy, theta, cfg.dt)
        n = ata.shape[-1]
        lhs = ata + _diff_gram(n, 3, cfg.v_lambda / cfg.dt**6, ata.device)
        v = _cholesky_solve(lhs, atb, cfg.v_ridge, "estimate_initial_speed")
        return v[..., -1]


# --------------------------------------------------------------------------------------------
# decode: action -> trajectory
# --------------------------------------------------------------------------------------------


def action_to_trajectory(
    action: torch.Tensor,
    hist_xyz: torch.Tensor,
    hist_rot: torch.Tensor,
    cfg: UnicycleActionSpaceConfig | None = None,
    v0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate a normalised action into a future trajectory (`action_to_traj`).

    With ``a = x[...,0]*accel_std + accel_mean`` and ``k = x[...,1]*curvature_std +
    curvature_mean`` (no clamping)::

        v  = [v0, v0 + cumsum(a dt)]                                    # N+1 speeds
        th = [0, cumsum(k v[:-1] dt) + cumsum(k a dt^2 / 2)]             # N+1 headings
        px = cumsum(dt/2 v[:-1] cos th[:-1]) + cumsum(dt/2 v[1:] cos th[1:])
        py = cumsum(dt/2 v[:-1] sin th[:-1]) + cumsum(dt/2 v[1:] sin th[1:])
        xyz = (px, py, z of the last history pose);  rot = Rz(th[1:])

    (The two cumulative sums are kept separate, as in the reference code, so float32 results
    match it to the last bit as far as torch's cumsum allows.)

    Args:
        action: (B, N, 2) normalised (accel, curvature); N = cfg.n_waypoints (64).
        hist_xyz: (B, T, 3) history positions (only the last z is used, and v0 if not given).
        hist_rot: (B, T, 3, 3) history rotations (only for the v0 estimate).
        cfg: action-space config.
        v0: optional (B,) initial speed; estimated with :func:`estimate_initial_speed` if None.

    Returns:
        xyz (B, N, 3) float32 metres in the t0 ego frame; waypoint i is at t0 + dt (i+1).
        rot (B, N, 3, 3) float32 yaw-only rotations.
    """
    cfg = cfg or UnicycleActionSpaceConfig()
    if action.ndim < 2 or action.shape[-1] != 2 or action.shape[-2] != cfg.n_waypoints:
        raise ValueError(
            f"action: shape={tuple(action.shape)}, expected=(B, {cfg.n_waypoints}, 2)"
        )
    _check_traj("hist", hist_xyz, hist_rot, None)
    with _no_autocast(action.device):
        if v0 is None:
            v0 = estimate_initial_speed(hist_xyz, hist_rot, cfg)
        v0 = _f32(v0)
        accel, kappa = denormalize_action(action, cfg)
        dt = cfg.dt
        half_dt = 0.5 * dt
        dt2_half = 0.5 * dt**2
        v0e = v0.unsqueeze(-1)
        v = torch.cat([v0e, v0e + torch.cumsum(accel * dt, dim=-1)], dim=-1)
        zero = torch.zeros_like(v0e)
        theta = torch.cat(
            [
                zero,
                zero
                + torch.cumsum(kappa * v[..., :-1] * dt, dim=-1)
                + torch.cumsum(kappa * accel * dt2_half, dim=-1),
            ],
            dim=-1,
        )
        cos_t, sin_t = torch.cos(theta), torch.sin(theta)
        px = (
            zero
            + torch.cumsum(v[..., :-1] * cos_t[..., :-1] * half_dt, dim=-1)
            + torch.cumsum(v[..., 1:] * cos_t[..., 1:] * half_dt, dim=-1)
        )
        py = (
            zero
            + torch.cumsum(v[..., :-1] * sin_t[..., :-1] * half_dt, dim=-1)
            + torch.cumsum(v[..., 1:] * sin_t[..., 1:] * half_dt, dim=-1)
        )
        pz = _f32(hist_xyz[..., -1:, 2]).expand_as(px)
        xyz = torch.stack([px, py, pz], dim=-1)
        rot = rotation_from_yaw(theta[..., 1:])
        return xyz, rot


# --------------------------------------------------------------------------------------------
# encode: trajectory -> action
# --------------------------------------------------------------------------------------------


def _smooth_theta(fut_rot: torch.Tensor, cfg: UnicycleActionSpaceConfig) -> torch.Tensor:
    """Smoothed headings theta_0..theta_N with theta_0 = 0 fixed. fut_rot (B, N, 3, 3) -> (B, N+1).

    Minimises ``sum_{i=1..N} (theta_i - yaw_i)^2 + (theta_lambda/dt^6) ||D3 theta||^2 +
    theta_ridge sum_{i>=1} theta_i^2`` over theta_1..theta_N, where yaw is unwrapped starting
    from the fixed theta_0 = 0 (so a future starting near +-pi is handled consistently).
    """
    yaw = yaw_from_rotation(fut_rot)  # (B, N)
    zero = torch.zeros_like(yaw[..., :1])
    target = unwrap_angle(torch.cat([zero, yaw], dim=-1))[..., 1:]
    n = target.shape[-1]
    gram = _diff_gram(n + 1, 3, cfg.theta_lambda / cfg.dt**6, target.device)
    eye = torch.eye(n, dtype=torch.float32, device=target.device)
    lhs = eye + gram[1:, 1:]
    rhs = target  # - gram[1:, 0] * theta_0, with theta_0 = 0
    lhs = lhs.expand(*target.shape[:-1], n, n)
    theta = _cholesky_solve(lhs, rhs, cfg.theta_ridge, "trajectory_to_action(theta)")
    return torch.cat([zero, theta], dim=-1)


def _speeds_with_v0(
    dxy: torch.Tensor, theta: torch.Tensor, v0: torch.Tensor, cfg: UnicycleActionSpaceConfig
) -> torch.Tensor:
    """Trapezoid least-squares speeds with v_0 = v0 fixed. dxy (B,N,2), theta (B,N+1) -> (B,N+1).

    ``(A^T A + (v_lambda/dt^6) D3^T D3)`` over v_0..v_N, restricted to v_1..v_N with the v_0
    column moved to the right-hand side, plus ``v_ridge I`` on v_1..v_N.
    """
    ata, atb = _trapezoid_normal_equations(dxy, theta, cfg.dt)
    n1 = ata.shape[-1]
    full = ata + _diff_gram(n1, 3, cfg.v_lambda / cfg.dt**6, ata.device)
    lhs = full[..., 1:, 1:]
    rhs = atb[..., 1:] - full[..., 1:, 0] * v0.unsqueeze(-1)
    v = _cholesky_solve(lhs, rhs, cfg.v_ridge, "trajectory_to_action(speed)")
    return torch.cat([v0.unsqueeze(-1), v], dim=-1)


def _solve_scaled(
    s: torch.Tensor, y: torch.Tensor, lam: float, ridge: float, dt: float, what: str
) -> torch.Tensor:
    """``argmin_x sum_i (s_i x_i - y_i)^2 + (lam/dt^4) ||D2 x||^2 + ridge ||x||^2``.

    s, y (B, N) -> x (B, N).
    """
    n = y.shape[-1]
    lhs = torch.diag_embed(s * s) + _diff_gram(n, 2, lam / dt**4, y.device)
    return _cholesky_solve(lhs, s * y, ridge, what)


def trajectory_to_action(
    hist_xyz: torch.Tensor,
    hist_rot: torch.Tensor,
    fut_xyz: torch.Tensor,
    fut_rot: torch.Tensor,
    cfg: UnicycleActionSpaceConfig | None = None,
    v0: torch.Tensor | None = None,
) -> torch.Tensor:
    """Convert a future trajectory to the normalised action (`traj_to_action`).

    Steps (N = 64 future poses, all regularised least squares solved by Cholesky):

    1. Headings: ``theta_0 = 0`` (t0) fixed, theta_1..theta_N fitted to the unwrapped future yaw
       with a third-order penalty ``theta_lambda/dt^6`` and ridge ``theta_ridge``.
    2. Speeds: with ``p_0`` = the last history position and ``p_1..p_N`` the future, fit
       v_1..v_N to the trapezoid model ``(dt/2)(v_k u_k + v_{k+1} u_{k+1}) = p_{k+1} - p_k``
       (x, y) with ``v_0 = v0`` fixed (:func:`estimate_initial_speed` unless given), third-order
       penalty ``v_lambda/dt^6``, ridge ``v_ridge``.
    3. Acceleration a_0..a_{N-1}: fit ``a_k = (v_{k+1} - v_k)/dt`` with a second-order penalty
       ``a_lambda/dt^4`` and ridge ``a_ridge``.
    4. Curvature k_0..k_{N-1}: fit ``k_k s_k = theta_{k+1} - theta_k`` with
       ``s_k = dt v_k + dt^2 a_k / 2`` (the arc length of the step), second-order penalty
       ``kappa_lambda/dt^4``, ridge ``kappa_ridge``; then clamp to ``curvature_bounds`` and set
       to 0 where ``|v_k|`` or ``|v_{k+1}|`` is below ``curvature_min_speed`` (0.6 m/s).
       Acceleration is not clamped.
    5. Normalise with the config mean/std.

    Details the model doc leaves open, chosen here (the natural regularised forms): the future
    yaw is unwrapped starting from theta_0 = 0; ``p_0`` is the last history position (the
    origin for t0-frame data); the ridge terms act only on free unknowns; the low-speed
    curvature zeroing is applied after the fit and the clamp (the fit itself weights every
    step equally, and ``s_k ~ 0`` there makes its data term negligible anyway). On smooth
    trajectories ``action_to_trajectory(trajectory_to_action(traj))`` reproduces ``traj`` to
    a few millimetres to ~1.5 cm over the 6.4 s horizon.

    Args:
        hist_xyz: (B, T, 3) history positions (T = 16); the last one is the t0 pose.
        hist_rot: (B, T, 3, 3) history rotations.
        fut_xyz: (B, N, 3) future positions, N = cfg.n_waypoints.
        fut_rot: (B, N, 3, 3) future rotations.
        cfg: action-space config.
        v0: optional (B,) initial speed.

    Returns:
        action: (B, N, 2) float32 normalised (accel, curvature).
    """
    cfg = cfg or UnicycleActionSpaceConfig()
    _check_traj("hist", hist_xyz, hist_rot, None)
    _check_traj("fut", fut_xyz, fut_rot, cfg.n_waypoints)
    with _no_autocast(fut_xyz.device), torch.no_grad():
        if v0 is None:
            v0 = estimate_initial_speed(hist_xyz, hist_rot, cfg)
        v0 = _f32(v0)
        full_xy = torch.cat([_f32(hist_xyz[..., -1:, :2]), _f32(fut_xyz[..., :2])], dim=-2)
        dxy = full_xy[..., 1:, :] - full_xy[..., :-1, :]  # (B, N, 2)
        theta = _smooth_theta(_f32(fut_rot), cfg)  # (B, N+1)
        v = _speeds_with_v0(dxy, theta, v0, cfg)  # (B, N+1)
        dt = cfg.dt
        dv = (v[..., 1:] - v[..., :-1]) / dt
        accel = _solve_scaled(
            torch.ones_like(dv), dv, cfg.a_lambda, cfg.a_ridge, dt, "trajectory_to_action(accel)"
        )
        dtheta = theta[..., 1:] - theta[..., :-1]
        s = dt * v[..., :-1] + (dt**2) / 2.0 * accel
        kappa = _solve_scaled(
            s, dtheta, cfg.kappa_lambda, cfg.kappa_ridge, dt, "trajectory_to_action(curvature)"
        )
        kappa = kappa.clamp(cfg.curvature_bounds[0], cfg.curvature_bounds[1])
        slow = (v[..., :-1].abs() < cfg.curvature_min_speed) | (
            v[..., 1:].abs() < cfg.curvature_min_speed
        )
        kappa = torch.where(slow, torch.zeros_like(kappa), kappa)
        return normalize_action(accel, kappa, cfg)
