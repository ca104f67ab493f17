"""The worker image (deploy/docker): CUDA base, non-root USER, HEALTHCHECK on /v1/health/ready,
ENTRYPOINT alpamayo-worker serve, weights mounted rather than copied; a small build context."""

from __future__ import annotations

import json
import re

from tests import REPO_ROOT
from tests.deploy.artefacts import DEPLOY, DOCKERFILE, duration_seconds


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile():
    instr = dockerfile_instructions()
    keywords = [k for k, _ in instr]
    args = dict(re.match(r"(\w+)=(.*)", v).groups() for k, v in instr if k == "ARG" and "=" in v)
    base = next(v for k, v in instr if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert "cuda" in base and ("pytorch" in base or "nvcr.io/nvidia" in base), base
    users = [v for k, v in instr if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "must run as non-root"
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    health = [v for k, v in instr if k == "HEALTHCHECK"]
    assert len(health) == 1
    assert "/v1/health/ready" in health[0] and "127.0.0.1" in health[0]
    assert "python" in health[0] and "curl" not in health[0] and "wget" not in health[0]
    start_period = re.search(r"--start-period=(\w+)", health[0])
    assert start_period and duration_seconds(start_period.group(1)) >= 300
    entry = json.loads(next(v for k, v in instr if k == "ENTRYPOINT"))
    assert entry[-2:] == ["alpamayo-worker", "serve"]
    assert "8000" in [v for k, v in instr if k == "EXPOSE"][0].split()
    runs = " ".join(v for k, v in instr if k == "RUN")
    assert re.search(r"pip install [^&]*\s\.(\s|$)", runs), "installs the package with pip install ."
    assert not any(k == "COPY" and "models" in v for k, v in instr), "weights are mounted, not copied"
    env = " ".join(v for k, v in instr if k == "ENV")
    assert "ALPAMAYO_CACHE=" in env
    # NIM_FT_CHECKPOINT / NIM_ALPAMAYO_SPECULATIVE_MODEL must not be baked in: they cannot be combined
    # and an empty mount point would be rejected; they are set per deployment.
    assert "NIM_FT_CHECKPOINT" not in env and "NIM_ALPAMAYO_SPECULATIVE_MODEL" not in env


def test_dockerignore_keeps_context_small():
    path = REPO_ROOT / ".dockerignore"
    if not path.exists():
        path = DEPLOY / "docker" / ".dockerignore"
    patterns = {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert ".git" in patterns
    for needed in ("pyproject.toml", "worker", "schemas", "producer_tools", "README.md"):
        assert needed not in patterns and f"/{needed}" not in patterns
