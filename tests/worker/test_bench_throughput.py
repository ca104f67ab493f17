"""`python -m worker.bench --throughput` on the CPU, tiny shape: whole scenes through the runtime,
baseline vs dflash2 (oracle tau=4) after fp8 quantisation, and the targets table (the GPU run
adds the bf16 profile, K=3 and larger batches: the same code)."""

from worker.bench import main


def test_throughput_bench_runs_whole_scenes_and_prints_the_targets(tmp_path, capsys):
    out = tmp_path / "thru.md"
    assert main(["--throughput", "--shape", "tiny", "--batches", "1", "--k3-batches", "", "--profiles", "fp8",
                 "--new-tokens", "4", "--out", str(out)]) == 0
    md = out.read_text()
    assert "| thru | fp8-baseline batch 1 K=1 | " in md and "| thru | fp8-dflash2 batch 1 K=1 | " in md
    assert "fp8 batch 1 K=1: dflash2 / baseline speed" in md
    assert "outputs equal the baseline's in 1/1 scenes" in md
    table = md[md.index("### Targets: throughput"):].splitlines()
    assert table[2] == "| target | measured | status |"
    rows = [r for r in table[4:] if r.startswith("|")]
    assert len(rows) == 6 and all(r.endswith(("| met |", "| missed |")) for r in rows), rows
    assert "s (prep" in rows[0] and "not measured" in rows[1]          # batch 16 was not run
    assert "scenes/s" in capsys.readouterr().out
