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


def test_a_demo_broker_another_run_still_uses_is_left_running_and_the_last_user_stops_it():
    """Two runs at once (two `make demo`s, or `make demo` beside `make test`'s demo) share the
    local cluster: the first to finish must not stop the broker under the other (it did: the
    other's worker then failed with NodeNotReadyError)."""
    from deploy.local.cluster import LocalKafka
    from producer_tools.demo import local_broker

    name = f"pytest-demo-lease-{os.getpid()}"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom producer_tools.demo import local_broker\n"
         "with local_broker(False, name=sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()", name],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        lines = [holder.stdout.readline() for _ in range(3)]          # its steps, then "held"
        assert "held\n" in lines, lines
        with local_broker(False, name=name) as bootstrap:             # reuses the holder's broker
            assert bootstrap
        assert LocalKafka(name=name).is_running()                     # the holder still uses it
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0
        assert not LocalKafka(name=name).is_running()                 # the last user stopped it
    finally:
        if holder.poll() is None:
            holder.kill()
        LocalKafka(name=name).stop()
