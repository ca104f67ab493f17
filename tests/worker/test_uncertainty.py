"""worker.uncertainty: spreads in metres, agreements, the scalar's range and order, K = 1 gives no block."""

import math

import numpy as np
import pytest

from worker.uncertainty import LATERAL_SPREAD_SCALE_M, uncertainty_block


def _line(offset_y: float, end_x: float = 64.0) -> np.ndarray:
    t = np.linspace(end_x / 64, end_x, 64)
    return np.stack([t, np.full(64, offset_y), np.zeros(64)], axis=-1)


def test_identical_samples_are_certain_and_k1_has_no_block():
    traj = np.stack([_line(0.0)] * 3)
    b = uncertainty_block(traj)
    assert b == {"trajectory_spread_m": 0.0, "endpoint_spread_m": 0.0, "lateral_spread_m": 0.0, "uncertainty": 0.0}
    assert uncertainty_block(traj[:1]) is None
    assert uncertainty_block(traj[:1], [{"longitudinal": "Stop"}], [{"chain_of_causation": "x"}]) is None
    assert uncertainty_block(None, [None, None], [None, None]) is None          # vqa/grounding: nothing to compare


def test_spreads_are_mean_pairwise_distances_in_metres():
    # three samples 0, 1 and 3 m apart laterally: pairs 1, 3, 2 m apart -> mean 2 m
    b = uncertainty_block([_line(0.0), _line(1.0), _line(3.0)])
    assert b["trajectory_spread_m"] == pytest.approx(2.0) and b["endpoint_spread_m"] == pytest.approx(2.0)
    assert b["lateral_spread_m"] == pytest.approx(2.0)
    assert b["uncertainty"] == pytest.approx(1 - math.exp(-2.0 / LATERAL_SPREAD_SCALE_M))
    assert uncertainty_block([_line(0.0), _line(0.5)])["uncertainty"] < b["uncertainty"] < 1.0
    # samples on one line at different speeds: spread along the track only, which does not count
    fan = uncertainty_block([_line(0.0), _line(0.0, end_x=80.0)])
    assert fan["endpoint_spread_m"] == pytest.approx(16.0) and fan["trajectory_spread_m"] == pytest.approx(8.125)
    assert fan["lateral_spread_m"] == 0.0 and fan["uncertainty"] == 0.0


def test_meta_action_and_auto_label_agreement():
    stop = {"longitudinal": "Stop", "lateral": "Keep lane", "lane": None}
    go = {"longitudinal": "Accelerate", "lateral": "Keep lane", "lane": None}
    assert uncertainty_block(None, [stop, stop, stop]) == {"meta_action_agreement": 1.0, "uncertainty": 0.0}
    b = uncertainty_block(None, [stop, stop, go])     # longitudinal: 1 of 3 pairs equal; the others all equal
    assert b["meta_action_agreement"] == pytest.approx((1 / 3 + 1 + 1) / 3)
    assert b["uncertainty"] == pytest.approx(1 - b["meta_action_agreement"])
    label = {"critical_components_analysis": "red light ahead", "ego_vehicle_motion_analysis": "slowing down",
             "trajectory_analysis": None, "chain_of_causation": "stop for the red light"}
    other = dict(label, ego_vehicle_motion_analysis="speeding up", trajectory_analysis="straight")
    b = uncertainty_block(None, None, [label, other])
    # per field word Jaccard: same text 1, "slowing down" vs "speeding up" 0, absent vs present 0, same 1
    assert b["auto_label_agreement"] == pytest.approx((1 + 0 + 0 + 1) / 4)
    assert uncertainty_block(None, None, [label, label])["uncertainty"] == 0.0


def test_components_combine_as_a_noisy_or():
    stop = {"longitudinal": "Stop"}
    go = {"longitudinal": "Go"}
    traj = [_line(0.0), _line(2.0)]
    both = uncertainty_block(traj, [stop, go])
    alone = uncertainty_block(traj)
    assert both["uncertainty"] == pytest.approx(1 - (1 - alone["uncertainty"]) * both["meta_action_agreement"])
    assert 0.0 <= alone["uncertainty"] < both["uncertainty"] <= 1.0
