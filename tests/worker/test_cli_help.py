"""`alpamayo-worker serve --help` lists every environment variable of worker.config with its default."""

import os
import re
import subprocess
import sys

from worker.config import VARIABLES

from tests import REPO_ROOT


def test_serve_help_lists_every_variable_with_its_default():
    p = subprocess.run([sys.executable, "-m", "worker", "serve", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for name, meaning in VARIABLES.items():
        assert f" {name} {' '.join(meaning.split())}" in text, name
        assert re.search(r"\bdefault\b", meaning), f"{name}: the help does not say its default"
