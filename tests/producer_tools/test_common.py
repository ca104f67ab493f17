"""producer_tools.common: command-line values; a closed Kafka port refused in one line."""

import os
import subprocess
import sys

import pytest

from producer_tools.common import parse_size

from tests import REPO_ROOT


def test_parse_size():
    assert parse_size("900KiB") == 921600 and parse_size("1MiB") == 1 << 20 and parse_size("123") == 123


@pytest.mark.parametrize("command", [["sink", "--lake", "LAKE", "--until-idle", "1"],
                                     ["dlq", "replay", "--from-topic", "--dry-run"]])
def test_a_closed_kafka_port_is_one_line_naming_the_flag_and_the_variable(command, tmp_path):
    command = [str(tmp_path / "lake") if c == "LAKE" else c for c in command]
    p = subprocess.run([sys.executable, "-m", "producer_tools", *command, "--bootstrap-servers", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "ALPAMAYO_KAFKA_WAIT_S": "1"})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "--bootstrap-servers" in err[0] and "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS" in err[0] and "127.0.0.1:1" in err[0]
