"""History and future trajectory tokenizers (docs: alpamayo2-model.md sections 2.6, 2.7)."""

from __future__ import annotations

import pytest
import torch

from worker.model.action_space import (
    UnicycleActionSpaceConfig,
    rotation_from_yaw,
    trajectory_to_action,
)
from worker.model.trajectory_tokens import (
    DEFAULT_FUTURE_ID0,
    DEFAULT_HISTORY_ID0,
    FutureTokenizer,
    HistoryTokenizer,
    future_tokenizer_from_config,
    history_tokenizer_from_config,
    tokenizers_from_config,
)


def _straight_history(speed: float, batch: int = 1) -> torch.Tensor:
    xyz = torch.zeros(batch, 16, 3)
    xyz[:, :, 0] = speed * 0.1 * torch.arange(-15, 1, dtype=torch.float32)
    return xyz


def _traj(t: torch.Tensor, speed: float, kappa: float = 0.0):
    """Constant-speed straight line or left circle with heading 0 at t = 0. ((1,T,3), (1,T,3,3))."""
    t = t.to(torch.float64)
    xyz = torch.zeros(1, t.numel(), 3, dtype=torch.float64)
    if kappa == 0.0:
        xyz[0, :, 0] = speed * t
        th = torch.zeros_like(t)
    else:
        th = kappa * speed * t
        xyz[0, :, 0] = torch.sin(th) / kappa
        xyz[0, :, 1] = (1 - torch.cos(th)) / kappa
    return xyz.float(), rotation_from_yaw(th)[None].float()


HIST_T = torch.arange(-15, 1) * 0.1
FUT_T = torch.arange(1, 65) * 0.1


# ------------------------------------------------------------------------------------------
# history
# ------------------------------------------------------------------------------------------


def test_history_worked_example_straight_10mps() -> None:
    tok = HistoryTokenizer(history_id0=151669)
    assert tok.num_tokens == 45 and tok.num_deltas == 15
    assert tok.encode_bins(_straight_history(10.0)).tolist() == [[624, 500, 500] * 15]
    ids = tok.encode(_straight_history(10.0))
    assert ids.dtype == torch.int64 and ids.shape == (1, 45)
    assert ids.tolist() == [[152293, 152169, 152169] * 15]


def test_history_token_order_is_dx_dy_dz_per_step() -> None:
    tok = HistoryTokenizer(history_id0=0)
    xyz = torch.zeros(1, 16, 3)
    xyz[0, 0] = torch.tensor([-1.0, 0.0, 0.0])  # delta 0 = (+1, 0, 0)
    xyz[0, 14] = torch.tensor([0.0, 2.0, -2.0])  # delta 13 = (0, +2, -2), delta 14 = (0, -2, +2)
    bins = tok.encode_bins(xyz)[0].view(15, 3)
    assert bins[0].tolist() == [624, 500, 500]
    assert bins[1].tolist() == [500, 500, 500]
    # dy=+2: 6/8*999 = 749.25 -> 749; dz=-2: 8/20*999 = 399.6 -> 400
    assert bins[13].tolist() == [500, 749, 400]
    # dy=-2: 2/8*999 = 249.75 -> 250; dz=+2: 12/20*999 = 599.4 -> 599
    assert bins[14].tolist() == [500, 250, 599]


def test_history_round_half_to_even() -> None:
    # range [-1, 1], 5 bins: bin = 2 d + 2 exactly in float32
    tok = HistoryTokenizer(num_bins=5, xyz_min=(-1, -1, -1), xyz_max=(1, 1, 1), history_id0=0)
    d = torch.tensor([-0.75, -0.25, 0.25, 0.75, 0.0])  # 0.5, 1.5, 2.5, 3.5, 2.0
    deltas = torch.zeros(15, 3)
    deltas[:5, 0] = d
    xyz = torch.cat([torch.zeros(1, 3), torch.cumsum(deltas, 0)])[None]
    xyz = xyz - xyz[:, -1:]
    bins = tok.encode_bins(xyz)[0].view(15, 3)[:5, 0]
    assert bins.tolist() == [0, 2, 2, 4, 2]  # half to even, not half up (1, 2, 3, 4)


def test_history_clamps_at_range_limits() -> None:
    tok = HistoryTokenizer(history_id0=DEFAULT_HISTORY_ID0)
    xyz = _straight_history(60.0)  # 6 m per step > 4 m range
    xyz[0, :8, 1] = torch.arange(8, dtype=torch.float32) * -5.0  # dy = -5 m < -4 m
    xyz[0, :8, 1] -= xyz[0, 7, 1]
    xyz[0, 10, 2] = 30.0  # dz = +30 then -30, beyond +-10
    bins = tok.encode_bins(xyz)[0].view(15, 3)
    assert torch.all(bins[:, 0] == 999)
    assert torch.all(bins[:7, 1] == 0)
    assert bins[9, 2] == 999 and bins[10, 2] == 0
    ids = tok.encode(xyz)
    assert ids.min() >= DEFAULT_HISTORY_ID0 and ids.max() <= DEFAULT_HISTORY_ID0 + 999
    # exactly on the limits
    edge = torch.zeros(1, 16, 3)
    edge[0, :, 0] = 4.0 * torch.arange(-15, 1, dtype=torch.float32)
    edge[0, :, 1] = -4.0 * torch.arange(-15, 1, dtype=torch.float32)
    assert tok.encode_bins(edge)[0].view(15, 3)[:, :2].tolist() == [[999, 0]] * 15


def test_history_decode_round_trip_and_origin_anchor() -> None:
    tok = HistoryTokenizer(history_id0=DEFAULT_HISTORY_ID0)
    xyz, _ = _traj(HIST_T, 12.0, 0.04)
    dec = tok.decode(tok.encode(xyz))
    assert dec.shape == (1, 16, 3) and dec.dtype == torch.float32
    assert torch.all(dec[0, -1] == 0.0)
    # error per delta at most half a bin; accumulated over up to 15 deltas
    half_bin = torch.tensor([8.0, 8.0, 20.0]) / 999 / 2
    err = (dec - xyz).abs()[0]
    steps_from_end = torch.arange(15, -1, -1, dtype=torch.float32)[:, None]
    assert torch.all(err <= steps_from_end * half_bin + 1e-5)
    assert err[:, :2].max() < 0.07  # x/y: about 8 mm per bin
    # z: a zero delta lies half-way between bins 499 and 500 (999 intervals) and rounds to 500,
    # whose centre is +1.001 cm, so the oldest pose is 15 such steps below the origin
    assert abs(dec[0, 0, 2].item() + 15 * (500 / 999 * 20 - 10)) < 1e-4
    # decoding exact bin centres and re-encoding gives the same ids
    ids = tok.encode(xyz)
    assert torch.equal(tok.encode(tok.decode(ids)), ids)


def test_history_pad_origin_at_beginning_48_tokens() -> None:
    tok = HistoryTokenizer(pad_origin_at_beginning=True, history_id0=0)
    assert tok.num_tokens == 48
    fut = torch.zeros(1, 16, 3)
    fut[0, :, 0] = torch.arange(1, 17, dtype=torch.float32)  # 1 m steps from the origin
    ids = tok.encode(fut)
    assert ids.shape == (1, 48) and ids.tolist() == [[624, 500, 500] * 16]
    dec = tok.decode(ids)
    half_bin = torch.tensor([8.0, 8.0, 20.0]) / 999 / 2
    steps = torch.arange(1, 17, dtype=torch.float32)[:, None]
    assert torch.all((dec - fut).abs()[0] <= steps * half_bin + 1e-5)
    assert torch.all(dec[0, :, 0] > 0) and dec[0, 0, 0] < 1.01


def test_history_batch_and_errors() -> None:
    tok = HistoryTokenizer(history_id0=DEFAULT_HISTORY_ID0)
    xyz = torch.cat([_straight_history(10.0), _straight_history(0.0)])
    ids = tok.encode(xyz)
    assert ids.shape == (2, 45)
    assert ids[1].tolist() == [DEFAULT_HISTORY_ID0 + 500] * 45
    with pytest.raises(ValueError, match="expected"):
        tok.encode(torch.zeros(1, 15, 3))
    with pytest.raises(ValueError, match="expected"):
        tok.decode(ids[:, :44])
    with pytest.raises(ValueError, match="outside"):
        tok.decode(ids - 1000)


# ------------------------------------------------------------------------------------------
# future
# ------------------------------------------------------------------------------------------


def test_future_encode_matches_formula_and_order() -> None:
    cfg = UnicycleActionSpaceConfig()
    tok = FutureTokenizer(cfg, future_id0=DEFAULT_FUTURE_ID0)
    assert tok.num_tokens == 128
    hist = _traj(HIST_T, 9.0, 0.03)
    fut = _traj(FUT_T, 9.0, 0.03)
    ids = tok.encode(*hist, *fut)
    assert ids.shape == (1, 128) and ids.dtype == torch.int64
    action = trajectory_to_action(*hist, *fut, cfg)
    expected = torch.clamp(torch.round((action + 10.0) / 20.0 * 2999), 0, 2999).long()
    assert torch.equal(ids, expected.reshape(1, 128) + DEFAULT_FUTURE_ID0)
    # a0, k0, a1, k1, ...
    assert torch.equal(ids[0, 0::2], expected[0, :, 0] + DEFAULT_FUTURE_ID0)
    assert torch.equal(ids[0, 1::2], expected[0, :, 1] + DEFAULT_FUTURE_ID0)


def test_future_action_bins_half_even_and_clamp() -> None:
    tok = FutureTokenizer(num_bins=5, dims_min=(-1, -1), dims_max=(1, 1), future_id0=0)
    action = torch.zeros(1, 64, 2)
    action[0, :4, 0] = torch.tensor([-0.75, -0.25, 0.25, 0.75])
    action[0, :2, 1] = torch.tensor([-7.0, 7.0])
    bins = tok.encode_action_bins(action)[0]
    assert bins[0:8:2].tolist() == [0, 2, 2, 4]
    assert bins[1:4:2].tolist() == [0, 4]


def test_future_decode_round_trip_within_bin_resolution() -> None:
    tok = FutureTokenizer()
    torch.manual_seed(0)
    action = torch.randn(3, 64, 2) * 2
    ids = tok.encode_action(action)
    dec = tok.decode(ids)
    assert dec.shape == (3, 64, 2) and dec.dtype == torch.float32
    assert (dec - action).abs().max() <= 20.0 / 2999 / 2 + 1e-5
    assert torch.equal(tok.encode_action(dec), ids)
    with pytest.raises(ValueError, match="outside"):
        tok.decode(ids + 3000)


def test_future_decode_trajectory_close_to_input() -> None:
    tok = FutureTokenizer()
    hist = _traj(HIST_T, 10.0, 0.02)
    fut = _traj(FUT_T, 10.0, 0.02)
    xyz, rot = tok.decode_trajectory(tok.encode(*hist, *fut), *hist)
    assert xyz.shape == (1, 64, 3) and rot.shape == (1, 64, 3, 3)
    assert (xyz - fut[0]).norm(dim=-1).max() < 0.2


# ------------------------------------------------------------------------------------------
# from the checkpoint config
# ------------------------------------------------------------------------------------------


def _config() -> dict:
    return {
        "model_type": "alpamayo2_super",
        "hist_traj_tokenizer_cfg": {
            "_target_": "alpamayo2_super.models.delta_tokenizer.DeltaTrajectoryTokenizer",
            "pad_origin_at_beginning": False,
            "ego_xyz_min": [-4, -4, -10],
            "ego_xyz_max": [4, 4, 10],
            "num_bins": 1000,
            "predict_yaw": False,
            "load_weights": False,
        },
        "future_traj_tokenizer_cfg": {
            "_target_": "alpamayo2_super.action_space.DiscreteTrajectoryTokenizer",
            "action_space_cfg": {
                "_target_": "alpamayo2_super.action_space.UnicycleAccelCurvatureActionSpace",
                "n_waypoints": 64,
                "accel_mean": 0.029,
                "accel_std": 0.681,
            },
            "dims_min": [-10, -10],
            "dims_max": [10, 10],
            "num_bins": 3000,
        },
        "expert_config": {"action_space_cfg": {"n_waypoints": 64, "accel_mean": 0.5}},
        "tokens_per_history_traj": 45,
        "tokens_per_future_traj": 128,
        "traj_ids": {"history_id0": 151669, "future_id0": 152669, "history_start": 155674},
    }


def test_from_config() -> None:
    hist, fut = tokenizers_from_config(_config())
    assert hist.num_tokens == 45 and hist.history_id0 == 151669 and hist.num_bins == 1000
    assert hist.xyz_min == (-4.0, -4.0, -10.0) and not hist.pad_origin_at_beginning
    assert fut.future_id0 == 152669 and fut.num_bins == 3000 and fut.num_tokens == 128
    assert fut.action_space_cfg.accel_mean == 0.029 and fut.action_space_cfg.accel_std == 0.681
    assert hist.encode(_straight_history(10.0)).tolist() == [[152293, 152169, 152169] * 15]


def test_from_config_fallbacks_and_checks() -> None:
    cfg = _config()
    cfg["future_traj_tokenizer_cfg"] = {}
    fut = future_tokenizer_from_config(cfg)
    assert fut.action_space_cfg.accel_mean == 0.5  # from expert_config.action_space_cfg
    assert fut.dims_min == (-10.0, -10.0) and fut.dims_max == (10.0, 10.0)
    empty = {"hist_traj_tokenizer_cfg": {}, "future_traj_tokenizer_cfg": {}}
    hist, fut = tokenizers_from_config(empty)
    assert hist.history_id0 == DEFAULT_HISTORY_ID0 and fut.future_id0 == DEFAULT_FUTURE_ID0
    assert fut.action_space_cfg == UnicycleActionSpaceConfig()
    cfg = _config()
    cfg["tokens_per_history_traj"] = 48
    with pytest.raises(ValueError, match="configured=48"):
        history_tokenizer_from_config(cfg)
    cfg = _config()
    cfg["hist_traj_tokenizer_cfg"]["pad_origin_at_beginning"] = True
    cfg["tokens_per_history_traj"] = 48
    assert history_tokenizer_from_config(cfg).num_tokens == 48
    cfg["hist_traj_tokenizer_cfg"]["predict_yaw"] = True
    with pytest.raises(ValueError, match="predict_yaw"):
        history_tokenizer_from_config(cfg)
