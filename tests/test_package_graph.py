"""The package graph of docs/architecture.md: schemas <- worker <- producer_tools, deploy/local
standalone, and modules of one idea (no Python file over 600 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO_ROOT as ROOT
PACKAGES = ("schemas", "worker", "producer_tools", "deploy")
FORBIDDEN = {                      # package -> top-level packages of this repo it must not import
    "schemas": {"worker", "producer_tools", "deploy", "tests"},
    "worker": {"producer_tools", "deploy", "tests"},
    "producer_tools": {"tests"},
    "deploy": {"schemas", "worker", "producer_tools", "tests"},
}


def _python_files(*tops: str):
    for top in tops:
        yield from sorted((ROOT / top).rglob("*.py"))


def _imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_imports_point_one_way():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in _python_files(package):
            hit = _imported_tops(path) & forbidden
            if hit:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "\n".join(bad)


def test_worker_does_not_even_mention_the_producer_tools():
    assert not [p for p in _python_files("worker") if "producer_tools" in p.read_text()]


def test_no_python_file_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _python_files(*PACKAGES, "tests")
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long
