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
    assert rep.verdict == "INCOMPLETE" and rep.exit_code() == 3
    text = A.format_report(rep)
    assert "INCOMPLETE: 8 of 10 planned requests landed" in text and "missing   2" in text
    assert main(["audit", run, "--lake", str(lake), "--runs-dir", str(runs)]) == 3
    # without the missing ids: FAILED by the dead letter of s6; COMPLETE without it too
    m = RunManifest.for_run(runs, run)
    keep = [r["request_id"] for r in m.records if not r["request_id"].endswith(("s8:trajectory:k1", "s9:trajectory:k1"))]
    results = LK.read_lake(lake, "results", run_id=run).to_pylist()
    dls = LK.read_lake(lake, "dead_letters", run_id=run).to_pylist()
    failed = A.reconcile(run, keep, results, dls)
    assert failed.verdict == "FAILED" and failed.exit_code() == 1
    assert A.format_report(failed).splitlines()[0] == (f"run {run}: FAILED: 1 of 8 planned requests dead-lettered "
                                                       "(inference_failed 1)")
    ok = A.reconcile(run, [i for i in keep if not i.endswith("s6:trajectory:k1")], results, dls)
    assert ok.verdict == "COMPLETE" and ok.exit_code() == 0 and ok.exit_code(strict=True) == 1   # s2 twice
    dup = A.reconcile(run, keep, results + results[:1], dls)
    assert dup.verdict == "FAILED" and len(dup.lake_duplicates) == 1
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


def test_a_run_of_dead_letters_only_is_failed_not_complete():
    ids = [f"r:s{i}:trajectory:k1" for i in range(3)]
    dls = [{"request_id": i, "error_code": "bad_image", "error_field": "$.images[0]", "kafka_topic": "dl",
            "kafka_partition": 0, "kafka_offset": n, "decode_error": None} for n, i in enumerate(ids)]
    rep = A.reconcile("r", ids, [], dls)
    assert (rep.verdict, rep.exit_code(), rep.failed_codes) == ("FAILED", 1, {"bad_image": 3})
    assert "FAILED: 3 of 3 planned requests dead-lettered (bad_image 3)" in A.format_report(rep)


async def test_an_interrupted_run_is_incomplete_with_its_resume_command(tmp_path):
    """The manifest keeps the planned total: 2 of 12 never published -> INCOMPLETE 8 of 12, exit 3."""
    lake, run, runs = await synthetic_lake(tmp_path)
    m = RunManifest.for_run(runs, run)
    m.open({}, planned=12, resume_command=f"alpamayo-producer publish --synthetic 12 --run-id {run}")
    m.close()
    rep = A.audit_run(run, str(lake), runs_dir=str(runs))
    assert (rep.planned, rep.unpublished, rep.verdict, rep.exit_code()) == (12, 2, "INCOMPLETE", 3)
    head = A.format_report(rep).splitlines()[0]
    assert head.startswith(f"run {run}: INCOMPLETE: 8 of 12 planned requests landed; 2 never published "
                           f"(resume: alpamayo-producer publish --synthetic 12 --run-id {run})"), head
    assert A.audit_run(run, str(lake), runs_dir=str(runs)).to_json()["verdict"] == "INCOMPLETE"
