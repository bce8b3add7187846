"""``--only ingest``: ingest rates, JSON and msgpack, against raw Redis, the naive dict and
the durable floor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks import load
from benchmarks.harness import BIG, Bench, Row, best_rate
from benchmarks.load import Group, run_group
from benchmarks.payloads import TOKENS
from benchmarks.servers import Server, proc_cpu_s


@dataclass
class Costed:
    """A group of load and the CPU seconds its server process and Redis used meanwhile."""

    group: Group
    server_s: float
    redis_s: float | None  # None: Redis is not a process of this run

    def per_request_us(self, cpu_s: float) -> float:
        return cpu_s / max(self.group.ops, 1) * 1e6


def costed(b: Bench, server: Server, run: Callable[[], Group]) -> Costed:
    """``run()`` with the CPU that ``server`` and the private Redis spent on it."""
    pid = b.redis_pid
    redis0 = proc_cpu_s(pid) if pid else 0.0
    server0 = proc_cpu_s(server.pid)
    g = run()
    server_s = proc_cpu_s(server.pid) - server0
    return Costed(g, server_s, proc_cpu_s(pid) - redis0 if pid else None)


def cpu_text(c: Costed) -> str:
    """'API process 1,234 µs, Redis 456 µs of CPU per request'."""
    text = f"API process {c.per_request_us(c.server_s):,.0f} µs"
    if c.redis_s is not None:
        text += f", Redis {c.per_request_us(c.redis_s):,.0f} µs"
    return text + " of CPU per request"


def ingest_rows(b: Bench) -> list[Row]:
    """Per generator count, every case and its baselines back to back, repeated; best of each."""
    s = b.sizes
    found: dict[str, Row] = {}
    for procs in (1, 4):
        got: dict[str, list[Costed]] = {}
        raw: dict[int, list[Group]] = {}
        for rep in range(s.repeats):
            for per in (1, 64):
                b.say(f"ingest ceiling: raw Redis, {per}/pipeline, {procs} proc (#{rep + 1})")
                g = b.raw_write(per, procs, s.ceiling_s, BIG, f"rw{per}")
                raw.setdefault(per, []).append(g)
                b.raw_clear()
            for key, path in (("naive", "/rollouts"), ("floor", "/_floor/rollouts")):
                b.say(f"ingest: {key}, {procs} proc (#{rep + 1})")
                c = costed(
                    b,
                    b.naive,
                    functools.partial(
                        run_group,
                        load.naive_ingest,
                        [
                            dict(
                                address=b.naive.address,
                                path=path,
                                tag=f"{key}{procs}",
                                worker=w,
                                duration=s.naive_s,
                                max_ops=BIG,
                            )
                            for w in range(procs)
                        ],
                        timeout=s.naive_s + 120,
                    ),
                )
                got.setdefault(key, []).append(c)
            b.naive_call("POST", "/_bench/clear")
            b.raw_clear()
            for fmt in ("json", "msgpack"):
                for per in (1, 64):
                    b.say(f"ingest: broker, {fmt}, {per}/request, {procs} proc (#{rep + 1})")
                    run = b.new_run(f"ingest-{fmt}-{per}-{procs}")
                    c = costed(
                        b,
                        b.broker,
                        functools.partial(
                            run_group,
                            load.http_ingest,
                            [
                                dict(
                                    address=b.broker.address,
                                    path=f"/v1/runs/{run}/rollouts",
                                    fmt=fmt,
                                    per_req=per,
                                    tag=f"i{per}",
                                    worker=w,
                                    duration=s.ingest_s,
                                    max_ops=BIG,
                                )
                                for w in range(procs)
                            ],
                            timeout=s.ingest_s + 300,
                        ),
                    )
                    b.drop_run(run)
                    got.setdefault(f"{fmt}{per}", []).append(c)
        best = {key: max(runs, key=lambda c: c.group.rate) for key, runs in got.items()}
        naive, floor = best["naive"].group.rate, best["floor"].group.rate
        gens = f"{procs} generator{'s' if procs > 1 else ''}"
        found[f"durable_floor.ingest.p{procs}"] = Row(
            f"durable_floor.ingest.p{procs}",
            "Ingest",
            f"durable floor: the naive app keeping each JSON body with one Redis SET, unparsed, "
            f"1/request, {gens}",
            floor,
            "rollouts/s",
            raw=best_rate(raw[1]).rate,
            naive=naive,
            tokens_per_s=floor * TOKENS,
            note="the least a request costs a buffer on this framework that stores what it "
            f"accepted before it answers: ×{floor / naive:.2f} naive bounds the one-rollout rows; "
            f"{cpu_text(best['floor'])} (the naive dict's API process "
            f"{best['naive'].per_request_us(best['naive'].server_s):,.0f} µs)",
        )
        for fmt in ("json", "msgpack"):
            for per in (1, 64):
                c = best[f"{fmt}{per}"]
                g = c.group
                note = f"{g.ops / g.span:,.0f} requests/s; {cpu_text(c)}"
                if per == 1:
                    note += f"; {g.rate / floor:.2f}× the durable floor"
                row = Row(
                    f"ingest.{fmt}.{per}.p{procs}",
                    "Ingest",
                    f"{fmt}, {per}/request, {gens}",
                    g.rate,
                    "rollouts/s",
                    raw=best_rate(raw[per]).rate,
                    naive=naive,
                    tokens_per_s=g.rate * TOKENS,
                    note=note,
                )
                if fmt == "msgpack" and per == 64:
                    row.target("≥0.5× raw", row.vs_raw, 0.5)
                if (fmt, per, procs) == ("json", 1, 1):  # what a framework's buffer does
                    row.target("≥1× naive", row.vs_naive, 1.0)
                    row.target("≥0.9× durable floor", g.rate / floor, 0.9)
                else:
                    row.target(">1× naive", row.vs_naive, 1.0)
                found[row.id] = row
    return [
        found[f"ingest.{fmt}.{per}.p{procs}"]
        for fmt in ("json", "msgpack")
        for per in (1, 64)
        for procs in (1, 4)
    ] + [found[f"durable_floor.ingest.p{procs}"] for procs in (1, 4)]
