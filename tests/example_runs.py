"""An example script run for the tests that read its summary. The example starts
`rollout-broker serve` itself (no --url) on the test Redis (a key prefix of its own) and a
Postgres database of its own. A module of such tests is one ``xdist_group``: its tests run in one
test process, which runs the example once for all of them (`--dist loadgroup`, pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.client.live import REPO, broker_env
from tests.services import fresh_database, redis_prefix


def example_summary(
    script: str, args: list[str], workdir: Path, *, timeout_s: float = 240
) -> dict[str, Any]:
    """``examples/<script> <args> --json-out ...``'s summary, with its output as ``stdout``."""
    summary = workdir / "summary.json"
    with redis_prefix() as prefix, fresh_database() as db:
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / script), *args, "--json-out", str(summary)],
            cwd=REPO,
            env=broker_env(prefix, db),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, Any] = json.loads(summary.read_text())
    out["stdout"] = proc.stdout
    return out
