"""`make demo` on the fp8-dflash2 profile (`--profile`): the worker on the shipped demo model
answers every request of the demo's mix (all tasks, K = 1, 2, 3, two invalid) over the local
Apache Kafka."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import REPO_ROOT


def test_demo_on_the_fp8_dflash2_profile_answers_every_request(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "ALPAMAYO_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    p = subprocess.run([sys.executable, "-m", "producer_tools.demo", "--profile", "fp8-dflash2", "--scenes", "4",
                        "--out", str(tmp_path / "out"), "--timeout", "300"], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "profile fp8-dflash2" in p.stdout + p.stderr           # the worker's ready line
    assert "every request answered: 8 results, 2 dead letters" in p.stdout
    assert (tmp_path / "out" / "trajectories.png").stat().st_size > 0
