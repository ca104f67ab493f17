"""producer_tools.audit: a run's manifest reconciled with the lake (missing, failed, recovered, duplicated)."""

import os
import subprocess
import sys

import pytest

from producer_tools import audit as A
from producer_tools import lake as LK
from producer_tools.cli import main
from producer_tools.common import ToolError
from producer_tools.run_manifest import RunManifest

from tests import REPO_ROOT
from tests.producer_tools.sink_harness import synthetic_lake


async def test_audit_reports_missing_failed_duplicated(tmp_path):
    lake, run, runs = await synthetic_lake(tmp_path)
    rep = A.audit_run(run, str(lake), runs_dir=str(runs))
    assert rep.published == 10 and rep.landed == 8
    assert rep.missing == [f"{run}:s8:trajectory:k1", f"{run}:s9:trajectory:k1"]
    assert rep.failed == [f"{run}:s6:trajectory:k1"] and rep.failed_codes == {"inference_failed": 1}
    assert rep.recovered == [f"{run}:s7:trajectory:k1"]
    assert rep.duplicated == {f"{run}:s2:trajectory:k1": 2}
    assert rep.lake_duplicates == [] and rep.unexpected == []
    assert not rep.complete and rep.exit_code() == 1
    text = A.format_report(rep)
    assert "INCOMPLETE" in text and "missing   2" in text
    assert main(["audit", run, "--lake", str(lake), "--runs-dir", str(runs)]) == 1
    # complete once the missing ids are not in the manifest; strict also fails on failures
    m = RunManifest.for_run(runs, run)
    keep = [r["request_id"] for r in m.records if not r["request_id"].endswith(("s8:trajectory:k1", "s9:trajectory:k1"))]
    results = LK.read_lake(lake, "results", run_id=run).to_pylist()
    dls = LK.read_lake(lake, "dead_letters", run_id=run).to_pylist()
    ok = A.reconcile(run, keep, results, dls)
    assert ok.complete and ok.exit_code() == 0 and ok.exit_code(strict=True) == 1
    dup = A.reconcile(run, keep, results + results[:1], dls)
    assert not dup.complete and len(dup.lake_duplicates) == 1
    with pytest.raises(ToolError, match="no run manifest"):
        A.audit_run("nope", str(lake), runs_dir=str(runs))


async def test_audit_into_a_closed_pipe_ends_quietly(tmp_path):
    """`alpamayo-producer audit ... | head`: the reader leaves early; no BrokenPipeError traceback."""
    lake, run, runs = await synthetic_lake(tmp_path)
    cmd = (f"{sys.executable} -m producer_tools audit {run} --lake {lake} --runs-dir {runs} "
           f"| {sys.executable} -c 'import sys; sys.stdin.close()'")
    for _ in range(3):
        proc = subprocess.run(cmd, shell=True, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
