"""The benchmark harness end to end at its tiny size: real Redis, the broker and the naive
baseline under uvicorn, forked load processes; every row of the table is there with numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import QUICK

ROOT = Path(__file__).resolve().parent.parent


def expected_rows() -> list[str]:
    s = QUICK
    rows = ["memory.used_memory", "memory.memory_usage"]
    rows += [
        f"ingest.{fmt}.{per}.p{procs}"
        for fmt in ("json", "msgpack")
        for per in (1, 64)
        for procs in (1, 4)
    ]
    rows += [f"lease_ack.{fmt}.{s.batch}" for fmt in ("msgpack", "json")]
    rows += [f"http_floor.lease_ack.{s.batch}"]
    rows += [f"lease_latency.{n}.p{q}" for n in s.latency_sizes for q in (50, 99)]
    rows += [f"scale.buffered.{n}.p{q}" for n in s.levels for q in (50, 99)]
    rows += [f"scale.trainers.{n}.{k}" for n in s.trainers for k in ("p50", "p99", "rate")]
    return rows


def _number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_quick_run_prints_every_row_with_numbers(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    if "BROKER_TEST_REDIS_URL" in env:  # used only when no redis-server binary is found
        env.setdefault("BENCH_REDIS_URL", env["BROKER_TEST_REDIS_URL"])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    rows = {r["id"]: r for r in doc["rows"]}
    assert list(rows) == expected_rows()
    for rid, r in rows.items():
        assert _number(r["value"]), (rid, r["value"])
    # Every comparable row carries its baselines, measured in the same run.
    for rid, r in rows.items():
        if rid.startswith(("ingest.", "lease_ack.", "lease_latency.")):
            assert _number(r["raw"]) and _number(r["naive"]), rid
            assert _number(r["vs_raw"]) and _number(r["vs_naive"]), rid
        if rid.startswith("scale.trainers."):
            assert _number(r["raw"]), rid
    assert _number(rows["memory.used_memory"]["raw"])
    assert _number(rows["memory.used_memory"]["naive"])

    # The targets are evaluated: ingest and lease against raw Redis, everything comparable
    # against the naive buffer, memory against the raw array bytes.
    targets = {(rid, t["name"]) for rid, r in rows.items() for t in r["targets"]}
    for procs in (1, 4):
        assert (f"ingest.msgpack.64.p{procs}", "≥0.5× raw") in targets
    assert (f"lease_ack.msgpack.{QUICK.batch}", "≥0.5× raw") in targets
    assert ("memory.used_memory", "≤1.3× raw arrays") in targets
    assert all(isinstance(t["ok"], bool) for r in rows.values() for t in r["targets"])

    # The printed table has one line per row, and the verdicts.
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    measures = [r["measure"] for r in doc["rows"]]
    for m in measures:
        assert any(line.startswith(f"| {m} |") for line in table), m
    assert "PASS" in proc.stdout or "MISS" in proc.stdout
    assert "targets:" in proc.stdout
