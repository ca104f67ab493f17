"""`python -m producer_tools.contention_bench` on the CPU (tiny random checkpoint, 64x64 frames):
the engine alone, then with the worker's intake working beside it, in one process."""

from __future__ import annotations

import re

from producer_tools import contention_bench
from worker.demo.layout import write_random_checkpoint


def test_contention_bench_times_the_engine_alone_and_beside_intake(tmp_path, monkeypatch, capsys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    for var in ("NIM_PRECISION", "NIM_ALPAMAYO_SPECULATIVE_MODEL", "NIM_ALPAMAYO_TRAJ_SAMPLES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"NIM_FT_CHECKPOINT": str(ckpt), "NIM_MODEL_PROFILE": "bf16", "ALPAMAYO_DEVICE": "cpu",
                       "ALPAMAYO_MAX_REASONING_TOKENS": "4"}.items():
        monkeypatch.setenv(var, value)
    assert contention_bench.main(["--batch", "2", "--image-size", "64x64", "--nonstop"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"batch \d: [\d.]+ s, -?[\d.]+ s outside the timed stages", out)) == 1 + 3 * 3
    rows = re.findall(r"^\| (engine alone|intake [^|]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    assert [r[0].split()[0] for r in rows] == ["engine", "intake", "intake"], out
    assert rows[0][2] == "1.000" and all(float(r[1]) > 0 for r in rows)
