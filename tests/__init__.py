"""The project's tests: one folder per package (tests/worker/model/ tests worker/model/, ...).

Every test folder is a package, so test modules of the same name in different folders do not
collide and test modules import shared helpers as ``tests.<folder>.<module>``.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
