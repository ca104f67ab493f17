"""The cache directory, the Kafka jars from Maven Central and the Java that runs them.

Jars come from ``deploy/local/pom.xml`` through ``mvn dependency:copy-dependencies`` into a cache
outside the repository::

    ${ALPAMAYO_CACHE:-~/.cache/alpamayo-worker}/kafka-<version>-<pom hash>/libs
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from deploy.local.errors import LocalKafkaError

POM = Path(__file__).resolve().parent / "pom.xml"


def cache_root() -> Path:
    """``$ALPAMAYO_CACHE`` or ``~/.cache/alpamayo-worker``.

    The one place deploy/local reads ALPAMAYO_CACHE, and the one reader of it outside
    worker/config.py: deploy/local runs with the system python, without the venv, so it cannot
    import the worker. Keep the default equal to ``worker.config``'s.
    """
    env = os.environ.get("ALPAMAYO_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "alpamayo-worker"
    return root.resolve()


def kafka_version(pom: Path = POM) -> str:
    m = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", pom.read_text())
    if not m:
        raise LocalKafkaError(f"no <kafka.version> property in {pom}")
    return m.group(1)


def jars_dir(pom: Path = POM) -> Path:
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    return cache_root() / f"kafka-{kafka_version(pom)}-{digest}" / "libs"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_jars(pom: Path = POM, *, quiet: bool = True) -> Path:
    """Return the directory of Kafka jars, fetching them with Maven when missing.

    The directory is complete when it holds ``.complete``; a half-copied one is redone.
    """
    libs = jars_dir(pom)
    marker = libs / ".complete"
    if marker.exists():
        return libs
    with _file_lock(libs.parent / ".lock"):
        if marker.exists():
            return libs
        mvn = shutil.which("mvn")
        if not mvn:
            raise LocalKafkaError("Maven (mvn) is not on PATH: it is needed once to fetch the Kafka jars")
        _check_java()
        work = Path(tempfile.mkdtemp(prefix="mvn-", dir=libs.parent))
        try:
            # run Maven on a copy of the pom so that no target/ appears in the repository
            shutil.copy2(pom, work / "pom.xml")
            out = work / "libs"
            cmd = [
                mvn, "-B", *(["-q"] if quiet else []), "-f", str(work / "pom.xml"),
                "dependency:copy-dependencies", "-DincludeScope=runtime",
                f"-DoutputDirectory={out}",
            ]
            proc = subprocess.run(cmd, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LocalKafkaError(
                    "fetching the Kafka jars failed: " + " ".join(cmd) + "\n" + (proc.stdout + proc.stderr)[-4000:]
                )
            jars = sorted(p.name for p in out.glob("*.jar"))
            if not any(j.startswith("kafka_2.13-") for j in jars):
                raise LocalKafkaError(f"Maven ran but {out} holds no kafka_2.13 jar: {jars}")
            if libs.exists():
                shutil.rmtree(libs)
            out.rename(libs)
            marker.write_text("\n".join(jars) + "\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return libs


def java_executable() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise LocalKafkaError("java is not on PATH (Kafka 4 brokers need Java 17+)")
    return java


def _check_java() -> None:
    proc = subprocess.run([java_executable(), "-version"], capture_output=True, text=True)
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if m:
        major = int(m.group(1))
        if major == 1 and m.group(2):
            major = int(m.group(2))
        if major < 17:
            raise LocalKafkaError(f"Kafka 4 needs Java 17+, {java_executable()} is Java {major}")
