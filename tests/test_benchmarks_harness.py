"""The benchmark harness end to end at its tiny size: real Redis, the broker and the naive
baseline under uvicorn, forked load processes, for the access-control and metrics rows pairs of
brokers (off and on) on a database of the test Postgres, and for the drain rows a worker
SIGKILLed and restarted beside one started fresh; every row is there with a positive figure,
its ratios are the broker against its baselines, and each target's verdict follows from its
ratio."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import QUICK
from benchmarks.payloads import RAW_BYTES, big_json_body
from benchmarks.rediscluster import MASTERS, cluster_binaries
from benchmarks.sections.auth import AUTH_NEED
from benchmarks.sections.bodies import HOSTILE
from benchmarks.sections.cluster import BALANCE_NEED
from benchmarks.sections.drain import DRAIN_GROUP_NEED, DRAIN_NEED_S
from benchmarks.sections.long import LONG_NEED
from benchmarks.sections.metrics import METRICS_NEED
from benchmarks.sections.replicas import REPLICAS_NEED
from benchmarks.sections.tokens import TOKENS_NEED
from benchmarks.servers import find_redis_server

RATES = ("rollouts/s", "prompts/s")

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
    rows += [f"durable_floor.ingest.p{procs}" for procs in (1, 4)]
    rows += [f"lease_ack.{fmt}.{s.batch}" for fmt in ("msgpack", "json")]
    rows += [f"http_floor.lease_ack.{s.batch}"]
    rows += [f"lease_latency.{n}.p{q}" for n in s.latency_sizes for q in (50, 99)]
    rows += [f"scale.buffered.{n}.p{q}" for n in s.levels for q in (50, 99)]
    rows += [f"scale.trainers.{n}.{k}" for n in s.trainers for k in ("p50", "p99", "rate")]
    rows += [f"work.queued.{n}.{k}" for n in s.work_levels for k in ("rate", "p50", "p99")]
    rows += ["work.partials.rate", "work.partials.p50"]
    rows += ["bodies.healthz.idle.p50", "bodies.healthz.ingest.p50", "bodies.healthz.ingest.max"]
    rows += ["bodies.ingest", "bodies.peak_rss"]
    rows += [
        f"bodies.hostile.{name}.{k}" for name in HOSTILE for k in ("cpu", "peak_rss", "healthz_max")
    ]
    rows += [f"long.ingest.msgpack.{s.long_per_req}.p{n}" for n in (1, 4)]
    rows += ["long.ingest.json.1.p1", f"long.lease_ack.msgpack.{s.long_batch}"]
    rows += [f"http_floor.long.lease_ack.{s.long_batch}"]
    rows += [
        f"{toggle}.{case}.{side}"
        for toggle in ("auth", "metrics")
        for case in AUTH_CASES
        for side in ("off", "on")
    ]
    rows += [f"metrics.scrape.{n}" for n in s.scrape_runs]
    rows += [
        f"workers.{key}.w{n}"
        for key in ("ingest.json.1", "ingest.msgpack.64", f"lease_ack.msgpack.{s.batch}")
        for n in (1, 2)
    ]
    rows += ["drain.fresh", "drain.restart.median", "drain.restart.max"]
    if cluster_binaries() is not None:  # the cluster rows are skipped without a redis-server
        rows += [f"cluster.{key}.{side}" for key in ("ingest", "lease_ack") for side in SIDES]
        rows += [f"cluster.redis_cpu.{n}" for n in ("single", *CLUSTER_MASTERS, "all")]
    if find_redis_server() is not None:  # a replica is attached to a private Redis only
        rows += [f"replicas.{case}.{side}" for case in AUTH_CASES for side in ("off", "on")]
    rows += [
        f"tokens.{case}.{side}"
        for case in ("ingest.msgpack.64", "ingest.json.1")
        for side in ("off", "on")
    ]
    return rows


AUTH_CASES = ("ingest.json.1", "ingest.msgpack.64", f"lease_ack.msgpack.{QUICK.batch}")
AUTH_TARGET = f"≥{AUTH_NEED}× auth off"
METRICS_TARGET = f"≥{METRICS_NEED}× metrics off"
REPLICAS_TARGET = f"≥{REPLICAS_NEED}× replicas off"
TOKENS_TARGET = f"≥{TOKENS_NEED}× tokens off"
SIDES = ("single", "cluster")
CLUSTER_MASTERS = [f"master{i + 1}" for i in range(MASTERS)]
BALANCE_TARGET = f"≤{BALANCE_NEED}× busiest/least busy master"
LONG_TARGET = f"≥{LONG_NEED}× raw"  # 32,768-token lease + ack against the raw read ceiling
DRAIN_TARGET = f"≤{DRAIN_NEED_S:g} s after restart"  # the worst restart's catch-up, absolute
DRAIN_GROUP_TARGET = f"≤{DRAIN_GROUP_NEED} consumer in group/heartbeats"


def _number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _vs(row: dict[str, Any], base: float) -> float:
    """The broker against a baseline as benchmarks/README.md defines it: above 1 is better, so
    rates are broker ÷ baseline and latencies and bytes baseline ÷ broker."""
    value = float(row["value"])
    return value / base if row["unit"] in RATES else base / value


def _shown(value: float, unit: str) -> str:
    if unit == "rollouts/s":
        return f"{value:,.0f} r/s"
    if unit == "prompts/s":
        return f"{value:,.0f} prompts/s"
    if unit == "ms":
        return f"{value:.2f} ms" if value < 100 else f"{value:,.0f} ms"
    return f"{value:,.0f} B"


def _cells(stdout: str) -> dict[str, list[str]]:
    """The printed table's cells by measure (the column heads are in benchmarks/report.py)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith(("| **", "| measure |")):
            cells = line[2:-2].split(" | ", 8)
            out[cells[0]] = cells
    return out


@pytest.mark.slow
def test_quick_run_reports_every_row_with_consistent_ratios_and_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    if "BROKER_TEST_REDIS_URL" in env:  # used only when no redis-server binary is found
        env.setdefault("BENCH_REDIS_URL", env["BROKER_TEST_REDIS_URL"])
    if "BROKER_TEST_PG_URL" in env:  # the auth rows' brokers need a database
        env.setdefault("BENCH_PG_URL", env["BROKER_TEST_PG_URL"])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads(out.read_text())
    rows = {r["id"]: r for r in doc["rows"]}
    assert list(rows) == expected_rows()  # every section, every row, in order
    for rid, r in rows.items():
        # What a hostile body costs may round to nothing (CPU by the clock tick, memory by page).
        assert _number(r["value"]) or (rid.startswith("bodies.hostile.") and r["value"] == 0), (
            rid,
            r["value"],
        )
        assert r["unit"] in (*RATES, "ms", "bytes"), rid

    # Every comparable row carries its baselines, measured in the same run, and its ratios are
    # the broker against them.
    for rid, r in rows.items():
        if rid.startswith(
            (
                "ingest.",
                "durable_floor.",
                "lease_ack.",
                "lease_latency.",
                "memory.used_memory",
                "long.",
            )
        ):
            assert _number(r["raw"]) and _number(r["naive"]), rid
        if rid.startswith(
            ("scale.trainers.", "http_floor.", "memory.memory_usage", "work.queued.")
        ):
            assert _number(r["raw"]), rid
        if rid.startswith(  # each other
            ("auth.", "metrics.", "cluster.", "drain.", "replicas.", "work.partials.")
        ):
            assert r["raw"] is None and r["naive"] is None, rid
        for base, ratio in (("raw", "vs_raw"), ("naive", "vs_naive")):
            if r[base] is None:
                assert r[ratio] is None, (rid, ratio)
            else:
                assert r[ratio] == pytest.approx(_vs(r, r[base]), rel=1e-12), (rid, ratio)

    # The targets are evaluated on the right ratio, and each verdict agrees with it: ingest and
    # lease against raw Redis, everything comparable against the naive buffer, memory against
    # the raw array bytes.
    targets = {(rid, t["name"]): (r, t) for rid, r in rows.items() for t in r["targets"]}
    for procs in (1, 4):
        assert (f"ingest.msgpack.64.p{procs}", "≥0.5× raw") in targets
    assert (f"lease_ack.msgpack.{QUICK.batch}", "≥0.5× raw") in targets
    assert ("memory.used_memory", "≤1.25× raw arrays") in targets
    # One JSON rollout a request from one generator: against the naive buffer and the durable
    # floor; the other one-rollout rows against the naive buffer.
    assert ("ingest.json.1.p1", "≥1× naive") in targets
    assert ("ingest.json.1.p1", "≥0.9× durable floor") in targets
    for fmt, procs in (("json", 4), ("msgpack", 1), ("msgpack", 4)):
        assert (f"ingest.{fmt}.1.p{procs}", ">1× naive") in targets
    assert (f"lease_ack.json.{QUICK.batch}", "≥2× naive") in targets
    top, least = QUICK.levels[-1], QUICK.levels[0]
    for q in (50, 99):
        assert (f"scale.buffered.{top}.p{q}", f"≤1.3× at {least:,}") in targets
    assert (f"scale.trainers.{max(QUICK.trainers)}.p99", "≤1.5× raw's n-to-1 ratio") in targets
    assert ("bodies.peak_rss", "≤4× body") in targets
    assert (f"long.lease_ack.msgpack.{QUICK.long_batch}", LONG_TARGET) in targets
    # The drain's catch-up after a SIGKILL and restart: the worst one within 5 s of the new
    # worker's start, and the group no larger than the live worker; the fresh start and the
    # median carry no target.
    assert ("drain.restart.max", DRAIN_TARGET) in targets
    assert ("drain.restart.max", DRAIN_GROUP_TARGET) in targets
    assert not rows["drain.fresh"]["targets"] and not rows["drain.restart.median"]["targets"]
    assert rows["drain.restart.median"]["value"] <= rows["drain.restart.max"]["value"]
    # Auth (metrics, waiting for a replica) on against off, the same case of the same run: at
    # most 5 % (3 %, 20 %) slower.
    for case in AUTH_CASES:
        pairs = [("auth", AUTH_TARGET), ("metrics", METRICS_TARGET)]
        if find_redis_server() is not None:
            pairs.append(("replicas", REPLICAS_TARGET))
        for toggle, target in pairs:
            assert (f"{toggle}.{case}.on", target) in targets
            assert not rows[f"{toggle}.{case}.off"]["targets"]
    big_body = len(big_json_body(QUICK.big_rollouts))
    hostile_size = {name: len(make()[0]) for name, make in HOSTILE.items()}

    def expected(rid: str, r: dict[str, Any], name: str) -> tuple[float, float, bool]:
        if rid.startswith("bodies.hostile."):  # CPU and /healthz in ms, memory against its body
            return {
                "≤1 s CPU": (r["value"] / 1e3, 1.0, True),
                "≤4× body": (r["value"] / hostile_size[rid.split(".")[2]], 4.0, True),
                "≤100 ms": (r["value"] / 1e3, 0.1, True),
            }[name]
        if name in (AUTH_TARGET, METRICS_TARGET, REPLICAS_TARGET, TOKENS_TARGET):
            off = rows[rid.removesuffix(".on") + ".off"]
            need = {
                AUTH_TARGET: AUTH_NEED,
                METRICS_TARGET: METRICS_NEED,
                TOKENS_TARGET: TOKENS_NEED,
            }
            return r["value"] / off["value"], need.get(name, REPLICAS_NEED), False
        if name == BALANCE_TARGET:  # the cluster's masters' Redis CPU, busiest over least busy
            cpu = [rows[f"cluster.redis_cpu.{m}"]["value"] for m in CLUSTER_MASTERS]
            assert rid == "cluster.redis_cpu.all" and r["value"] == pytest.approx(sum(cpu))
            return max(cpu) / min(cpu), BALANCE_NEED, True
        if name == DRAIN_TARGET:  # seconds, from the row's milliseconds
            return r["value"] / 1e3, DRAIN_NEED_S, True
        if name == DRAIN_GROUP_TARGET:  # a count of consumers, shown in the row's note
            count = next(t["ratio"] for t in r["targets"] if t["name"] == name)
            assert count == int(count) >= 1, (rid, count)
            assert f"{int(count)}/" in r["note"], (rid, r["note"])
            return count, DRAIN_GROUP_NEED, True
        if name == "≤1.5× raw's n-to-1 ratio":  # the broker's growth over raw Redis's
            one = rows["scale.trainers.1.p99"]
            return (r["value"] / one["value"]) / (r["raw"] / one["raw"]), 1.5, True
        if name == "≥0.9× durable floor":
            return r["value"] / rows["durable_floor.ingest.p1"]["value"], 0.9, False
        if name.startswith("≤1.3× at "):  # the most buffered against the least
            first = rows[rid.replace(f".{QUICK.levels[-1]}.", f".{QUICK.levels[0]}.")]
            return r["value"] / first["value"], 1.3, True
        return {
            "≥0.5× raw": (r["vs_raw"], 0.5, False),
            LONG_TARGET: (r["vs_raw"], LONG_NEED, False),
            ">1× naive": (r["vs_naive"], 1.0, False),
            "≥1× naive": (r["vs_naive"], 1.0, False),
            "≥2× naive": (r["vs_naive"], 2.0, False),
            "≤1.25× raw arrays": (r["value"] / RAW_BYTES, 1.25, True),
            "≤4× body": (r["value"] / big_body, 4.0, True),
        }[name]

    for (rid, name), (r, t) in targets.items():
        want, need, at_most = expected(rid, r, name)
        assert t["ratio"] == pytest.approx(want, rel=1e-12), (rid, name)
        assert (t["need"], t["at_most"]) == (need, at_most), (rid, name)
        assert t["ok"] is (want <= need if at_most else want >= need), (rid, name, t)

    # The printed table shows each row's figures, ratios and verdicts as the JSON has them.
    printed = _cells(proc.stdout)
    for rid, r in rows.items():
        cells = printed[r["measure"]]
        assert cells[1] == _shown(r["value"], r["unit"]), (rid, cells)
        for col, ratio in ((4, r["vs_raw"]), (6, r["vs_naive"])):
            assert cells[col] == ("–" if ratio is None else f"×{ratio:.2f}"), (rid, cells)
        verdicts = [
            f"{t['name']}: {t['ratio']:.2f} {'PASS' if t['ok'] else 'MISS'}" for t in r["targets"]
        ]
        assert cells[7] == "; ".join(verdicts), (rid, cells)
    passed = sum(t["ok"] for _, t in targets.values())
    assert f"targets: {passed} PASS, {len(targets) - passed} MISS" in proc.stdout


def run_benchmark(module: str, *args: str, timeout: int = 120) -> str:
    """The output of ``python -m benchmarks.<module> *args``, which must succeed; skipped
    without a redis-server of version 7 or later to start."""
    if find_redis_server() is None:
        pytest.skip(f"benchmarks.{module} needs a redis-server of version 7 or later")
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_layout_probe_runs_every_way_and_reports_ratios_against_raw() -> None:
    """benchmarks/layout.py at its tiny size: the raw ceiling, the broker's own scripts and the
    two bucket layouts each lease and ack on a private redis-server and give everything back
    (the probe checks that before it prints), and each ratio is raw's figure over the way's."""
    stdout = run_benchmark("layout", "--quick")
    rows = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\| (.+?) \| ([\d,]+) µs \| ×([\d.]+) \|", line)
        if m:
            rows[m[1]] = (int(m[2].replace(",", "")), float(m[3]))
    assert list(rows) == ["raw", "broker", "bucket sketch", "bucket zsets"], stdout
    raw_us = rows["raw"][0]
    assert raw_us > 0
    for name, (us, ratio) in rows.items():
        assert us > 0, name
        # Both figures are printed to the µs, the ratio to 0.01: what the rounding leaves open.
        low, high = (raw_us - 0.5) / (us + 0.5), (raw_us + 0.5) / (us - 0.5)
        assert low - 0.005 <= ratio <= high + 0.005, (name, us, ratio, raw_us)


def test_functions_benchmark_compares_the_library_with_the_same_code_as_a_script() -> None:
    """benchmarks/functions.py at its tiny size: each row's FCALL and EVALSHA figures come from
    Redis's own stats (both above zero, so both ways ran), and the saving is their difference."""
    stdout = run_benchmark("functions", "--quick")
    row = re.compile(r"\| (.+?) \| ([\d.]+) µs \| ([\d.]+) µs \| (-?[\d.]+) µs \|")
    rows = {m[1]: m for line in stdout.splitlines() if (m := row.fullmatch(line))}
    assert list(rows) == ["policy_view", "ingest, 1 rollout", "sweep, nothing to sweep"]
    for m in rows.values():
        fcall, evalsha, saved = float(m[2]), float(m[3]), float(m[4])
        assert fcall > 0 and evalsha > 0
        assert abs(evalsha - fcall - saved) <= 0.11, m[0]


FEATURES = ["plain", "loss masks", "per-token versions", "rewards pending", "a consumer"]


def test_features_benchmark_reports_each_feature_against_the_plain_run() -> None:
    """benchmarks/features.py at a tiny size: every run's lease + ack (the ack measuring every
    rollout's logprobs) is timed on a private Redis and a broker, each lease must hand out a
    full batch (or the run stops), each ratio is the row's figure over the plain run's, and a
    feature passes when both its ratios are at most 1.03."""
    stdout = run_benchmark("features", "--rounds", "2", "--tokens", "16")
    row = re.compile(
        r"\| (.+?) \| ([\d,.]+) ms \| ×([\d.]+) \| ([\d,]+) µs \| ×([\d.]+) \| (\w*) \|"
    )
    rows = {m[1]: m for line in stdout.splitlines() if (m := row.fullmatch(line))}
    assert list(rows) == FEATURES, stdout
    plain_ms = float(rows["plain"][2].replace(",", ""))
    plain_us = int(rows["plain"][4].replace(",", ""))
    for name, m in rows.items():
        ms, us = float(m[2].replace(",", "")), int(m[4].replace(",", ""))
        assert ms > 0 and us > 0, name
        # Figures are printed to 0.1 ms and 1 µs, ratios to 0.01: what the rounding leaves open.
        for shown, x, base, half in ((m[3], ms, plain_ms, 0.05), (m[5], us, plain_us, 0.5)):
            low, high = (x - half) / (base + half), (x + half) / (base - half)
            assert low - 0.005 <= float(shown) <= high + 0.005, (name, shown)
        worst = max(float(m[3]), float(m[5]))  # the latency's and Redis's ratios, both
        want = "" if name == "plain" else ("PASS" if worst <= 1.03 else "MISS")
        assert m[6] == want or abs(worst - 1.03) < 0.01, (name, m[6], worst)


def base_name(row: str) -> str:
    """The row a consumers benchmark row is compared with."""
    return "trainer, beside a reader" if row == "consumer reader" else "trainer, no consumers"


def test_consumers_benchmark_reports_each_setup_against_the_plain_trainer() -> None:
    """benchmarks/consumers.py at a tiny size: every setup's lease + ack is timed on a private
    Redis and a broker (each lease must hand out a full batch, or the run stops), and each
    ratio is the row's latency over its baseline's."""
    stdout = run_benchmark("consumers", "--rounds", "2", "--tokens", "16")
    rows, redis_rows = {}, {}
    for line in stdout.splitlines():
        m = re.fullmatch(
            r"\| (.+?) \| ([\d,.]+) ms \| ([\d,]+) \| ×([\d.]+) \| ([\d,]+) µs \| ×([\d.]+) \|",
            line,
        )
        if m:
            rows[m[1]] = (float(m[2].replace(",", "")), float(m[4]))
            redis_rows[m[1]] = (int(m[5].replace(",", "")), float(m[6]))
    assert list(rows) == [
        "trainer, no consumers",
        "trainer, 1 consumer (rollouts)",
        "trainer, 3 consumers (2 rollouts, 1 best_worst pairs)",
        "trainer, 1 consumer (all pairs)",
        "trainer, beside a reader",
        "consumer reader",
    ], stdout
    assert rows["trainer, no consumers"][1] == 1.0
    for name, (ms, ratio) in rows.items():
        base = rows[base_name(name)]
        # Latencies are printed to 0.1 ms and ratios to 0.01: what the rounding leaves open.
        low, high = (ms - 0.05) / (base[0] + 0.05), (ms + 0.05) / max(base[0] - 0.05, 1e-9)
        assert low - 0.005 <= ratio <= high + 0.005, (name, ms, ratio, base)
        us, us_ratio = redis_rows[name]
        b_us = redis_rows[base_name(name)][0]
        low, high = (us - 0.5) / (b_us + 0.5), (us + 0.5) / (b_us - 0.5)  # µs to 1, ratio to 0.01
        assert us > 0 and low - 0.005 <= us_ratio <= high + 0.005, (name, us, us_ratio, b_us)


def test_slow_rewards_quick_run_checks_every_trained_reward_and_compares_idle_shares(
    tmp_path: Path,
) -> None:
    """benchmarks/slow_rewards.py at its tiny size: both arms run on a private Redis, a broker
    and a worker, the slow arm's hung rollouts come back through expired reward leases, every
    trained rollout carried its verifier score (the run stops with an error otherwise), and the
    target is the slow arm's idle share over the other's, in points."""
    out = tmp_path / "slow.json"
    env = dict(os.environ)
    if "BROKER_TEST_PG_URL" in env:
        env.setdefault("BENCH_PG_URL", env["BROKER_TEST_PG_URL"])
    if find_redis_server() is None and "BROKER_TEST_REDIS_URL" in env:
        env.setdefault("BENCH_REDIS_URL", env["BROKER_TEST_REDIS_URL"])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.slow_rewards", "--quick", "--json", str(out)],
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
    assert list(rows) == [
        "slow_rewards.at_once.idle",
        "slow_rewards.slow.idle",
        "slow_rewards.at_once.trained",
        "slow_rewards.slow.trained",
    ]
    fast, slow = doc["arms"]["at-once"], doc["arms"]["slow"]
    for arm in (fast, slow):
        assert arm["trained"] > 0 and arm["checked"] == arm["trained"], arm
        assert arm["idle_s"] <= arm["span_s"], arm
    # The at-once verifier never hangs; the slow one does (seed 1 hangs rollouts of the first
    # groups), the leases holding them expire and the rollouts are scored on a later lease. On a
    # loaded machine a lease of the at-once verifier may run past the quick run's timeout too:
    # its rollouts are then scored on another lease, which the checks above cover.
    assert fast["hung"] == fast["dropped"] == 0, fast
    assert slow["hung"] >= 1 and slow["dropped"] >= 1, slow
    assert slow["lease.expired"] >= slow["dropped"] and slow["rescored"] >= 1, slow
    for key, arm in (("at_once", fast), ("slow", slow)):
        assert rows[f"slow_rewards.{key}.idle"]["value"] == pytest.approx(arm["idle_s"] * 1e3)
        trained = rows[f"slow_rewards.{key}.trained"]
        assert trained["value"] == pytest.approx(arm["trained"] / arm["span_s"]), key
    (target,) = rows["slow_rewards.slow.idle"]["targets"]
    points = 100 * (slow["idle_s"] / slow["span_s"] - fast["idle_s"] / fast["span_s"])
    assert target["ratio"] == pytest.approx(points, rel=1e-12)
    assert (target["need"], target["at_most"]) == (5.0, True)
    assert target["ok"] is (points <= 5.0)
    printed = _cells(proc.stdout)
    for r in rows.values():
        assert printed[r["measure"]][1] == _shown(r["value"], r["unit"]), r["id"]
    verdict = "PASS" if target["ok"] else "MISS"
    assert printed[rows["slow_rewards.slow.idle"]["measure"]][7].endswith(verdict)


LIBRARIES = ("msgspec", "ormsgpack", "granian")
LIBRARY_CASES = [
    f"ingest {body}: {what}"
    for body in ("JSON, 1 rollout", "msgpack, 64 rollouts", "JSON, 64 rollouts")
    for what in (
        "parse_body, counts + pydantic vs counts + msgspec",
        "without counts or limits: pydantic vs msgspec decode",
    )
] + [
    "lease answer, 256 rollouts: render (msgpack.Packer) vs ormsgpack.packb",
    "lease, 256 stored rollouts read back: msgpack.unpackb vs ormsgpack.unpackb",
    "ingest msgpack, 64 rollouts, decode: counts + unpackb with limits vs ormsgpack",
    *(
        f"HTTP {app} app, {clients}: {what}"
        for app in ("trivial", "naive")
        for clients in ("1 client", "4 clients")
        for what in ("wall time per request", "server CPU per request")
    ),
]


def _libraries_missing() -> list[str]:
    import importlib.util

    return [name for name in LIBRARIES if importlib.util.find_spec(name) is None]


def test_libraries_benchmark_reports_every_case_with_consistent_ratios() -> None:
    """benchmarks/libraries.py at its tiny size: every case is timed for the broker's code (or
    uvicorn) and the candidate library (the run stops if a candidate's result differs from the
    broker's), and each ratio is the current figure over the candidate's; a wall-time row's
    rate is the same figure as requests per second."""
    if missing := _libraries_missing():
        pytest.skip(f"benchmarks.libraries needs {', '.join(missing)} (pip install)")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.libraries", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figure = r"([\d,]+\.\d) µs(?: \(([\d,]+) r/s\))?"
    row = re.compile(rf"\| (.+?) \| {figure} \| {figure} \| ([\d.]+) \|")
    rows = {m[1]: m for line in proc.stdout.splitlines() if (m := row.fullmatch(line))}
    assert list(rows) == LIBRARY_CASES, proc.stdout
    assert "cpu load: " in proc.stdout
    for name, m in rows.items():
        cur, cand = float(m[2].replace(",", "")), float(m[4].replace(",", ""))
        ratio = float(m[6])
        assert cur > 0 and cand > 0, name
        # Figures are printed to 0.1 µs, ratios to 0.01: what the rounding leaves open.
        low, high = (cur - 0.05) / (cand + 0.05), (cur + 0.05) / (cand - 0.05)
        assert low - 0.005 <= ratio <= high + 0.005, (name, cur, cand, ratio)
        assert (m[3] is None) == (m[5] is None) == ("wall time" not in name), name
        for us, rate in ((cur, m[3]), (cand, m[5])):
            if rate is not None:  # to the request per second
                r = float(rate.replace(",", ""))
                assert 1e6 / (us + 0.05) - 0.5 <= r <= 1e6 / (us - 0.05) + 0.5, (name, us, r)


GOOD_ROLLOUT: dict[str, Any] = {
    "rollout_id": "r1",
    "policy_version": 0,
    "response_ids": [1, 2, 3],
    "logprobs": [-0.5, -0.1, -0.25],
    "reward": 1.0,
}
REFUSED = [
    {"rollout_id": "a b"},
    {"rollout_id": "a{b"},
    {"rollout_id": "a\x7fb"},
    {"rollout_id": "ab\n"},  # Python's `$` would take it; the broker's pattern does not
    {"rollout_id": ""},
    {"rollout_id": "x" * 257},
    {"rollout_id": "\u200bab"},  # a zero-width space: a format character
    {"group_id": "é é"},
    {"generator_id": "g\x00"},
    {"policy_version": -1},
    {"policy_version": True},
    {"response_ids": [1, True]},
    {"response_ids": [1.5]},
    {"response_ids": None},
    {"logprobs": ["0.1"]},
    {"versions": [[0, 1, 2]]},
    {"versions": []},
    {"versions": [[0, -1]]},
    {"finish_reason": "done"},
    {"reward": "1.0"},
    {"reward": 1e13},
    {"metadata": {"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}},  # 17 levels below the top
    {"surplus": 1},
]
TAKEN = [
    {"rollout_id": "été-1"},
    {"rollout_id": "x" * 256, "group_id": "g#0.1", "generator_id": "gen-1"},
    {"versions": [[0, 0]], "finish_reason": "length", "metadata": {"k": [1, "x", None]}},
    {"reward": None, "loss_mask": [1, 0, 1]},
]


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_msgspec_structs_of_the_libraries_benchmark_refuse_what_the_broker_refuses(
    fmt: str,
) -> None:
    """The msgspec Structs benchmarks/libraries.py times against the broker's parse check what
    its pydantic models check: each rollout below is refused by both or taken by both (and
    then packs the same), so the two parses do the same work."""
    if "msgspec" in _libraries_missing() or "ormsgpack" in _libraries_missing():
        pytest.skip("benchmarks.lib_codecs needs msgspec and ormsgpack (pip install)")
    import msgpack
    import msgspec
    import orjson

    from app.errors import ValidationFailed
    from benchmarks import lib_codecs

    encode = msgpack.packb if fmt == "msgpack" else orjson.dumps
    refused = [*REFUSED]
    if fmt == "msgpack":  # JSON has no NaN
        refused += [{"reward": math.nan}, {"metadata": {"a": math.inf}}]
    for change in refused:
        rollout = {k: v for k, v in {**GOOD_ROLLOUT, **change}.items() if v is not None}
        body = encode({"rollouts": [rollout]})
        with pytest.raises(ValidationFailed):
            lib_codecs.broker_parse(body, fmt)
        with pytest.raises(msgspec.ValidationError):
            lib_codecs.msgspec_parse(body, fmt)
        with pytest.raises(msgspec.ValidationError):
            lib_codecs.msgspec_alone(body, fmt)
    for change in TAKEN:
        rollout = {k: v for k, v in {**GOOD_ROLLOUT, **change}.items() if v is not None}
        lib_codecs.same_parse(encode({"rollouts": [rollout]}), fmt, 1024)
