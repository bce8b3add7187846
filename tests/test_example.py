"""examples/async_grpo.py, short: the reward improves, and the accounting adds up."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.live import REPO, broker_env
from tests.services import fresh_database, redis_prefix

pytestmark = pytest.mark.slow  # the example trains for 60 policy versions in subprocesses


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out = tmp_path_factory.mktemp("grpo") / "summary.json"
    with redis_prefix() as prefix, fresh_database() as db:
        # No --url: the example starts `rollout-broker serve` itself, on the BROKER_* services.
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "async_grpo.py"),
                "--steps",
                "60",
                "--seconds",
                "90",
                "--generators",
                "2",
                "--json-out",
                str(out),
            ],
            cwd=REPO,
            env=broker_env(prefix, db),
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, Any] = json.loads(Path(out).read_text())
    summary["stdout"] = proc.stdout
    yield summary


def test_reward_clearly_improves(run: dict[str, Any]) -> None:
    # The time budget is only a guard against a hang: every step must have been trained.
    assert run["versions"] == 60, run["stdout"]
    assert run["initial_reward"] == pytest.approx(0.1)  # uniform over 10 tokens
    assert run["final_reward"] > 0.3, run["stdout"]
    rewards = [r for _, r in run["history"]]
    # Asynchronous updates may dip now and then, but the trend is up: the last third of the
    # run is better than the first third.
    third = max(1, len(rewards) // 3)
    assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third, rewards


def test_accounting_adds_up(run: dict[str, Any]) -> None:
    acc = run["accounting"]
    assert acc is not None, "the example printed no accounting"
    assert acc["pending_events"] == 0
    retired = sum(acc["retired"].values())
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + retired
    assert acc["samples_consumed"] == run["acked_rollouts"]  # Σ sizes of the acked batches
    assert acc["batches"]["acked"] == run["versions"]
    assert acc["buffered"] == acc["leased"] == 0  # the example closes its run
    assert acc["rollouts_received"] == 8 * acc["groups_received"]  # K = 8 responses per prompt
    assert sum(acc["lag"]["histogram"].values()) == acc["samples_consumed"]
    assert acc["reuse_factor"] == pytest.approx(acc["samples_consumed"] / acc["rollouts_received"])
    assert "Accounting of" in run["stdout"] and "Rollouts vs samples" in run["stdout"]
