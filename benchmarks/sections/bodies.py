"""``--only bodies``: one maximal JSON body, and what it does to every other request and to the
server's memory; then small hostile bodies (a list of millions of items, each invalid or each
valid beyond the count rule), each sent alone with ``/healthz`` probed beside it: the server's
CPU time and peak memory for it, and the longest ``/healthz`` wait.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack

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
    # The wait may outlast the server's keep-alive timeout (the other side builds a body of tens
    # of MiB first), which closes an idle connection: probe on a fresh one, opened now.
    http.close()
    http = Http(address)
    expect(*http.call("GET", "/healthz")[:2], 200)
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


def one_post(*, address: Address, path: str, make: str, done: Any, barrier: Any) -> Result:
    """One POST of the hostile body ``make`` names (built here, not sent through the fork),
    timed; sets ``done`` when it is answered (any status)."""
    body, ctype, _ = HOSTILE[make]()
    http = Http(address)
    res = Result()
    barrier.wait()
    try:
        res.t0 = time.perf_counter()
        status = http.call("POST", path, body, ctype)[0]
        res.t1 = time.perf_counter()
    finally:
        done.set()
    res.lat.append(res.t1 - res.t0)
    res.ops, res.rollouts = 1, status  # the status, to tell the sides apart and report it
    http.close()
    return res


def big_body_load(*, role: str, **kwargs: Any) -> Result:
    """The two sides of the big-body rows, in one group: the request and the probe beside it."""
    if role == "ingest":
        return big_ingest(**kwargs)
    return one_post(**kwargs) if role == "post" else healthz_poll(**kwargs)


MIB = 1 << 20
JSON_TYPE, MSGPACK_TYPE = "application/json", "application/msgpack"


def _json_list(field: str, item: bytes, size: int) -> bytes:
    head = b'{"%s":[' % field.encode()
    n = (size - len(head) - 2) // (len(item) + 1)
    return head + b",".join([item] * n) + b"]}"


def _prompts(n: int, tokens: int = 0) -> bytes:
    ids = [12345] * tokens
    prompts = [{"prompt_id": f"p{i:07d}", "prompt_ids": ids} for i in range(n)]
    return json.dumps({"prompts": prompts}).encode()


# The hostile bodies: name -> () -> (body, content type, what it is)
HOSTILE: dict[str, Callable[[], tuple[bytes, str, str]]] = {
    "rollouts_msgpack_zeros": lambda: (
        msgpack.packb({"rollouts": [0] * (4 * MIB - 16)}),
        MSGPACK_TYPE,
        'msgpack {"rollouts": [0, 0, …]} of 4 MiB',
    ),
    "rollouts_json_zeros": lambda: (
        _json_list("rollouts", b"0", 4 * MIB),
        JSON_TYPE,
        'JSON {"rollouts": [0, 0, …]} of 4 MiB',
    ),
    "prompts_json_zeros": lambda: (
        _json_list("prompts", b"0", 8 * MIB),
        JSON_TYPE,
        'JSON {"prompts": [0, 0, …]} of 8 MiB',
    ),
    "ack_json_nulls": lambda: (
        b'{"logprobs":{"a":[' + b",".join([b"null"] * (8 * MIB // 5)) + b"]}}",
        JSON_TYPE,
        'JSON ack {"logprobs": {"a": [null, …]}} of 8 MiB',
    ),
    "prompts_valid_1m": lambda: (
        _prompts(1_000_000),
        JSON_TYPE,
        "JSON registration of 1,000,000 valid prompts (25 MB)",
    ),
    # Not hostile: the largest registration a generator may send (4,096 prompts of 2,048
    # tokens, 56 MiB), accepted, for what a valid body near the limit costs.
    "prompts_valid_max": lambda: (
        _prompts(4096, 2048),
        JSON_TYPE,
        "JSON registration of 4,096 valid prompts of 2,048 tokens (56 MiB)",
    ),
    "rollouts_json_objects": lambda: (
        _json_list("rollouts", b'{"rollout_id":"x"}', 5 * MIB),
        JSON_TYPE,
        'JSON {"rollouts": [{"rollout_id": "x"}, …]} of 5 MiB (item by item)',
    ),
}

# Where each is sent ({run} is the run's id): all refused with a 422 but the valid registration.
_PATHS = {
    "rollouts": "/v1/runs/{run}/rollouts",
    "prompts": "/v1/runs/{run}/prompts",
    "ack": "/v1/runs/{run}/batches/no-such-batch/ack",
}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hostile_rows(b: Bench, run: str) -> list[Row]:
    """Each hostile body sent alone, ``/healthz`` probed beside it: the server's CPU time (target
    ≤ 1 s), its peak memory Δ (≤ 4× the body) and the longest /healthz wait (≤ 100 ms)."""
    assert b.broker.pid is not None
    rows: list[Row] = []
    for name, make in HOSTILE.items():
        body, _, what = make()
        size = len(body)
        del body
        path = _PATHS[name.split("_", 1)[0]].format(run=run)
        b.say(f"hostile body: {what}")
        done = mp.get_context("fork").Event()
        before = rss_bytes(b.broker.pid)
        reset_peak_rss(b.broker.pid)
        cpu = _cpu_s(b.broker.pid)
        sides = [
            dict(role="post", path=path, make=name, done=done),
            dict(role="poll", duration=600.0, max_ops=BIG, until=done),
        ]
        g = run_group(
            big_body_load, [{**side, "address": b.broker.address} for side in sides], timeout=660
        )
        cpu = _cpu_s(b.broker.pid) - cpu
        peak = max(0, peak_rss_bytes(b.broker.pid) - before)
        post = next(r for r in g.results if r.rollouts)  # the status, not 0
        probes = next(r for r in g.results if r is not post).lat
        status = post.rollouts
        section, key = "Hostile bodies", f"bodies.hostile.{name}"
        cpu_row = Row(f"{key}.cpu", section, f"{what}: server CPU", cpu * 1e3, "ms",
                      note=f"answered {status} in {post.lat[0] * 1e3:,.0f} ms")  # fmt: skip
        cpu_row.target("≤1 s CPU", cpu, 1.0, at_most=True)
        mem_row = Row(f"{key}.peak_rss", section, f"{what}: server's peak memory Δ", peak,
                      "bytes", note=f"{peak / size:.2f}× the body")  # fmt: skip
        mem_row.target("≤4× body", peak / size, 4.0, at_most=True)
        wait = max(probes) * 1e3
        wait_row = Row(f"{key}.healthz_max", section, f"{what}: /healthz max beside it", wait,
                       "ms", note=f"{len(probes)} probes")  # fmt: skip
        wait_row.target("≤100 ms", wait / 1e3, 0.1, at_most=True)
        rows += [cpu_row, mem_row, wait_row]
    return rows


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
    hostile = b.new_run("hostile-bodies")
    try:
        return [*rows, peak_row, *hostile_rows(b, hostile)]
    finally:
        b.drop_run(hostile)
