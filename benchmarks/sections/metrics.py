"""``--only metrics``: throughput with metrics on against off (see :mod:`benchmarks.pairs`), and
the cost of a scrape as open runs grow.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from app import keys
from benchmarks.harness import Bench, Row, delete_keys
from benchmarks.load import Http, expect
from benchmarks.pairs import Toggle, paired_rows
from benchmarks.servers import Server, postgres_database, proc_cpu_s, tree_env, uvicorn_server

METRICS_NEED = 0.97  # metrics on may cost at most 3 % of the throughput with metrics off
SCRAPE_EVERY_S = 5.0  # GET /metrics on the metrics-on broker while it is measured
PROMETHEUS_INTERVAL_S = 15.0  # deploy/prometheus/prometheus.yml's scrape_interval


METRICS_TOGGLE = Toggle(
    "metrics",
    "Metrics overhead",
    "BROKER_METRICS",
    METRICS_NEED,
    {"off": {"BROKER_METRICS": "off"}, "on": {"BROKER_METRICS": "on"}},
    f"metrics on (requests timed; GET /metrics every {SCRAPE_EVERY_S:g} s)",
)


def check_metrics(servers: dict[str, Server]) -> None:
    """Metrics are on where they should be: ``on`` serves /metrics, ``off`` answers 404."""
    for side, want in (("on", 200), ("off", 404)):
        http = Http(servers[side].address)
        status, data, _ = http.call("GET", "/metrics")
        http.close()
        expect(status, data, want)


@contextlib.contextmanager
def scraping(server: Server, every_s: float) -> Iterator[None]:
    """GET /metrics on ``server`` every ``every_s`` seconds, as Prometheus would (only more
    often than its default 15 s), until the block ends."""
    stop = threading.Event()

    def scrape() -> None:
        http = Http(server.address)
        while not stop.wait(every_s):
            status, data, _ = http.call("GET", "/metrics")
            expect(status, data, 200)
        http.close()

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def metrics_rows(b: Bench) -> list[Row]:
    """Ingest and lease + ack with metrics off and on (see :func:`paired_rows`), the on side
    scraped every ``SCRAPE_EVERY_S`` while it is measured; then what one scrape costs."""

    def prepare(servers: dict[str, Server]) -> dict[str, str | None]:
        check_metrics(servers)
        return {"off": None, "on": None}

    rows = paired_rows(
        b, METRICS_TOGGLE, prepare, lambda servers: scraping(servers["on"], SCRAPE_EVERY_S)
    )
    return rows + scrape_cost_rows(b)


def scrape_cost_rows(b: Bench) -> list[Row]:
    """The broker's CPU per ``GET /metrics`` with 1, 10, ... open runs whose events the drain
    (a ``rollout-broker worker`` beside the broker) has applied: a scrape reads each open run's
    accounting, so its cost grows with them. On a key prefix of its own, deleted afterwards."""
    s = b.sizes
    workdir = b.workdir or Path(tempfile.gettempdir())
    prefix = f"{b.prefix}s"
    rows: list[Row] = []
    with postgres_database(b.pg_url, b.app_dir, workdir) as db:
        env = {
            "BROKER_REDIS_URL": b.redis.url,
            "BROKER_REDIS_PREFIX": prefix,
            "BROKER_DATABASE_URL": db,
        }
        with (
            uvicorn_server(
                "broker-scrape",
                "app.main:create_app",
                cwd=b.app_dir,
                workdir=workdir,
                env=env,
                factory=True,
            ) as server,
            drain_worker(b.app_dir, workdir, env),
        ):
            runs: list[str] = []
            try:
                for n in s.scrape_runs:
                    while len(runs) < n:
                        run = b.new_run("scrape", server=server)
                        b.fill(run, 64, f"s{len(runs)}", 64, server=server)
                        runs.append(run)
                    wait_drained(server, runs)
                    b.say(f"metrics: {s.scrapes} scrapes with {n} open runs")
                    rows.append(scrape_row(server, n, s.scrapes))
            finally:
                delete_keys(b.rc, list(b.rc.scan_iter(match=keys.every_key(prefix), count=2000)))
    return rows


@contextlib.contextmanager
def drain_worker(app_dir: Path, workdir: Path, env: dict[str, str]) -> Iterator[None]:
    """``rollout-broker worker`` (the accounting drain and the sweeps) in a subprocess."""
    with open(workdir / "worker-scrape.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker"],
            cwd=app_dir,
            env=tree_env(app_dir, env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def wait_drained(server: Server, runs: list[str], within_s: float = 60.0) -> None:
    """Until the accounting of every run in ``runs`` has nothing pending."""
    http = Http(server.address)
    deadline = time.monotonic() + within_s
    try:
        for run in runs:
            while True:
                status, data, _ = http.call("GET", f"/v1/runs/{run}/accounting")
                expect(status, data, 200)
                if json.loads(data)["pending_events"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the drain did not catch up with {run} in {within_s} s")
                time.sleep(0.05)
    finally:
        http.close()


MIN_CPU_S = 0.05  # what a scrape row measures at the least, in CPU seconds


def scrape_row(server: Server, n: int, scrapes: int) -> Row:
    http = Http(server.address)
    cpu0, t0 = proc_cpu_s(server.pid), time.monotonic()
    size = done = 0
    # The process's CPU time moves by clock ticks (10 ms): scrape on until it has moved by a
    # few, so that a short run does not report a cheap scrape as costing nothing.
    while done < scrapes or (proc_cpu_s(server.pid) - cpu0 < MIN_CPU_S and done < 50 * scrapes):
        status, data, _ = http.call("GET", "/metrics")
        expect(status, data, 200)
        size = len(data)
        done += 1
    cpu_ms = (proc_cpu_s(server.pid) - cpu0) / done * 1e3
    wall_ms = (time.monotonic() - t0) / done * 1e3
    http.close()
    return Row(
        f"metrics.scrape.{n}",
        METRICS_TOGGLE.title,
        f"GET /metrics with {n} open runs: server CPU per scrape",
        cpu_ms,
        "ms",
        note=f"{wall_ms:,.1f} ms per answer, {size:,} bytes; at one scrape every "
        f"{PROMETHEUS_INTERVAL_S:g} s: {cpu_ms / 1e3 / PROMETHEUS_INTERVAL_S:.2%} of a core",
    )
