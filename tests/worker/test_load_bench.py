"""worker.load_bench: the loading figures (tiny shape on the CPU) and the 32B memory plan."""

import pytest

from worker import load_bench
from worker.model.memory_plan import GPUS, longest_rows_for, scenes_that_fit


def test_load_bench_writes_loads_and_reports_the_targets(tmp_path):
    out = tmp_path / "load.md"
    assert load_bench.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--k", "1", "--reasoning", "2",
                            "--dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    text = out.read_text()
    table = text.split("### Targets: loading\n\n")[1].split("\n\n")[0].splitlines()
    assert table[0] == "| target | measured | status |"
    targets = [row.split(" | ")[0] for row in table[2:]]
    assert [t.split()[1] for t in targets] == ["load", "host-memory", "ready"]
    assert all(row.endswith(("| met |", "| missed |")) for row in table[2:])
    assert "extrapolated to 2" in table[4]              # 1 of the tiny shape's 2 layers written
    assert "### Memory plan (tiny" in text
    from worker.model.checkpoint import validate_layout
    cfg, tensors = validate_layout(tmp_path / "ckpt")    # the real loader's checks pass
    assert cfg.num_layers == 1 and all(t.dtype == "BF16" for t in tensors.values())
    assert len({t.shard for t in tensors.values()}) > 1


@pytest.fixture(scope="module")
def profiles():
    return load_bench.profile_bytes("32b")


def test_32b_weights_match_the_release(profiles):
    assert 71.0e9 < profiles["bf16"].weights < 72.0e9                 # the release: 71.6 GB in bf16
    assert profiles["fp8"].weights < 0.55 * profiles["bf16"].weights


@pytest.mark.parametrize("k", [1, 2, 3])
def test_bf16_profiles_fit_an_h200_with_batch_8(profiles, k):
    for p in ("bf16", "bf16-dflash2"):
        assert scenes_that_fit(GPUS["H200 141GB"], 0.90, profiles[p], 8192, k) >= 8


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fp8_profiles_fit_an_h100_with_batch_8_at_a_full_hd_scene_length(profiles, k):
    """At NIM_ALPAMAYO_MAX_MODEL_LEN=4992 (a 24-frame 1920x1080 trajectory scene); at the default
    8192 columns K=2 and K=3 hold 7 and 4-5 scenes (bf16 KV cache: 2 GiB per row)."""
    for p in ("fp8", "fp8-dflash2"):
        m = profiles[p]
        assert scenes_that_fit(GPUS["H100 80GB"], 0.90, m, load_bench.CAPACITIES[1], k) >= 8
        assert longest_rows_for(GPUS["H100 80GB"], 0.90, m, 8, k) >= load_bench.CAPACITIES[1]
