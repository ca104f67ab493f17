"""`python3 -m deploy.local.bundle`: a jlink-trimmed Java runtime and the broker's jars in one
archive, for a machine without Java or Maven. The long test (``ALPAMAYO_LONG_TESTS=1``) builds the
archive in parts, unpacks it and starts a broker from it alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from deploy.local import bundle
from deploy.local.jars import ensure_jars
from deploy.local.probe import probe_metadata
from tests import REPO_ROOT

LONG = os.environ.get("ALPAMAYO_LONG_TESTS") == "1"


def test_trimmed_jar_is_stored_and_keeps_only_the_target_platforms_natives(tmp_path):
    src = next(ensure_jars().glob("zstd-jni-*.jar"))
    dst = tmp_path / src.name
    dropped = bundle.trim_jar(src, dst, "linux-x86_64")
    before = {i.filename: i.CRC for i in zipfile.ZipFile(src).infolist()}
    after = zipfile.ZipFile(dst).infolist()
    natives = [i.filename for i in after if bundle.NATIVE.search(i.filename)]
    assert natives == [n for n in before if n.startswith("linux/amd64/") and bundle.NATIVE.search(n)] != []
    assert dropped == sum(1 for n in before if bundle.NATIVE.search(n)) - len(natives) > 10
    assert all(i.compress_type == zipfile.ZIP_STORED for i in after)
    assert all(before[i.filename] == i.CRC for i in after)          # the kept entries' bytes unchanged


@pytest.mark.skipif(not LONG, reason="builds a Java runtime and starts a broker: ALPAMAYO_LONG_TESTS=1")
def test_a_broker_starts_from_the_unpacked_bundle_alone(tmp_path):
    parts = bundle.build(tmp_path / "out", split_mb=20, preset=0)
    assert len(parts) >= 2 and all(p.stat().st_size <= 20 << 20 for p in parts)
    joined = tmp_path / "joined.tar.xz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    root = tmp_path / "root"
    with tarfile.open(joined) as tar:
        tar.extractall(root)
    bin_dir = tmp_path / "bin"                   # a PATH with python3 and no java, mvn or jlink
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "ALPAMAYO_CACHE": str(root), "JAVA_HOME": str(root / "jre"), "PATH": str(bin_dir),
           "PYTHONPATH": str(REPO_ROOT)}
    name = f"bundle-{os.getpid()}"
    start = subprocess.run(["python3", "-m", "deploy.local.cluster", "start", "--name", name], env=env,
                           capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        host, port = start.stdout.strip().splitlines()[0].rsplit(":", 1)
        assert probe_metadata(host, int(port))["brokers"]           # the broker answers
    finally:
        subprocess.run(["python3", "-m", "deploy.local.cluster", "stop", "--name", name], env=env, timeout=120,
                       cwd=REPO_ROOT)
