"""The independent checker (worker.model.checker): its inputs, its files, its recipe, and the
runtime and uncertainty block that use it (CPU)."""

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
import torch

from worker.demo.checker import train_checker
from worker.demo.layout import write_random_checkpoint
from worker.model.checker import CHECKER_DIR, CheckerConfig, SceneChecker, checker_inputs, load_checker, save_checker
from worker.model.runtime import AlpamayoRuntime
from worker.uncertainty import CHECKER_SCALE_M, checker_disagreement, uncertainty_block
from tests.worker.model.test_runtime import scene

CAMS = (0, 1, 2, 3, 5, 6)


def _frames(size=64):
    """Frames whose every pixel names its (camera index, frame): camera c frame f = 10 * c + f."""
    x = np.zeros((24, size, size, 3), np.uint8)
    for c in range(6):
        for f in range(4):
            x[c * 4 + f] = 10 * c + f
    return x


def test_inputs_are_the_checker_cameras_last_frames_in_order():
    cfg = CheckerConfig(cameras=(6, 1), frames_per_camera=2)
    x, h = checker_inputs(cfg, _frames(), CAMS, 4, np.zeros((16, 3), np.float32))
    assert x.shape == (1, 4, 64, 64, 3) and x.dtype == torch.uint8 and h.shape == (1, 16, 3)
    # camera 6 is the 6th of CAMS (index 5), camera 1 the 2nd (index 1); the last 2 of 4 frames
    assert [int(v) for v in x[0, :, 0, 0, 0]] == [52, 53, 12, 13]


def test_inputs_resize_other_sizes_and_refuse_missing_cameras():
    cfg = CheckerConfig()
    x, _ = checker_inputs(cfg, _frames(size=96), CAMS, 4, np.zeros((16, 3)))
    assert x.shape == (1, 8, 64, 64, 3) and int(x[0, 0, 5, 5, 0]) == 10      # a flat image stays flat
    assert checker_inputs(cfg, _frames(), (0, 1, 2, 3, 4, 5), 4, np.zeros((16, 3))) is None    # no camera 6
    assert checker_inputs(cfg, _frames(), CAMS, 4, None) is None


def test_saved_checker_loads_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    m = SceneChecker(CheckerConfig(channels=(8, 8, 8, 8, 8))).eval()
    save_checker(m, tmp_path / CHECKER_DIR)
    loaded = load_checker(tmp_path)
    assert loaded.cfg == m.cfg
    with torch.no_grad():                       # what was saved: the weights rounded to fp16
        for p in m.state_dict().values():
            if p.is_floating_point():
                p.copy_(p.half().float())
    x, h = checker_inputs(m.cfg, _frames(), CAMS, 4, np.linspace(-10, 0, 48).reshape(16, 3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, h)[0], m(x, h)[0])
    assert load_checker(tmp_path / "nothing-here") is None


def _sha(d):
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def test_recipe_is_deterministic_from_its_seed_and_learns(tmp_path):
    logs = []
    a = train_checker(tmp_path / "a", scenes=40, epochs=2, batch=8, threads=1, log=logs.append)
    train_checker(tmp_path / "b", scenes=40, epochs=2, batch=8, threads=1, log=logs.append)
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b")
    train_checker(tmp_path / "c", scenes=40, epochs=2, batch=8, threads=1, seed=1, log=logs.append)
    assert _sha(tmp_path / "a") != _sha(tmp_path / "c")
    assert set(a) == {"ade_m", "lead_accuracy", "pedestrian_accuracy", "blocked_accuracy", "light_accuracy"}
    assert json.loads((tmp_path / "a" / "config.json").read_text())["heldout_ade_m"] == a["ade_m"] > 0
    assert any("epoch 2/2" in line for line in logs)


def test_checker_term_of_the_uncertainty_block():
    traj = np.zeros((2, 64, 3))
    traj[:, :, 0] = np.arange(64)
    far = traj[0, :, :2] + [0.0, 3.0]                              # 3 m to the left of both samples
    assert checker_disagreement(far, traj) == pytest.approx(3.0)
    assert checker_disagreement(far, traj, checker_ade_m=1.0) == pytest.approx(2.0)    # beyond its own error
    assert checker_disagreement(far, traj, checker_ade_m=5.0) == 0.0
    with_checker = uncertainty_block(traj, checker_disagreement_m=3.0)
    assert with_checker["checker_disagreement_m"] == 3.0
    assert with_checker["uncertainty"] == pytest.approx(1 - math.exp(-3.0 / CHECKER_SCALE_M))
    assert "checker_disagreement_m" not in uncertainty_block(traj)
    assert uncertainty_block(traj[:1], checker_disagreement_m=3.0) is None       # K = 1: no block


@pytest.fixture(scope="module")
def ckpt_with_checker(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", max_shard_bytes=300_000)
    torch.manual_seed(0)
    save_checker(SceneChecker(CheckerConfig(channels=(8, 8, 8, 8, 8))).eval(), d / CHECKER_DIR)
    return d


def test_runtime_runs_the_checker_for_k2_trajectories_only(ckpt_with_checker, tmp_path):
    rt = AlpamayoRuntime.load(ckpt_with_checker, device="cpu", dtype=torch.float32)
    rt.trajectory_max_new = 8
    k2, = rt.run([scene(1, k=2, temperature=0.6)])
    assert k2.error is None and k2.checker_trajectory.shape == (64, 2)
    assert k2.checker_ade_m == rt.checker.cfg.heldout_ade_m
    expect = rt.checker(*checker_inputs(rt.checker.cfg, scene(1).frames, CAMS, 4, scene(1).ego_history_xyz))[0][0]
    np.testing.assert_array_equal(k2.checker_trajectory, expect.detach().numpy())
    k1, = rt.run([scene(1, k=1)])
    assert k1.checker_trajectory is None
    plain = tmp_path / "plain"
    shutil.copytree(ckpt_with_checker, plain, ignore=shutil.ignore_patterns(CHECKER_DIR))
    rt2 = AlpamayoRuntime.load(plain, device="cpu", dtype=torch.float32)
    rt2.trajectory_max_new = 8
    assert rt2.checker is None and rt2.run([scene(1, k=2, temperature=0.6)])[0].checker_trajectory is None
