"""producer_tools.run_manifest: a run's published request ids, resumed across sessions, a torn last line ignored."""

from producer_tools.run_manifest import RunManifest


def test_run_manifest_resume_and_torn_line(tmp_path):
    m = RunManifest.for_run(tmp_path, "run-1")
    assert not m.exists
    m.open({"run_id": "run-1"})
    for i in range(3):
        m.append({"request_id": f"run-1:s{i}:trajectory:k1", "partition": 0, "offset": i})
    m.close()
    with open(m.path, "a") as f:
        f.write('{"kind":"published","request_id":"run-1:s9')        # crash mid-line
    m2 = RunManifest.for_run(tmp_path, "run-1")
    assert m2.exists and m2.run_id == "run-1"
    assert m2.published_ids() == {f"run-1:s{i}:trajectory:k1" for i in range(3)}
    m2.open({"run_id": "ignored"})
    m2.append({"request_id": "run-1:s3:trajectory:k1", "partition": 0, "offset": 3})
    m2.close()
    m3 = RunManifest.for_run(tmp_path, "run-1")
    assert len(m3.published_ids()) == 4
    assert sum(1 for line in m3.path.read_text().splitlines() if '"session"' in line) == 2
