"""Unicycle action space (docs: alpamayo2-model.md section 4.4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker.model.action_space import (
    UnicycleActionSpaceConfig,
    action_to_trajectory,
    estimate_initial_speed,
    is_within_bounds,
    normalize_action,
    quat_wxyz_to_matrix,
    rotation_from_yaw,
    trajectory_to_action,
    unwrap_angle,
    yaw_from_rotation,
)

CFG = UnicycleActionSpaceConfig()
DT = 0.1


# ------------------------------------------------------------------------------------------
# fixtures: analytic trajectories in the t0 ego frame
# ------------------------------------------------------------------------------------------


def _hist_times() -> torch.Tensor:
    return torch.arange(-15, 1, dtype=torch.float64) * DT  # -1.5 .. 0.0


def _fut_times() -> torch.Tensor:
    return torch.arange(1, 65, dtype=torch.float64) * DT  # 0.1 .. 6.4


def _straight(t: torch.Tensor, v: float, a: float = 0.0, stop: bool = False):
    """x(t) = v t + a t^2 / 2 along +x (speed v at t = 0); optionally held once stopped."""
    if stop:
        t = torch.clamp(t, max=-v / a)
    xyz = torch.zeros(1, t.numel(), 3, dtype=torch.float64)
    xyz[0, :, 0] = v * t + 0.5 * a * t * t
    rot = torch.eye(3, dtype=torch.float64).expand(1, t.numel(), 3, 3).clone()
    return xyz.float(), rot.float()


def _arc(t: torch.Tensor, v: float, kappa: float):
    """Constant-speed circle through the origin with heading 0 at t = 0, turning left."""
    th = kappa * v * t
    xyz = torch.zeros(1, t.numel(), 3, dtype=torch.float64)
    xyz[0, :, 0] = torch.sin(th) / kappa
    xyz[0, :, 1] = (1 - torch.cos(th)) / kappa
    return xyz.float(), rotation_from_yaw(th)[None].float()


def _v0_reference(hist_xyz: np.ndarray, hist_rot: np.ndarray, cfg=CFG) -> float:
    """Independent float64 implementation of the doc's least squares (one trajectory)."""
    th = np.unwrap(np.arctan2(hist_rot[:, 1, 0], hist_rot[:, 0, 0]))
    n = len(th) - 1
    a = np.zeros((2 * n, n + 1))
    b = np.zeros(2 * n)
    for k in range(n):
        a[2 * k, k], a[2 * k, k + 1] = math.cos(th[k]), math.cos(th[k + 1])
        a[2 * k + 1, k], a[2 * k + 1, k + 1] = math.sin(th[k]), math.sin(th[k + 1])
        b[2 * k : 2 * k + 2] = 2 * (hist_xyz[k + 1, :2] - hist_xyz[k, :2]) / cfg.dt
    d3 = np.zeros((n + 1 - 3, n + 1))
    for i in range(n + 1 - 3):
        d3[i, i : i + 4] = [-1, 3, -3, 1]
    lhs = a.T @ a + cfg.v_lambda / cfg.dt**6 * d3.T @ d3 + cfg.v_ridge * np.eye(n + 1)
    return float(np.linalg.solve(lhs, a.T @ b)[-1])


# ------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------


def test_config_defaults_and_from_dict() -> None:
    assert CFG.n_waypoints == 64 and CFG.dt == 0.1
    assert CFG.accel_mean == 0.02902694707164455
    assert CFG.accel_std == 0.6810426736454882
    assert CFG.curvature_mean == 0.0002692167976330542
    assert CFG.curvature_std == 0.026148280660833106
    assert CFG.curvature_bounds == (-0.33, 0.33)
    cfg = UnicycleActionSpaceConfig.from_dict(
        {
            "_target_": "alpamayo2_super.action_space.UnicycleAccelCurvatureActionSpace",
            "n_waypoints": 64,
            "accel_mean": 0.029,
            "accel_bounds": [-5, 5],
            "curvature_bounds": [-0.2, 0.2],
            "something_new": 1,
        }
    )
    assert cfg.accel_mean == 0.029 and cfg.accel_bounds == (-5.0, 5.0)
    assert cfg.curvature_bounds == (-0.2, 0.2) and cfg.accel_std == CFG.accel_std
    assert UnicycleActionSpaceConfig.from_dict({}) == CFG
    assert UnicycleActionSpaceConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        UnicycleActionSpaceConfig(accel_std=0.0)


# ------------------------------------------------------------------------------------------
# initial speed
# ------------------------------------------------------------------------------------------


def test_v0_straight_constant_speed() -> None:
    xyz, rot = _straight(_hist_times(), 10.0)
    v0 = estimate_initial_speed(xyz, rot, CFG)
    assert v0.shape == (1,) and v0.dtype == torch.float32
    assert abs(v0.item() - 10.0) < 1e-3
    assert abs(v0.item() - _v0_reference(xyz[0].double().numpy(), rot[0].double().numpy())) < 1e-4


def test_v0_constant_acceleration_and_batch() -> None:
    cases = [(5.0, 1.0), (12.0, -2.0), (3.0, 0.5)]
    trajs = [_straight(_hist_times(), v, a) for v, a in cases]
    xyz = torch.cat([t[0] for t in trajs])
    rot = torch.cat([t[1] for t in trajs])
    v0 = estimate_initial_speed(xyz, rot, CFG)
    assert v0.shape == (3,)
    for i, (v, _) in enumerate(cases):
        assert abs(v0[i].item() - v) < 5e-3
        ref = _v0_reference(xyz[i].double().numpy(), rot[i].double().numpy())
        assert abs(v0[i].item() - ref) < 1e-4


def test_v0_on_a_curve_matches_reference_and_is_rotation_invariant() -> None:
    xyz, rot = _arc(_hist_times(), 8.0, 0.05)
    v0 = estimate_initial_speed(xyz, rot, CFG).item()
    assert abs(v0 - 8.0) < 5e-3
    assert abs(v0 - _v0_reference(xyz[0].double().numpy(), rot[0].double().numpy())) < 1e-4
    # rotate the whole history by 170 degrees: same speed (headings are unwrapped)
    r = rotation_from_yaw(torch.tensor(math.radians(170.0)))
    v0_rot = estimate_initial_speed(xyz @ r.T, r @ rot, CFG).item()
    assert abs(v0_rot - v0) < 1e-3


def test_v0_stationary_is_zero() -> None:
    xyz = torch.zeros(2, 16, 3)
    rot = torch.eye(3).expand(2, 16, 3, 3)
    assert torch.allclose(estimate_initial_speed(xyz, rot, CFG), torch.zeros(2), atol=1e-6)


# ------------------------------------------------------------------------------------------
# action -> trajectory
# ------------------------------------------------------------------------------------------


def _phys_to_norm(accel: float, kappa: float, n: int = 64, batch: int = 1) -> torch.Tensor:
    return normalize_action(torch.full((batch, n), accel), torch.full((batch, n), kappa), CFG)


def test_zero_physical_action_gives_straight_line() -> None:
    hist_xyz, hist_rot = _straight(_hist_times(), 10.0)
    hist_xyz[..., 2] = 0.25  # z of the last history pose is carried over
    v0 = torch.tensor([10.0])
    xyz, rot = action_to_trajectory(_phys_to_norm(0.0, 0.0), hist_xyz, hist_rot, CFG, v0=v0)
    assert xyz.shape == (1, 64, 3) and rot.shape == (1, 64, 3, 3) and xyz.dtype == torch.float32
    expected_x = 10.0 * torch.arange(1, 65) * DT
    assert torch.allclose(xyz[0, :, 0], expected_x, atol=1e-3)
    assert xyz[0, :, 1].abs().max() < 1e-5
    assert torch.all(xyz[0, :, 2] == 0.25)
    assert torch.allclose(rot, torch.eye(3).expand(1, 64, 3, 3), atol=1e-6)


def test_zero_normalized_action_matches_closed_form() -> None:
    """x = 0 means accel = accel_mean, curvature = curvature_mean; compare with float64 math."""
    hist_xyz, hist_rot = _straight(_hist_times(), 7.0)
    v0 = 7.0
    xyz, rot = action_to_trajectory(
        torch.zeros(1, 64, 2), hist_xyz, hist_rot, CFG, v0=torch.tensor([v0])
    )
    a, k = CFG.accel_mean, CFG.curvature_mean
    v = v0 + a * DT * np.arange(65)
    th = np.concatenate([[0.0], np.cumsum(k * v[:-1] * DT + k * a * DT**2 / 2)])
    px = np.cumsum(DT / 2 * (v[:-1] * np.cos(th[:-1]) + v[1:] * np.cos(th[1:])))
    py = np.cumsum(DT / 2 * (v[:-1] * np.sin(th[:-1]) + v[1:] * np.sin(th[1:])))
    assert np.allclose(xyz[0, :, 0].numpy(), px, atol=2e-4)
    assert np.allclose(xyz[0, :, 1].numpy(), py, atol=2e-4)
    assert np.allclose(yaw_from_rotation(rot)[0].numpy(), th[1:], atol=1e-5)


def test_v0_is_estimated_when_not_given() -> None:
    hist_xyz, hist_rot = _straight(_hist_times(), 10.0)
    xyz_est, _ = action_to_trajectory(_phys_to_norm(0.0, 0.0), hist_xyz, hist_rot, CFG)
    v0 = estimate_initial_speed(hist_xyz, hist_rot, CFG)
    xyz_given, _ = action_to_trajectory(_phys_to_norm(0.0, 0.0), hist_xyz, hist_rot, CFG, v0=v0)
    assert torch.equal(xyz_est, xyz_given)


def test_constant_curvature_is_a_circle() -> None:
    v0, kappa = 10.0, 0.05  # radius 20 m
    hist_xyz, hist_rot = _straight(_hist_times(), v0)
    xyz, rot = action_to_trajectory(
        _phys_to_norm(0.0, kappa), hist_xyz, hist_rot, CFG, v0=torch.tensor([v0])
    )
    # trapezoid steps of equal chord length rotating by dth each: a circle through the origin
    dth = kappa * v0 * DT
    r_eff = v0 * DT * math.cos(dth / 2) / (2 * math.sin(dth / 2))
    assert abs(r_eff - 1 / kappa) < 0.01
    centre = torch.tensor([0.0, r_eff])
    radius = (xyz[0, :, :2] - centre).norm(dim=-1)
    assert torch.allclose(radius, torch.full_like(radius, r_eff), atol=2e-3)
    yaw = yaw_from_rotation(rot[0])
    expected = torch.remainder(dth * torch.arange(1, 65) + math.pi, 2 * math.pi) - math.pi
    assert torch.allclose(torch.atan2(torch.sin(yaw - expected), torch.cos(yaw - expected)),
                          torch.zeros(64), atol=1e-4)
    # negative curvature mirrors in y
    xyz_r, _ = action_to_trajectory(
        _phys_to_norm(0.0, -kappa), hist_xyz, hist_rot, CFG, v0=torch.tensor([v0])
    )
    assert torch.allclose(xyz_r[0, :, 0], xyz[0, :, 0], atol=1e-4)
    assert torch.allclose(xyz_r[0, :, 1], -xyz[0, :, 1], atol=1e-4)


def test_output_rotations_are_yaw_only() -> None:
    torch.manual_seed(0)
    hist_xyz, hist_rot = _straight(_hist_times(), 6.0)
    action = torch.randn(3, 64, 2)
    xyz, rot = action_to_trajectory(
        action, hist_xyz.expand(3, 16, 3), hist_rot.expand(3, 16, 3, 3), CFG
    )
    assert xyz.shape == (3, 64, 3) and rot.shape == (3, 64, 3, 3)
    eye = torch.eye(3).expand(3, 64, 3, 3)
    assert torch.allclose(rot @ rot.transpose(-1, -2), eye, atol=1e-5)
    assert torch.allclose(torch.linalg.det(rot), torch.ones(3, 64), atol=1e-5)
    assert torch.all(rot[..., 2, 2] == 1) and torch.all(rot[..., 2, :2] == 0)
    assert torch.all(rot[..., :2, 2] == 0)
    # heading of each step agrees with rot
    th = yaw_from_rotation(rot)
    assert torch.allclose(rotation_from_yaw(th), rot, atol=1e-6)


def test_action_to_trajectory_runs_in_fp32_from_bf16() -> None:
    hist_xyz, hist_rot = _straight(_hist_times(), 10.0)
    action = _phys_to_norm(0.0, 0.0).to(torch.bfloat16)
    xyz, rot = action_to_trajectory(action, hist_xyz.bfloat16(), hist_rot.bfloat16(), CFG)
    assert xyz.dtype == torch.float32 and rot.dtype == torch.float32


def test_shape_errors() -> None:
    hist_xyz, hist_rot = _straight(_hist_times(), 10.0)
    with pytest.raises(ValueError, match="expected"):
        action_to_trajectory(torch.zeros(1, 63, 2), hist_xyz, hist_rot, CFG)
    with pytest.raises(ValueError, match="expected"):
        trajectory_to_action(
            hist_xyz, hist_rot, torch.zeros(1, 10, 3), torch.zeros(1, 10, 3, 3), CFG
        )


# ------------------------------------------------------------------------------------------
# trajectory -> action, round trip
# ------------------------------------------------------------------------------------------


def _round_trip(hist, fut):
    hx, hr = hist
    fx, fr = fut
    action = trajectory_to_action(hx, hr, fx, fr, CFG)
    assert action.shape == fx.shape[:-1] + (2,) and action.dtype == torch.float32
    xyz, rot = action_to_trajectory(action, hx, hr, CFG)
    pos_err = (xyz - fx).norm(dim=-1).max().item()
    yaw_err = (yaw_from_rotation(rot) - yaw_from_rotation(fr)).abs().max().item()
    return action, pos_err, yaw_err


def test_round_trip_straight_constant_speed() -> None:
    action, pos_err, yaw_err = _round_trip(
        _straight(_hist_times(), 10.0), _straight(_fut_times(), 10.0)
    )
    assert pos_err < 0.01 and yaw_err < 1e-4
    accel = action[..., 0] * CFG.accel_std + CFG.accel_mean
    kappa = action[..., 1] * CFG.curvature_std + CFG.curvature_mean
    assert accel.abs().max() < 0.01 and kappa.abs().max() < 1e-6


def test_round_trip_constant_curvature_turn() -> None:
    for v, k in ((10.0, 0.02), (5.0, 0.1)):
        action, pos_err, yaw_err = _round_trip(_arc(_hist_times(), v, k), _arc(_fut_times(), v, k))
        assert pos_err < 0.05, (v, k, pos_err)
        assert yaw_err < 5e-3
        kappa = action[..., 1] * CFG.curvature_std + CFG.curvature_mean
        assert torch.allclose(kappa[0, 2:-2], torch.full((60,), k), rtol=2e-3)


def test_round_trip_braking_to_a_stop() -> None:
    action, pos_err, _ = _round_trip(
        _straight(_hist_times(), 10.0), _straight(_fut_times(), 10.0, -3.0, stop=True)
    )
    assert pos_err < 0.05
    accel = action[0, :, 0] * CFG.accel_std + CFG.accel_mean
    assert torch.allclose(accel[1:25], torch.full((24,), -3.0), atol=0.01)
    assert accel[45:].abs().max() < 0.01
    # stationary part: speed below 0.6 m/s => curvature exactly 0
    kappa = action[0, :, 1] * CFG.curvature_std + CFG.curvature_mean
    assert kappa[40:].abs().max() < 1e-6


def test_round_trip_constant_acceleration() -> None:
    _, pos_err, _ = _round_trip(
        _straight(_hist_times(), 5.0, 1.0), _straight(_fut_times(), 5.0, 1.0)
    )
    assert pos_err < 0.01


def test_round_trip_of_smooth_action_generated_trajectories() -> None:
    torch.manual_seed(1)
    b = 4
    hx, hr = _straight(_hist_times(), 8.0)
    hx, hr = hx.expand(b, 16, 3), hr.expand(b, 16, 3, 3)
    s = torch.linspace(0, 1, 64)
    action0 = torch.stack(
        [
            torch.sin(2 * math.pi * s * torch.rand(b, 1)),
            2.0 * torch.cos(2 * math.pi * s * torch.rand(b, 1)),
        ],
        dim=-1,
    )
    fx, fr = action_to_trajectory(action0, hx, hr, CFG)
    action1 = trajectory_to_action(hx, hr, fx, fr, CFG)
    assert (action1 - action0).abs().max() < 0.05
    fx2, _ = action_to_trajectory(action1, hx, hr, CFG)
    assert (fx2 - fx).norm(dim=-1).max() < 0.03


def test_curvature_is_clamped_and_zero_at_low_speed() -> None:
    # a very tight turn at walking pace: curvature 0.5 > bound 0.33
    v, k = 2.0, 0.5
    action, _, _ = _round_trip(_arc(_hist_times(), v, k), _arc(_fut_times(), v, k))
    kappa = action[..., 1] * CFG.curvature_std + CFG.curvature_mean
    assert kappa.max() <= 0.33 + 1e-6 and kappa.max() > 0.32
    # creeping at 0.3 m/s: all curvature zero
    v, k = 0.3, 0.05
    action, _, _ = _round_trip(_arc(_hist_times(), v, k), _arc(_fut_times(), v, k))
    kappa = action[..., 1] * CFG.curvature_std + CFG.curvature_mean
    assert kappa.abs().max() == 0.0


def test_is_within_bounds() -> None:
    ok = _phys_to_norm(1.0, 0.1)
    bad = _phys_to_norm(1.0, 0.4)
    assert is_within_bounds(torch.cat([ok, bad]), CFG).tolist() == [True, False]


# ------------------------------------------------------------------------------------------
# rotation helpers
# ------------------------------------------------------------------------------------------


def test_quaternion_yaw_only_and_general() -> None:
    psi = torch.tensor([0.0, 0.3, -2.0, math.pi])
    q = torch.stack([torch.cos(psi / 2), torch.zeros(4), torch.zeros(4), torch.sin(psi / 2)], -1)
    r = quat_wxyz_to_matrix(q)
    assert r.shape == (4, 3, 3)
    assert torch.allclose(r, rotation_from_yaw(psi), atol=1e-6)
    wrapped = torch.atan2(torch.sin(psi), torch.cos(psi))
    assert torch.allclose(yaw_from_rotation(r)[:3], wrapped[:3], atol=1e-6)
    assert abs(abs(yaw_from_rotation(r)[3].item()) - math.pi) < 1e-6
    # unnormalised quaternion, 90 degrees about x: y -> z
    rx = quat_wxyz_to_matrix(torch.tensor([2.0, 2.0, 0.0, 0.0]))
    y_axis, z_axis = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    assert torch.allclose(rx @ y_axis, z_axis, atol=1e-6)
    # homomorphism: R(q1 * q2) == R(q1) R(q2)
    torch.manual_seed(0)
    q1, q2 = torch.randn(2, 4, dtype=torch.float64).unbind(0)
    w1, x1, y1, z1 = q1
    w2, x2, y2, z2 = q2
    prod = torch.stack(
        [
            w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2,
            w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
            w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
            w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
        ]
    )
    r12 = quat_wxyz_to_matrix(q1) @ quat_wxyz_to_matrix(q2)
    assert torch.allclose(quat_wxyz_to_matrix(prod), r12)


def test_unwrap_angle() -> None:
    raw = torch.tensor([3.0, -3.1, 3.0, 2.9])
    out = unwrap_angle(raw)
    assert out[0] == 3.0 and torch.all(torch.diff(out).abs() < 0.5)
