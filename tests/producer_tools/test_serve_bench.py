"""`python -m producer_tools.serve_bench`: the whole worker through the local Apache Kafka against
the engine alone, on the same records (a tiny random checkpoint on the CPU, bf16)."""

from __future__ import annotations

import re

import pytest

from producer_tools import serve_bench
from worker.demo.layout import write_random_checkpoint

pytestmark = pytest.mark.kafka


def test_serve_bench_answers_every_request_and_compares_with_the_engine_alone(
        kafka_bootstrap, tmp_path, monkeypatch, capsys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt")
    for var in ("NIM_PRECISION", "NIM_ALPAMAYO_SPECULATIVE_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NIM_FT_CHECKPOINT", str(ckpt))
    monkeypatch.setenv("NIM_MODEL_PROFILE", "bf16")
    monkeypatch.setenv("ALPAMAYO_DEVICE", "cpu")
    code = serve_bench.main(["--bootstrap-servers", kafka_bootstrap, "--scenes", "6", "--batch", "3", "--k", "1",
                             "--distinct", "2", "--image-size", "64x64", "--max-tokens", "12", "--timeout", "300",
                             "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "serve_bench.md").read_text()
    assert text in capsys.readouterr().out
    assert "| every request answered with a result | 6 of 6 (0 dead letters) | met |" in text
    # the Kafka path writes what the engine alone writes for the same records
    assert "| reasoning identical to the engine alone's (informational) | 6 of 6 | - |" in text
    kafka_sps, engine_sps, ratio = map(float, re.search(
        r"\| ([\d.]+) / ([\d.]+) scenes/s = ([\d.]+)x \| (met|missed) \|", text).groups()[:3])
    assert kafka_sps > 0 and engine_sps > 0 and abs(ratio - kafka_sps / engine_sps) < 2e-3
    assert code == (0 if ratio >= serve_bench.KAFKA_OVER_ENGINE else 1)
