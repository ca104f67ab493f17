"""README promises: the two commands, every configuration variable documented."""

from worker.config import VARIABLES

from tests import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def test_two_commands():
    assert "make test" in README and "make demo" in README


def test_every_variable_documented():
    missing = [v for v in VARIABLES if f"`{v}`" not in README]
    assert not missing, f"README lacks {missing}"


def test_ci_runs_exactly_the_readme_test_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
