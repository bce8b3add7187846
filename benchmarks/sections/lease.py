"""``--only lease``: lease + ack throughput and lease latency, against raw Redis, the naive dict
and the HTTP floor.
"""

from __future__ import annotations

import math

from benchmarks import load
from benchmarks.harness import BIG, Bench, Row, best_latency, best_rate
from benchmarks.load import Group, percentile, run_group
from benchmarks.payloads import TOKENS


def lease_rows(b: Bench) -> list[Row]:
    s = b.sizes
    size = s.batch
    rows = []
    b.raw_clear()
    b.raw_write(64, 1, 600.0, math.ceil(s.latency_pool / 64), "rr")
    got: dict[str, list[Group]] = {}
    for rep in range(s.repeats):
        b.say(f"lease ceiling: raw Redis reads of {size} (#{rep + 1})")
        got.setdefault("raw", []).append(b.raw_read(size, 1, s.ceiling_s))
        b.say(f"lease: naive dict, batches of {size} pops (#{rep + 1})")
        b.naive_fill(max(20 * size, int(3000 * s.naive_s)), "nl")
        got.setdefault("naive", []).append(
            run_group(
                load.naive_pop,
                [dict(address=b.naive.address, size=size, duration=s.naive_s, max_ops=BIG)],
                timeout=s.naive_s + 120,
            )
        )
        b.say(f"lease+ack floor: canned answers over HTTP, batches of {size} (#{rep + 1})")
        got.setdefault("floor", []).append(
            b.lease_ack("canned", size, 1, s.lease_s, stop_on_empty=True, server=b.naive)
        )
        for fmt in ("msgpack", "json"):
            run = b.new_run(f"lease-{fmt}", max_reuse=1)
            b.say(f"lease+ack: filling {s.lease_fill:,} rollouts (#{rep + 1})")
            b.fill(run, s.lease_fill, "l")
            b.say(f"lease+ack: broker, {fmt}, batches of {size} (#{rep + 1})")
            got.setdefault(fmt, []).append(
                b.lease_ack(run, size, 1, s.lease_s, fmt=fmt, stop_on_empty=True)
            )
            b.drop_run(run)
    raw_rate, naive_rate = best_rate(got["raw"]).rate, best_rate(got["naive"]).rate
    floor = best_rate(got["floor"]).rate
    floor_row = Row(
        f"http_floor.lease_ack.{size}",
        "Lease + ack",
        "HTTP floor: the same msgpack lease and ack, answered canned from memory (no broker)",
        floor,
        "rollouts/s",
        raw=raw_rate,
        tokens_per_s=floor * TOKENS,
        note="what one uvicorn process and the trainer's client cost to move the bytes alone",
    )
    for fmt in ("msgpack", "json"):
        g = best_rate(got[fmt])
        row = Row(
            f"lease_ack.{fmt}.{size}",
            "Lease + ack",
            f"{fmt}, batches of {size}, 1 trainer (max_reuse=1: each rollout retires on ack)",
            g.rate,
            "rollouts/s",
            raw=raw_rate,
            naive=naive_rate,
            tokens_per_s=g.rate * TOKENS,
            note=f"{g.ops} batches; lease p50 {percentile(g.latencies, 50) * 1e3:.1f} ms; "
            f"{g.rate / floor:.2f}× the HTTP floor",
        )
        if fmt == "msgpack":
            row.target("≥0.5× raw", row.vs_raw, 0.5)
            row.target(">1× naive", row.vs_naive, 1.0)
        else:
            row.target("≥2× naive", row.vs_naive, 2.0)
        rows.append(row)
    rows.append(floor_row)

    run = b.new_run("latency", max_reuse=10_000)
    b.fill(run, s.latency_pool, "t")
    for lsize in s.latency_sizes:
        lat: dict[str, list[Group]] = {}
        for rep in range(s.repeats):
            b.say(f"lease latency: batches of {lsize} (#{rep + 1})")
            lat.setdefault("raw", []).append(b.raw_read(lsize, 1, s.ceiling_s))
            b.naive_fill(max(20 * lsize, int(3000 * s.naive_s)), f"nq{lsize}")
            lat.setdefault("naive", []).append(
                run_group(
                    load.naive_pop,
                    [dict(address=b.naive.address, size=lsize, duration=s.naive_s, max_ops=BIG)],
                    timeout=s.naive_s + 120,
                )
            )
            lat.setdefault("broker", []).append(b.lease_ack(run, lsize, 1, s.latency_s))
        g, raw_g, naive_g = (best_latency(lat[k]) for k in ("broker", "raw", "naive"))
        for q in (50, 99):
            row = Row(
                f"lease_latency.{lsize}.p{q}",
                "Lease latency",
                f"lease of {lsize}, p{q} (msgpack, 1 trainer)",
                percentile(g.latencies, q) * 1e3,
                "ms",
                raw=percentile(raw_g.latencies, q) * 1e3,
                naive=percentile(naive_g.latencies, q) * 1e3,
                note=f"{len(g.latencies)} leases",
            )
            row.target(">1× naive", row.vs_naive, 1.0)
            rows.append(row)
    b.drop_run(run)
    b.raw_clear()
    b.naive_call("POST", "/_bench/clear")
    return rows
