"""``--only memory``: Redis memory per buffered rollout, against raw Redis and the naive dict."""

from __future__ import annotations

import math

from app import keys
from benchmarks import load
from benchmarks.harness import Bench, Row
from benchmarks.load import run_group
from benchmarks.payloads import RAW_BYTES
from benchmarks.servers import rss_bytes


def memory_rows(b: Bench) -> list[Row]:
    s = b.sizes
    b.say(f"memory: {s.memory_n} rollouts into the broker, raw Redis and the naive dict")
    # Load the scripts and warm the allocator first, so the delta is the rollouts' own.
    warm = b.new_run("warm")
    b.fill(warm, 64, "w", per_req=64)
    b.drop_run(warm)
    run = b.new_run("memory")
    before = b.used_memory()
    n = b.fill(run, s.memory_n, "m", per_req=64)
    after = b.used_memory()
    assert b.live(run) == n, "every rollout of the memory run should be buffered"
    broker_delta = (after - before) / n

    # MEMORY USAGE of every key of the run, grouped by kind (the first segment of its name).
    names = b.run_keys(run)
    base = keys.run_base(b.prefix, run).encode()
    pipe = b.rc.pipeline(transaction=False)
    for k in names:
        pipe.memory_usage(k, samples=0)
    usage = pipe.execute()
    kinds: dict[str, int] = {}
    for k, u in zip(names, usage, strict=True):
        rest = k[len(base) :].decode()
        kind = rest.split(":", 1)[0] + ":*" if ":" in rest else rest
        kinds[kind] = kinds.get(kind, 0) + int(u or 0)
    summed = sum(kinds.values()) / n
    breakdown = ", ".join(
        f"{kind} {v / n:,.0f}" for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1])
    )
    b.drop_run(run)

    # Raw Redis: the same rollout bytes under SET, ids in a list.
    b.raw_clear()
    before = b.used_memory()
    g = b.raw_write(64, 1, 600.0, math.ceil(s.memory_n / 64), "rm")
    raw_delta = (b.used_memory() - before) / g.rollouts
    b.raw_clear()

    # Naive: the uvicorn process's resident memory, one JSON rollout per request.
    b.naive_call("POST", "/_bench/clear")
    before = rss_bytes(b.naive.pid)
    g = run_group(
        load.naive_ingest,
        [
            dict(
                address=b.naive.address,
                tag="nm",
                worker=0,
                duration=600.0,
                max_ops=s.naive_memory_n,
            )
        ],
        timeout=660,
    )
    naive_delta = (rss_bytes(b.naive.pid) - before) / (g.rollouts + 2)
    b.naive_call("POST", "/_bench/clear")

    r1 = Row(
        "memory.used_memory",
        "Memory",
        f"Redis used_memory Δ / buffered rollout (N={n:,})",
        broker_delta,
        "bytes",
        raw=raw_delta,
        naive=naive_delta,
        note=f"{broker_delta / RAW_BYTES:.2f}× the {RAW_BYTES:,} raw array bytes; raw Redis "
        f"{raw_delta / RAW_BYTES:.2f}×; naive = process RSS Δ",
    )
    r1.target("≤1.25× raw arrays", broker_delta / RAW_BYTES, 1.25, at_most=True)
    r2 = Row(
        "memory.memory_usage",
        "Memory",
        "MEMORY USAGE of the run's keys / rollout",
        summed,
        "bytes",
        raw=raw_delta,
        note=f"{summed / RAW_BYTES:.2f}× raw arrays; by key kind: {breakdown}",
    )
    return [r1, r2]
