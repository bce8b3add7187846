"""``--only drain``: the accounting drain's catch-up after its worker is SIGKILLed and
restarted, against a fresh start.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import keys
from app.keys import CONSUMER_GROUP
from benchmarks import load
from benchmarks.harness import Bench, Row, Sizes, delete_keys
from benchmarks.load import Http, expect
from benchmarks.servers import postgres_database, tree_env, uvicorn_server

DRAIN_SECTION = "Accounting drain: catch-up after a worker restart"
DRAIN_NEED_S = 5.0  # the worst restart caught up within 5 s of the new worker's start
DRAIN_GROUP_NEED = 1  # consumers in the run's group once caught up: the live worker alone
DRAIN_CLAIM_IDLE_MS = 600_000  # the claim fallback out of reach: only the takeover catches up
DRAIN_PER_REQ = 64  # rollouts per ingest request and per lease + ack of the drain rows
DRAIN_WITHIN_S = 60.0  # a catch-up slower than this is a failure, not a figure


class DrainWorker:
    """``rollout-broker worker`` in a subprocess that can be stopped cleanly (SIGTERM: it
    leaves the group), SIGSTOPped, SIGKILLed, and started again; its output appended to
    ``log``."""

    def __init__(self, app_dir: Path, env: dict[str, str], log: Path) -> None:
        self.app_dir = app_dir
        self.env = tree_env(app_dir, env)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> float:
        """Start a new process; returns the moment just before it was started."""
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "worker"],
                cwd=self.app_dir,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return started

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL, stopped or not
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case it was stopped
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class DrainStart:
    """One worker start and its catch-up."""

    events: int  # pending_events when it started
    caught_up_s: float  # from its process start to pending_events 0
    group: int  # consumers in the run's group once caught up
    beating: int  # consumers in the heartbeat set once caught up
    held: int = 0  # events the killed worker had read and not applied
    silent_s: float = 0.0  # since the killed worker's last heartbeat, at the new start
    after_kill_s: float = 0.0  # from the kill to pending_events 0


def drain_rows(b: Bench) -> list[Row]:
    """How soon the accounting drain is caught up after its worker is SIGKILLed while it holds
    events it has read and not applied, and restarted: the new worker must take them over
    through the heartbeats (the dead one's stop after ``BROKER_DRAIN_HEARTBEAT_TIMEOUT_MS``),
    since the claim fallback is set to ten minutes. Baseline, measured in the same run, round by
    round: a worker stopped cleanly (SIGTERM) and started fresh with nothing to take over, on
    the same events. Both are timed from the new process's start to ``pending_events`` 0
    (``GET /v1/runs/{run}/accounting``). A broker, a worker and a database of their own, on a
    key prefix of their own deleted afterwards."""
    s = b.sizes
    workdir = b.workdir or Path(tempfile.gettempdir())
    prefix = f"{b.prefix}d"
    fresh: list[DrainStart] = []
    restarts: list[DrainStart] = []
    with postgres_database(b.pg_url, b.app_dir, workdir) as db:
        env = {
            "BROKER_REDIS_URL": b.redis.url,
            "BROKER_REDIS_PREFIX": prefix,
            "BROKER_DATABASE_URL": db,
            "BROKER_DRAIN_CLAIM_IDLE_MS": str(DRAIN_CLAIM_IDLE_MS),
        }
        worker = DrainWorker(b.app_dir, env, workdir / "worker-drain.log")
        with uvicorn_server(
            "broker-drain",
            "app.main:create_app",
            cwd=b.app_dir,
            workdir=workdir,
            env=env,
            factory=True,
        ) as server:
            http = Http(server.address)
            try:
                run = b.new_run("drain", server=server, max_reuse=1)
                events = keys.events_key(prefix, run)
                beats = keys.drain_consumers_key(prefix)
                bursts = iter(range(10**6))

                def pending() -> int:
                    status, data, _ = http.call("GET", f"/v1/runs/{run}/accounting")
                    expect(status, data, 200)
                    return int(json.loads(data)["pending_events"])

                def caught_up(since: float) -> float:
                    """Seconds from ``since`` until nothing is pending."""
                    while pending():
                        if time.monotonic() - since > DRAIN_WITHIN_S:
                            raise RuntimeError(
                                f"the drain did not catch up in {DRAIN_WITHIN_S:g} s:\n"
                                + worker.tail()
                            )
                        time.sleep(0.02)
                    return time.monotonic() - since

                def group() -> list[str]:
                    rows: Any = b.rc.xinfo_consumers(events, CONSUMER_GROUP)
                    return [r["name"].decode() for r in rows]

                def consumer() -> str:
                    """The live worker's consumer (host-pid-random), once it is in the group."""
                    mark = f"-{worker.pid}-"
                    deadline = time.monotonic() + 10
                    while not (mine := [n for n in group() if mark in n]):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"worker {worker.pid} is not in {group()}")
                        time.sleep(0.02)
                    return mine[0]

                def held_by(name: str) -> int:
                    return len(b.rc.xpending_range(events, CONSUMER_GROUP, "-", "+", 10_000, name))

                def post(n: int) -> None:
                    """Ingest ``n`` rollouts (msgpack), ``DRAIN_PER_REQ`` a request."""
                    per = min(n, DRAIN_PER_REQ)
                    conn, send = load.ingest_poster(
                        address=server.address,
                        path=f"/v1/runs/{run}/rollouts",
                        fmt="msgpack",
                        per_req=per,
                        tag=f"d{next(bursts)}",
                        worker=0,
                    )
                    for _ in range(n // per):
                        send()
                    conn.close()

                def burst() -> None:
                    """The events each start catches up on: rollouts ingested, then leased and
                    acked until the run is empty (max_reuse=1: an acked rollout retires)."""
                    post(s.drain_rollouts)
                    conn, lease_ack = load.lease_acker(
                        address=server.address, run_id=run, size=DRAIN_PER_REQ, fmt="msgpack"
                    )
                    while lease_ack() is not None:
                        pass
                    conn.close()

                def start(**killed: Any) -> DrainStart:
                    n = pending()
                    started = worker.start()
                    took = caught_up(started)
                    return DrainStart(n, took, len(group()), int(b.rc.zcard(beats)), **killed)

                def fresh_start() -> DrainStart:
                    worker.stop()  # SIGTERM: it leaves the group and the heartbeats
                    post(1)  # as the restart's probe
                    burst()
                    return start()

                def restart() -> DrainStart:
                    """SIGKILL the worker while it holds events, as the drain-restart test
                    does: stopped (SIGSTOP) while it blocks on XREADGROUP, it is handed the
                    next ingest's event by Redis all the same. If it was between two reads,
                    let it catch up and try again."""
                    name = consumer()
                    for _ in range(20):
                        worker.send_signal(signal.SIGSTOP)
                        post(1)
                        time.sleep(0.05)
                        if held := held_by(name):
                            break
                        worker.send_signal(signal.SIGCONT)
                        caught_up(time.monotonic())
                    else:
                        raise RuntimeError("the worker never held an event when stopped")
                    worker.kill()
                    killed = time.monotonic()
                    burst()  # and more while it is down
                    last_beat_ms = float(b.rc.zscore(beats, name) or 0)
                    sec, usec = b.rc.time()
                    silent_s = (sec * 1000 + usec / 1000 - last_beat_ms) / 1000
                    got = start(held=held, silent_s=silent_s)
                    got.after_kill_s = time.monotonic() - killed
                    return got

                b.say("drain: a first worker catching up")
                worker.start()
                post(1)
                burst()
                caught_up(time.monotonic())
                for i in range(s.drain_restarts):
                    b.say(f"drain: a fresh start and a restart after SIGKILL (#{i + 1})")
                    if i % 2 == 0:
                        fresh.append(fresh_start())
                        restarts.append(restart())
                    else:
                        restarts.append(restart())
                        fresh.append(fresh_start())
            finally:
                http.close()
                worker.stop()
                delete_keys(b.rc, list(b.rc.scan_iter(match=keys.every_key(prefix), count=2000)))
    return drain_result_rows(s, fresh, restarts)


def drain_result_rows(s: Sizes, fresh: list[DrainStart], restarts: list[DrainStart]) -> list[Row]:
    base = statistics.median(f.caught_up_s for f in fresh)
    mid = statistics.median(r.caught_up_s for r in restarts)
    worst = max(r.caught_up_s for r in restarts)
    events = sorted({x.events for x in (*fresh, *restarts)})
    n = len(restarts)

    def secs(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    what = (
        f"{'/'.join(map(str, events))} events ({s.drain_rollouts:,} rollouts ingested, "
        f"leased and acked {DRAIN_PER_REQ} at a time)"
    )
    fresh_row = Row(
        "drain.fresh",
        DRAIN_SECTION,
        "fresh worker, nothing to take over: its start to caught up, median",
        base * 1e3,
        "ms",
        note=f"baseline; {what}; each (s): {secs([f.caught_up_s for f in fresh])}; "
        f"group once caught up: {', '.join(str(f.group) for f in fresh)} consumer(s)",
    )
    median_row = Row(
        "drain.restart.median",
        DRAIN_SECTION,
        "worker SIGKILLed holding events, restarted: its start to caught up, median",
        mid * 1e3,
        "ms",
        note=f"×{mid / base:.2f} the fresh start ({(mid - base) * 1e3:+,.0f} ms); {n} restarts, "
        f"each (s): {secs([r.caught_up_s for r in restarts])}; from the kill (s): "
        f"{secs([r.after_kill_s for r in restarts])}; events held by the killed worker: "
        f"{', '.join(str(r.held) for r in restarts)}",
    )
    max_row = Row(
        "drain.restart.max",
        DRAIN_SECTION,
        "worker SIGKILLed holding events, restarted: its start to caught up, worst",
        worst * 1e3,
        "ms",
        note=f"×{worst / base:.2f} the fresh start ({(worst - base) * 1e3:+,.0f} ms); the killed "
        f"worker silent at the new start (s): {secs([r.silent_s for r in restarts])}; group / "
        f"heartbeat set once caught up: {', '.join(f'{r.group}/{r.beating}' for r in restarts)} "
        f"consumer(s); claim fallback {DRAIN_CLAIM_IDLE_MS / 1000:g} s",
    )
    max_row.target(f"≤{DRAIN_NEED_S:g} s after restart", worst, DRAIN_NEED_S, at_most=True)
    grown = max(max(r.group, r.beating) for r in restarts)
    group_need = f"≤{DRAIN_GROUP_NEED} consumer in group/heartbeats"
    max_row.target(group_need, grown, DRAIN_GROUP_NEED, at_most=True)
    return [fresh_row, median_row, max_row]
