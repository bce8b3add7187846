"""``--only bodies``: one maximal JSON body, and what it does to every other request and to the
server's memory.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from benchmarks.harness import BIG, Bench, Row
from benchmarks.load import Address, Http, Result, expect, percentile, run_group
from benchmarks.payloads import CONTENT_TYPE, big_json_body
from benchmarks.servers import peak_rss_bytes, reset_peak_rss, rss_bytes


def healthz_poll(
    *, address: Address, duration: float, max_ops: int, until: Any = None, barrier: Any
) -> Result:
    """A liveness probe: ``GET /healthz`` back to back on one connection, each one timed, until
    ``duration`` or ``max_ops``, or until the event ``until`` is set (after one probe at least)."""
    http = Http(address)
    expect(*http.call("GET", "/healthz")[:2], 200)
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        t = time.perf_counter()
        status, data, _ = http.call("GET", "/healthz")
        res.lat.append(time.perf_counter() - t)
        expect(status, data, 200)
        res.ops += 1
        if until is not None and until.is_set():
            break
    res.t1 = time.perf_counter()
    http.close()
    return res


def big_ingest(*, address: Address, path: str, rollouts: int, done: Any, barrier: Any) -> Result:
    """One JSON ingest of ``rollouts`` 262,144-token rollouts (up to 64 MiB), timed; sets
    ``done`` when it is answered."""
    body = big_json_body(rollouts)
    http = Http(address)
    res = Result()
    barrier.wait()
    try:
        res.t0 = time.perf_counter()
        status, data, _ = http.call("POST", path, body, CONTENT_TYPE["json"])
        res.t1 = time.perf_counter()
    finally:
        done.set()
    expect(status, data, 202)
    res.lat.append(res.t1 - res.t0)
    res.ops, res.rollouts = 1, rollouts
    http.close()
    return res


def big_body_load(*, role: str, **kwargs: Any) -> Result:
    """The two sides of the big-body rows, in one group: the ingest and the probe beside it."""
    return big_ingest(**kwargs) if role == "ingest" else healthz_poll(**kwargs)


def body_rows(b: Bench) -> list[Row]:
    """A maximal JSON ingest (262,144-token rollouts up to 64 MiB) with /healthz probed beside
    it, against the same probe on the idle server: how long one big body holds up every other
    request, and the server's peak memory for it."""
    s = b.sizes
    assert b.broker.pid is not None
    size = len(big_json_body(s.big_rollouts))
    mb = size / 1e6
    b.say("big body: /healthz on the idle server")
    idle = run_group(
        healthz_poll,
        [dict(address=b.broker.address, duration=s.healthz_s, max_ops=BIG)],
        timeout=s.healthz_s + 60,
    ).latencies
    b.say(f"big body: one {mb:.0f} MB JSON ingest with /healthz probed beside it")
    run = b.new_run("big-body")
    done = mp.get_context("fork").Event()  # run_group forks
    path = f"/v1/runs/{run}/rollouts"
    before = rss_bytes(b.broker.pid)
    reset_peak_rss(b.broker.pid)
    sides = [
        dict(role="ingest", path=path, rollouts=s.big_rollouts, done=done),
        dict(role="poll", duration=600.0, max_ops=BIG, until=done),
    ]
    g = run_group(
        big_body_load,
        [{**side, "address": b.broker.address} for side in sides],
        timeout=660,
    )
    peak = peak_rss_bytes(b.broker.pid) - before
    b.drop_run(run)
    ingest = next(r for r in g.results if r.rollouts)
    busy = next(r for r in g.results if not r.rollouts).lat
    idle50 = percentile(idle, 50) * 1e3
    what = f"{s.big_rollouts} × 262,144-token rollouts, {mb:.0f} MB of JSON"

    def vs_idle(v: float) -> str:
        return f"{v / idle50:,.1f}× the idle p50"

    rows = [
        Row(
            "bodies.healthz.idle.p50",
            "Big bodies",
            "/healthz p50, idle server",
            idle50,
            "ms",
            note=f"{len(idle)} probes, back to back",
        )
    ]
    for key, q in (("p50", 50.0), ("max", 100.0)):
        v = percentile(busy, q) * 1e3
        rows.append(
            Row(
                f"bodies.healthz.ingest.{key}",
                "Big bodies",
                f"/healthz {key} during one ingest of {what}",
                v,
                "ms",
                note=f"{vs_idle(v)}; {len(busy)} probes while the ingest was under way",
            )
        )
    t = ingest.lat[0] * 1e3
    rows.append(
        Row(
            "bodies.ingest",
            "Big bodies",
            f"the ingest of {what}, sent to answered",
            t,
            "ms",
            note=f"{mb / (t / 1e3):,.0f} MB/s",
        )
    )
    peak_row = Row(
        "bodies.peak_rss",
        "Big bodies",
        "server's peak resident memory Δ for that ingest",
        peak,
        "bytes",
        note=f"{peak / size:.2f}× the body (VmHWM over VmRSS before)",
    )
    peak_row.target("≤4× body", peak / size, 4.0, at_most=True)
    return [*rows, peak_row]
