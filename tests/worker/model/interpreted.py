"""Kernel cases through Triton's interpreter on the CPU. Triton picks interpreter or compiler when
a kernel is defined, so the cases run in a subprocess with TRITON_INTERPRET=1 and print their
findings as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import REPO_ROOT


def run_interpreted(cases: str) -> dict:
    """Run the Python source `cases` interpreted -> the JSON object its last output line holds."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", cases], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
