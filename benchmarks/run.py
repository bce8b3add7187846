"""Rollout Broker benchmarks: one command, one table, every figure beside its baselines.

    python -m benchmarks            # full run (about 9 minutes on 2 cores)
    python -m benchmarks --quick    # tiny sizes, a smoke test of the harness (about 15 s)

It starts a private redis-server on a free port (``--redis-url`` to use another one, with a key
prefix of its own that is deleted afterwards), the broker under uvicorn in a subprocess (real
HTTP over loopback), and the naive baseline (``benchmarks/naive_app.py``) the same way; load
comes from forked client processes. Baselines measured in the same run:

* raw Redis: redis-py, pipelined, writing and reading the same rollout bytes with no HTTP, and
  handing out and taking back the same prompts from a queue of the same depth;
* naive dict: a minimal FastAPI app holding JSON rollouts in a Python dict, one per request.

The access-control and metrics rows (``--only auth``, ``--only metrics``) start pairs of brokers
alike but for ``BROKER_AUTH`` or ``BROKER_METRICS`` (a new pair each round, on one new database
of the Postgres server at ``--pg-url``) and drive both from one client in alternation, so that
on is measured against off at the same moments.

The drain rows (``--only drain``) start a broker and a ``rollout-broker worker`` on a database
of their own and time the worker's catch-up after a SIGKILL and restart (the heartbeat takeover)
against a fresh start on the same events.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing as mp
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from app.accounting.stream import CONSUMER_GROUP
from app.broker import keys
from benchmarks import load
from benchmarks.cluster import cluster_rows
from benchmarks.load import Group, Http, expect, percentile, run_group
from benchmarks.payloads import (
    ID_LEN,
    LONG_TOKENS,
    RAW_BYTES,
    TOKENS,
    big_json_body,
    make_payload,
    raw_bytes,
    rollout_id,
)
from benchmarks.servers import (
    PG_URL,
    CpuMeter,
    RedisTarget,
    Server,
    peak_rss_bytes,
    postgres_database,
    proc_cpu_s,
    redis_server,
    reset_peak_rss,
    rss_bytes,
    tree_env,
    uvicorn_server,
    uvicorn_stack,
)

ROOT = Path(__file__).resolve().parent.parent
RedisClient = redis.Redis  # Bench.redis shadows the module in the class body
BIG = 10**9  # "no operation cap": the deadline ends these loops


@dataclass(frozen=True)
class Sizes:
    repeats: int = 2  # each ingest / lease measurement and its baselines, interleaved; best kept
    ingest_s: float = 2.0  # seconds per ingest measurement
    ceiling_s: float = 1.5  # seconds per raw-Redis measurement
    naive_s: float = 2.0  # seconds per naive-buffer measurement
    lease_fill: int = 12_288  # rollouts buffered for one lease+ack throughput measurement
    lease_s: float = 2.5
    latency_pool: int = 4096  # rollouts cycling through the latency rows (max_reuse high)
    latency_s: float = 2.0
    latency_sizes: tuple[int, ...] = (32, 256)
    batch: int = 256  # lease+ack throughput, buffer-size and trainer scaling
    levels: tuple[int, ...] = (1_000, 10_000, 100_000)
    level_s: float = 3.0
    trainers: tuple[int, ...] = (1, 4, 16)
    trainer_s: float = 3.0
    memory_n: int = 10_000  # rollouts measured for Redis memory (broker and raw)
    naive_memory_n: int = 2_000
    fill_procs: int = 2
    work_levels: tuple[int, ...] = (1_000, 100_000)  # prompts queued for the work-lease rows
    work_size: int = 64  # prompts per work lease
    work_s: float = 2.0
    big_rollouts: int = 28  # 262,144-token JSON rollouts in the big body: 28 fill 64 MiB
    healthz_s: float = 1.0  # seconds of /healthz probes on an idle server
    auth_rounds: int = 6  # rounds of the auth and metrics rows: a new pair of brokers each
    auth_s: float = 1.0  # seconds of ingest per side and round of the auth rows
    auth_lease_fill: int = 6_144  # rollouts per side and round for their lease + ack
    scrape_runs: tuple[int, ...] = (1, 10, 100)  # open runs of the scrape-cost rows
    scrapes: int = 20  # scrapes measured at each
    long_per_req: int = 4  # 32,768-token rollouts per ingest request (msgpack)
    long_ingest_s: float = 1.5  # seconds per long-rollout ingest measurement
    long_ceiling_s: float = 1.0  # seconds per long-rollout raw-Redis measurement
    long_naive_s: float = 1.0  # seconds per long-rollout naive-buffer measurement
    long_batch: int = 16  # long-rollout lease + ack batch size
    long_fill: int = 1024  # long rollouts buffered for one lease + ack measurement
    long_lease_s: float = 2.5
    workers_s: float = 2.0  # seconds per measurement of the --workers rows
    workers_lease_fill: int = 8_192  # rollouts cycling through their lease + ack (max_reuse high)
    drain_restarts: int = 3  # worker restarts of the drain rows, each beside a fresh start
    drain_rollouts: int = 1_024  # rollouts ingested, leased and acked before each start


FULL = Sizes()
QUICK = Sizes(
    repeats=1,
    ingest_s=0.25,
    ceiling_s=0.2,
    naive_s=0.25,
    lease_fill=1024,
    lease_s=0.5,
    latency_pool=512,
    latency_s=0.3,
    batch=32,
    levels=(256, 1024, 2048),
    level_s=0.3,
    trainer_s=0.3,
    memory_n=512,
    naive_memory_n=200,
    fill_procs=1,
    work_levels=(128, 1024),
    work_size=16,
    work_s=0.3,
    big_rollouts=3,
    healthz_s=0.2,
    auth_rounds=1,
    auth_s=0.25,
    auth_lease_fill=1024,
    scrape_runs=(1, 3),
    scrapes=3,
    long_ingest_s=0.25,
    long_ceiling_s=0.2,
    long_naive_s=0.25,
    long_batch=8,
    long_fill=96,
    long_lease_s=0.5,
    workers_s=0.25,
    workers_lease_fill=1024,
    drain_restarts=1,
    drain_rollouts=64,
)


# -- rows -----------------------------------------------------------------------------------
RATES = ("rollouts/s", "prompts/s")  # the units where higher is better


@dataclass
class Row:
    id: str
    section: str
    measure: str
    value: float
    unit: str  # 'rollouts/s', 'prompts/s', 'ms' or 'bytes'
    raw: float | None = None  # the raw-Redis baseline, same unit
    naive: float | None = None  # the naive-buffer baseline, same unit
    tokens_per_s: float | None = None
    targets: list[dict[str, Any]] = field(default_factory=list)  # {name, ratio, need, ok}
    note: str = ""

    @property
    def higher_is_better(self) -> bool:
        return self.unit in RATES

    def speed_vs(self, base: float | None) -> float | None:
        """The broker relative to a baseline: >1 means the broker is better (faster, smaller)."""
        if base is None or not self.value or math.isnan(self.value) or math.isnan(base):
            return None
        return self.value / base if self.higher_is_better else base / self.value

    @property
    def vs_raw(self) -> float | None:
        return self.speed_vs(self.raw)

    @property
    def vs_naive(self) -> float | None:
        return self.speed_vs(self.naive)

    def target(self, name: str, ratio: float | None, need: float, *, at_most: bool = False) -> None:
        ok = ratio is not None and (ratio <= need if at_most else ratio >= need)
        self.targets.append(
            {"name": name, "ratio": ratio, "need": need, "ok": ok, "at_most": at_most}
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["vs_raw"] = self.vs_raw
        d["vs_naive"] = self.vs_naive
        return d


# -- the harness ----------------------------------------------------------------------------
@dataclass
class Bench:
    sizes: Sizes
    redis: RedisTarget
    broker: Server
    naive: Server
    prefix: str
    rc: RedisClient
    redis_pid: int | None = None
    runs: int = 0
    app_dir: Path = ROOT  # the broker tree, for the servers a section starts itself
    workdir: Path | None = None  # where those servers' logs go
    pg_url: str = PG_URL  # the Postgres server of the sections that need a database

    @property
    def server_pids(self) -> list[int | None]:
        return [self.redis_pid, self.broker.pid, self.naive.pid]

    def say(self, msg: str) -> None:
        print(f"  … {msg}", file=sys.stderr, flush=True)

    # broker runs
    def new_run(
        self, name: str, *, server: Server | None = None, token: str | None = None, **config: Any
    ) -> str:
        self.runs += 1
        run_id = f"b{self.runs:02d}-{name}"
        cfg = {"capacity_rollouts": 1_000_000, **config}
        http = Http((server or self.broker).address, token)
        status, data, _ = http.call(
            "POST",
            "/v1/runs",
            json.dumps({"run_id": run_id, "config": cfg}).encode(),
            "application/json",
        )
        http.close()
        expect(status, data, 201)
        return run_id

    def run_keys(self, run_id: str) -> list[bytes]:
        return list(self.rc.scan_iter(match=keys.run_base(self.prefix, run_id) + "*", count=2000))

    def drop_run(self, run_id: str) -> None:
        """Delete a finished run's keys (the broker holds no state of its own about it)."""
        delete_keys(self.rc, self.run_keys(run_id))

    def live(self, run_id: str) -> int:
        http = Http(self.broker.address)
        status, data, _ = http.call("GET", f"/v1/runs/{run_id}")
        http.close()
        expect(status, data, 200)
        return int(self.rc.hget(keys.run_key(self.prefix, run_id), "live") or 0)

    def fill(
        self,
        run_id: str,
        n: int,
        tag: str,
        per_req: int = 256,
        *,
        server: Server | None = None,
        token: str | None = None,
        tokens: int = TOKENS,
    ) -> int:
        """Ingest ``n`` rollouts of ``tokens`` tokens (msgpack, ``per_req`` per request) from a
        few processes."""
        procs = max(1, min(self.sizes.fill_procs, n // per_req))
        reqs = math.ceil(n / per_req)
        per_proc = [reqs // procs + (1 if i < reqs % procs else 0) for i in range(procs)]
        group = run_group(
            load.http_ingest,
            [
                dict(
                    address=(server or self.broker).address,
                    path=f"/v1/runs/{run_id}/rollouts",
                    fmt="msgpack",
                    per_req=per_req,
                    tag=tag,
                    worker=w,
                    duration=600.0,
                    max_ops=k,
                    warmup=0,
                    token=token,
                    tokens=tokens,
                )
                for w, k in enumerate(per_proc)
            ],
            timeout=660,
        )
        return group.rollouts

    # the naive buffer
    def naive_call(self, method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
        http = Http(self.naive.address)
        status, data, _ = http.call(method, path, body, "application/json" if body else None)
        http.close()
        expect(status, data, 200, 202)
        return dict(json.loads(data))

    def naive_fill(self, n: int, tag: str) -> None:
        self.naive_call("POST", "/_bench/clear")
        from benchmarks.payloads import make_payload

        self.naive_call("POST", "/rollouts", make_payload().json_item(rollout_id(tag, 0, 0)))
        self.naive_call("POST", f"/_bench/replicate?n={n}&prefix={tag}-")

    # raw Redis
    @property
    def raw_prefix(self) -> str:
        return f"{self.prefix}:raw"

    def raw_clear(self) -> None:
        delete_keys(self.rc, list(self.rc.scan_iter(match=f"{self.raw_prefix}:*", count=2000)))

    def raw_write(
        self,
        per_pipe: int,
        procs: int,
        duration: float,
        max_ops: int,
        tag: str,
        *,
        tokens: int = TOKENS,
    ) -> Group:
        return run_group(
            load.redis_write,
            [
                dict(
                    url=self.redis.url,
                    key_prefix=self.raw_prefix,
                    per_pipe=per_pipe,
                    tag=tag,
                    worker=w,
                    duration=duration,
                    max_ops=max_ops,
                    tokens=tokens,
                )
                for w in range(procs)
            ],
            timeout=duration + 120,
        )

    def raw_read(self, size: int, procs: int, duration: float) -> Group:
        return run_group(
            load.redis_read,
            [
                dict(
                    url=self.redis.url,
                    queue=f"{self.raw_prefix}:q",
                    size=size,
                    duration=duration,
                    max_ops=BIG,
                )
                for _ in range(procs)
            ],
            timeout=duration + 120,
        )

    def lease_ack(
        self,
        run_id: str,
        size: int,
        procs: int,
        duration: float,
        *,
        fmt: str = "msgpack",
        stop_on_empty: bool = False,
        server: Server | None = None,
        token: str | None = None,
        tokens: int = TOKENS,
    ) -> Group:
        """Trainers leasing and acking against the broker (or ``server``: the HTTP floor, or
        another broker)."""
        return run_group(
            load.http_lease_ack,
            [
                dict(
                    address=(server or self.broker).address,
                    run_id=run_id,
                    size=size,
                    fmt=fmt,
                    duration=duration,
                    max_ops=BIG,
                    stop_on_empty=stop_on_empty,
                    token=token,
                    tokens=tokens,
                )
                for _ in range(procs)
            ],
            timeout=duration + 300,
        )

    # prompts and work leases
    def register_prompts(self, run_id: str, n: int, tag: str, per_req: int = 1000) -> Group:
        """Register ``n`` prompts (one pass each), ``per_req`` per JSON request, from one
        process; ``n`` is a multiple of ``per_req`` or smaller than it."""
        per_req = min(per_req, n)
        if n % per_req:
            raise ValueError(f"{n} prompts do not split into requests of {per_req}")
        return run_group(
            load.http_register,
            [
                dict(
                    address=self.broker.address,
                    run_id=run_id,
                    per_req=per_req,
                    tag=tag,
                    worker=0,
                    duration=600.0,
                    max_ops=n // per_req,
                )
            ],
            timeout=660,
        )

    def work_return(self, run_id: str, size: int, duration: float) -> Group:
        return run_group(
            load.http_work_return,
            [
                dict(
                    address=self.broker.address,
                    run_id=run_id,
                    size=size,
                    duration=duration,
                    max_ops=BIG,
                )
            ],
            timeout=duration + 120,
        )

    def raw_work(self, size: int, duration: float) -> Group:
        return run_group(
            load.redis_work_return,
            [
                dict(
                    url=self.redis.url,
                    key_prefix=self.raw_prefix,
                    size=size,
                    duration=duration,
                    max_ops=BIG,
                )
            ],
            timeout=duration + 120,
        )

    def used_memory(self) -> int:
        return int(self.rc.info("memory")["used_memory"])


def delete_keys(rc: redis.Redis, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 1000):
        rc.unlink(*keys[i : i + 1000])


# -- the sections ---------------------------------------------------------------------------
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
    r1.target("≤1.15× raw arrays", broker_delta / RAW_BYTES, 1.15, at_most=True)
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


def best_rate(groups: list[Group]) -> Group:
    """The repeat with the highest rate: other load on the machine only ever slows a run."""
    return max(groups, key=lambda g: g.rate)


def best_latency(groups: list[Group]) -> Group:
    return min(groups, key=lambda g: percentile(g.latencies, 50))


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
                if per == 1:
                    row.target("≥1.5× naive", row.vs_naive, 1.5)
                else:
                    row.target(">1× naive", row.vs_naive, 1.0)
                found[row.id] = row
    return [
        found[f"ingest.{fmt}.{per}.p{procs}"]
        for fmt in ("json", "msgpack")
        for per in (1, 64)
        for procs in (1, 4)
    ] + [found[f"durable_floor.ingest.p{procs}"] for procs in (1, 4)]


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


def scaling_rows(b: Bench) -> list[Row]:
    s = b.sizes
    size = s.batch
    rows: list[Row] = []
    later: list[Row] = []
    run = b.new_run("scaling", max_reuse=10_000)
    have = 0
    first: dict[int, float] = {}
    b.raw_clear()
    b.raw_write(64, 1, 600.0, math.ceil(max(s.trainers) * size * 2 / 64), "rs")
    for i, level in enumerate(s.levels):
        b.say(f"scaling: filling to {level:,} buffered")
        have += b.fill(run, level - have, f"s{i}")
        g = b.lease_ack(run, size, 1, s.level_s)
        for q in (50, 99):
            v = percentile(g.latencies, q) * 1e3
            first.setdefault(q, v)
            row = Row(
                f"scale.buffered.{level}.p{q}",
                "Cost vs buffered",
                f"lease of {size}, p{q}, {level:,} buffered",
                v,
                "ms",
                note=f"{v / first[q]:.2f}× the {s.levels[0]:,}-buffered figure",
            )
            if level == s.levels[-1]:  # flat: the most buffered against the least
                row.target(f"≤1.3× at {s.levels[0]:,}", v / first[q], 1.3, at_most=True)
            rows.append(row)
        if i == len(s.levels) // 2:
            later = trainer_rows(b, run, size, level)
    b.drop_run(run)
    b.raw_clear()
    return rows + later


def trainer_rows(b: Bench, run: str, size: int, level: int) -> list[Row]:
    s = b.sizes
    rows = []
    base: dict[str, float] = {}
    for n in s.trainers:
        b.say(f"scaling: {n} concurrent trainers")
        raw_g = b.raw_read(size, n, s.ceiling_s)
        g = b.lease_ack(run, size, n, s.trainer_s)
        lat = g.latencies
        figs = {
            "p50": (percentile(lat, 50) * 1e3, percentile(raw_g.latencies, 50) * 1e3, "ms"),
            "p99": (percentile(lat, 99) * 1e3, percentile(raw_g.latencies, 99) * 1e3, "ms"),
            "rate": (g.rate, raw_g.rate, "rollouts/s"),
        }
        for key, (v, raw, unit) in figs.items():
            base.setdefault(key, v)
            what = (
                "lease+ack rollouts/s, all trainers" if key == "rate" else f"lease of {size}, {key}"
            )
            row = Row(
                f"scale.trainers.{n}.{key}",
                "Cost vs trainers",
                f"{what}, {n} trainer{'s' if n > 1 else ''} ({level:,} buffered)",
                v,
                unit,
                raw=raw,
                tokens_per_s=v * TOKENS if key == "rate" else None,
                note=f"{v / base[key]:.2f}× the 1-trainer figure",
            )
            if key == "p99" and n == max(s.trainers) and n > 1:
                row.target("≤4× 1 trainer", v / base[key], 4.0, at_most=True)
            rows.append(row)
    return rows


def work_rows(b: Bench) -> list[Row]:
    """Work leases with the prompt queue at each depth: a generator takes a lease and gives it
    back unstarted, so the depth holds; the raw ceiling does the same at the same depth."""
    s = b.sizes
    size = s.work_size
    rows: list[Row] = []
    run = b.new_run("work", step_groups=1_000_000)  # the budget is checked, never binds
    b.raw_clear()
    have = 0
    first: dict[str, float] = {}
    for level in s.work_levels:
        b.say(f"work: registering prompts up to {level:,} queued")
        reg = b.register_prompts(run, level - have, f"p{level}")
        load.redis_fill_prompts(b.redis.url, b.raw_prefix, have, level - have)
        have = level
        got: dict[str, list[Group]] = {}
        for rep in range(s.repeats):
            b.say(f"work ceiling: raw Redis, leases of {size}, {level:,} queued (#{rep + 1})")
            got.setdefault("raw", []).append(b.raw_work(size, s.ceiling_s))
            b.say(f"work: broker, leases of {size}, {level:,} queued (#{rep + 1})")
            got.setdefault("broker", []).append(b.work_return(run, size, s.work_s))
        g, raw_g = best_rate(got["broker"]), best_rate(got["raw"])
        lat, raw_lat = best_latency(got["broker"]), best_latency(got["raw"])
        figs = {
            "rate": (g.rate, raw_g.rate, "prompts/s", f"{g.ops} leases"),
            "p50": (
                percentile(lat.latencies, 50) * 1e3,
                percentile(raw_lat.latencies, 50) * 1e3,
                "ms",
                f"{len(lat.latencies)} leases",
            ),
            "p99": (
                percentile(lat.latencies, 99) * 1e3,
                percentile(raw_lat.latencies, 99) * 1e3,
                "ms",
                f"{len(lat.latencies)} leases",
            ),
        }
        for key, (v, raw, unit, count) in figs.items():
            first.setdefault(key, v)
            what = (
                f"work lease of {size} + return, prompts/s"
                if key == "rate"
                else f"work lease of {size}, {key}"
            )
            note = f"{count}; {v / first[key]:.2f}× the {s.work_levels[0]:,}-queued figure"
            if key == "rate":
                note += f"; the prompts were registered at {reg.rate:,.0f}/s"
            rows.append(
                Row(
                    f"work.queued.{level}.{key}",
                    "Work leases (prompts)",
                    f"{what}, {level:,} queued (1 generator)",
                    v,
                    unit,
                    raw=raw,
                    note=note,
                )
            )
    b.drop_run(run)
    b.raw_clear()
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
        load.healthz_poll,
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
        load.big_body_load,
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


LONG_NEED = 0.6  # issue 14: lease + ack of 32,768-token rollouts at least 0.6× the raw ceiling
LONG_SECTION = "Long rollouts (32,768 tokens)"


def long_rows(b: Bench) -> list[Row]:
    """32,768-token rollouts with logprobs, as reasoning runs make them: msgpack ingest a few a
    request with 1 and 4 generators, JSON ingest one a request, and lease + ack of whole batches
    (max_reuse=1), each beside its raw-Redis ceiling and the naive dict moving the same
    rollouts, interleaved and repeated, best of each kept. The rows are rollouts/s; every
    rollout has the same raw array bytes, so ×raw is also the ratio in bytes/s (in the note)."""
    s = b.sizes
    tokens, per, size = LONG_TOKENS, s.long_per_req, s.long_batch
    payload = make_payload(tokens=tokens)
    item = len(payload.msgpack_item(rollout_id("l", 0, 0)))
    json_item = len(payload.json_item(rollout_id("l", 0, 0)))
    got: dict[str, list[Group]] = {}

    def keep(key: str, g: Group) -> None:
        got.setdefault(key, []).append(g)

    for rep in range(s.repeats):
        for procs in (1, 4):
            b.say(f"long: raw Redis writes, {per}/pipeline, {procs} proc (#{rep + 1})")
            ceiling = b.raw_write(per, procs, s.long_ceiling_s, BIG, f"lw{per}", tokens=tokens)
            keep(f"raw{per}.p{procs}", ceiling)
            b.raw_clear()
            b.say(f"long: naive dict, json, 1/request, {procs} proc (#{rep + 1})")
            keep(f"naive.p{procs}", long_naive_ingest(b, procs, s.long_naive_s))
            b.say(f"long: broker, msgpack, {per}/request, {procs} proc (#{rep + 1})")
            run = b.new_run(f"long-msgpack-{procs}")
            keep(f"msgpack.p{procs}", long_ingest(b, run, "msgpack", per, procs, s.long_ingest_s))
            b.drop_run(run)
        b.say(f"long: raw Redis writes, 1/pipeline, 1 proc (#{rep + 1})")
        keep("raw1.p1", b.raw_write(1, 1, s.long_ceiling_s, BIG, "lw1", tokens=tokens))
        b.raw_clear()
        b.say(f"long: broker, json, 1/request, 1 proc (#{rep + 1})")
        run = b.new_run("long-json")
        keep("json.p1", long_ingest(b, run, "json", 1, 1, s.long_ingest_s))
        b.drop_run(run)

        b.say(f"long: raw Redis reads of {size} (#{rep + 1})")
        # A pool of 5 batches (one more to warm up).
        b.raw_write(size, 1, 600.0, 4, f"lw{size}", tokens=tokens)
        keep("raw_read", b.raw_read(size, 1, s.long_ceiling_s))
        b.raw_clear()
        b.say(f"long: naive dict, batches of {size} pops (#{rep + 1})")
        keep("naive_pop", long_naive_pop(b, size, s.long_naive_s))
        run = b.new_run("long-lease", max_reuse=1)
        b.say(f"long: filling {s.long_fill:,} rollouts (#{rep + 1})")
        b.fill(run, s.long_fill, "lf", size, tokens=LONG_TOKENS)
        b.say(f"long: broker, lease + ack, msgpack, batches of {size} (#{rep + 1})")
        lease = b.lease_ack(run, size, 1, s.long_lease_s, stop_on_empty=True, tokens=tokens)
        keep("lease", lease)
        b.drop_run(run)

    def mb_s(rate: float) -> str:
        return f"{rate * raw_bytes(tokens) / 1e6:,.0f} MB/s"

    rows: list[Row] = []
    for fmt, n, procs, raw_key in (
        ("msgpack", per, 1, f"raw{per}.p1"),
        ("msgpack", per, 4, f"raw{per}.p4"),
        ("json", 1, 1, "raw1.p1"),
    ):
        g, raw = best_rate(got[f"{fmt}.p{procs}"]), best_rate(got[raw_key]).rate
        body = n * (item if fmt == "msgpack" else json_item)
        row = Row(
            f"long.ingest.{fmt}.{n}.p{procs}",
            LONG_SECTION,
            f"ingest of 32,768-token rollouts, {fmt}, {n}/request, "
            f"{procs} generator{'s' if procs > 1 else ''}",
            g.rate,
            "rollouts/s",
            raw=raw,
            naive=best_rate(got[f"naive.p{procs}"]).rate,
            tokens_per_s=g.rate * tokens,
            note=f"{mb_s(g.rate)} of raw arrays, raw Redis {mb_s(raw)}; "
            f"{g.ops / g.span:,.1f} requests/s of {body / 1e6:.2f} MB",
        )
        row.target(">1× naive", row.vs_naive, 1.0)
        rows.append(row)
    g, raw = best_rate(got["lease"]), best_rate(got["raw_read"]).rate
    row = Row(
        f"long.lease_ack.msgpack.{size}",
        LONG_SECTION,
        f"lease + ack of 32,768-token rollouts, msgpack, batches of {size}, 1 trainer "
        "(max_reuse=1)",
        g.rate,
        "rollouts/s",
        raw=raw,
        naive=best_rate(got["naive_pop"]).rate,
        tokens_per_s=g.rate * tokens,
        note=f"{mb_s(g.rate)} of raw arrays, raw Redis {mb_s(raw)}; {g.ops} batches; "
        f"lease p50 {percentile(g.latencies, 50) * 1e3:.1f} ms",
    )
    row.target(f"≥{LONG_NEED}× raw", row.vs_raw, LONG_NEED)
    row.target(">1× naive", row.vs_naive, 1.0)
    return [*rows, row]


def long_ingest(b: Bench, run: str, fmt: str, per_req: int, procs: int, duration: float) -> Group:
    """Generators posting 32,768-token rollouts, ``per_req`` a request, to ``run``."""
    return run_group(
        load.http_ingest,
        [
            dict(
                address=b.broker.address,
                path=f"/v1/runs/{run}/rollouts",
                fmt=fmt,
                per_req=per_req,
                tag=f"l{fmt[0]}{per_req}",
                worker=w,
                duration=duration,
                max_ops=BIG,
                tokens=LONG_TOKENS,
            )
            for w in range(procs)
        ],
        timeout=duration + 300,
    )


def long_naive_ingest(b: Bench, procs: int, duration: float) -> Group:
    """The naive dict's generators: one JSON 32,768-token rollout a request; emptied after."""
    g = run_group(
        load.naive_ingest,
        [
            dict(
                address=b.naive.address,
                tag=f"ln{procs}",
                worker=w,
                duration=duration,
                max_ops=BIG,
                tokens=LONG_TOKENS,
            )
            for w in range(procs)
        ],
        timeout=duration + 120,
    )
    b.naive_call("POST", "/_bench/clear")
    return g


def long_naive_pop(b: Bench, size: int, duration: float) -> Group:
    """The naive dict's trainer popping batches of ``size`` 32,768-token rollouts; emptied
    after."""
    b.naive_call("POST", "/_bench/clear")
    item = make_payload(tokens=LONG_TOKENS).json_item(rollout_id("lp", 0, 0))
    b.naive_call("POST", "/rollouts", item)
    b.naive_call("POST", f"/_bench/replicate?n={max(20 * size, 400)}&prefix=lp-")
    g = run_group(
        load.naive_pop,
        [dict(address=b.naive.address, size=size, duration=duration, max_ops=BIG)],
        timeout=duration + 120,
    )
    b.naive_call("POST", "/_bench/clear")
    return g


AUTH_SCOPES = ("generate", "train", "operate")
AUTH_NEED = 0.95  # auth on may cost at most 5 % of the throughput with auth off
METRICS_NEED = 0.97  # metrics on may cost at most 3 % of the throughput with metrics off
PAIR_SIDES = ("off", "on")
SCRAPE_EVERY_S = 5.0  # GET /metrics on the metrics-on broker while it is measured
PROMETHEUS_INTERVAL_S = 15.0  # deploy/prometheus/prometheus.yml's scrape_interval


@dataclass(frozen=True)
class Toggle:
    """A setting measured off against on by a pair of brokers alike but for it."""

    key: str  # the section and the row ids' first part
    title: str  # the rows' section title
    setting: str  # its env var, for the rows' text
    need: float  # on ÷ off at least
    env: dict[str, dict[str, str]]  # per side, the env that sets it
    on_text: str  # how the on side is described in its row


def auth_toggle(admin: str) -> Toggle:
    return Toggle(
        "auth",
        "Access control overhead",
        "BROKER_AUTH",
        AUTH_NEED,
        {"off": {"BROKER_AUTH": "off"}, "on": {"BROKER_AUTH": "on", "BROKER_ADMIN_TOKEN": admin}},
        "auth on (a token made through POST /v1/tokens)",
    )


METRICS_TOGGLE = Toggle(
    "metrics",
    "Metrics overhead",
    "BROKER_METRICS",
    METRICS_NEED,
    {"off": {"BROKER_METRICS": "off"}, "on": {"BROKER_METRICS": "on"}},
    f"metrics on (requests timed; GET /metrics every {SCRAPE_EVERY_S:g} s)",
)


@contextlib.contextmanager
def broker_pair(b: Bench, db_url: str, toggle: Toggle) -> Iterator[dict[str, Server]]:
    """Two brokers on the run's Redis and key prefix and on one migrated database, alike but
    for ``toggle``'s setting."""
    workdir = b.workdir or Path(tempfile.gettempdir())
    env = {
        "BROKER_REDIS_URL": b.redis.url,
        "BROKER_REDIS_PREFIX": b.prefix,
        "BROKER_DATABASE_URL": db_url,
    }

    def broker(side: str) -> contextlib.AbstractContextManager[Server]:
        return uvicorn_server(
            f"broker-{toggle.key}-{side}",
            "app.main:create_app",
            cwd=b.app_dir,
            workdir=workdir,
            env={**env, **toggle.env[side]},
            factory=True,
        )

    with broker("off") as off, broker("on") as on:
        yield {"off": off, "on": on}


def bench_token(server: Server, admin: str) -> str:
    """A generate/train/operate token made by the admin through ``POST /v1/tokens``, as an
    operator would make it: the load presents it, so that what is measured is the database
    token's path (looked up once, then cached), not the bootstrap token's comparison."""
    http = Http(server.address, admin)
    body = json.dumps({"name": "bench", "scopes": list(AUTH_SCOPES)}).encode()
    status, data, _ = http.call("POST", "/v1/tokens", body, "application/json")
    http.close()
    expect(status, data, 201)
    return str(json.loads(data)["token"])


def check_auth(servers: dict[str, Server], token: str) -> None:
    """Auth is on where it should be: ``on`` refuses a request without a token and takes one
    with it; ``off`` needs none."""
    for side, presented, want in (("on", None, 401), ("on", token, 200), ("off", None, 200)):
        http = Http(servers[side].address, presented)
        status, data, _ = http.call("GET", "/v1/runs")
        http.close()
        expect(status, data, want)


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


@dataclass(frozen=True)
class PairCase:
    key: str  # the row ids' middle
    what: str  # the measure's text
    kind: str  # the load.http_alternate kind
    spec: dict[str, Any]  # its per-side arguments, but for address, token, path / run_id
    per_op: int  # rollouts per operation
    op: str  # what one operation is, for the notes
    block_ops: int  # operations per block of the alternation
    warmup: int  # operations per side before the measured ones
    config: dict[str, Any] = field(default_factory=dict)  # of the runs


def pair_cases(s: Sizes) -> list[PairCase]:
    return [
        PairCase(
            "ingest.json.1",
            "ingest, json, 1/request, 1 generator",
            "ingest",
            dict(fmt="json", per_req=1, tag="a1", worker=0),
            1,
            "request",
            16,
            2,
        ),
        PairCase(
            "ingest.msgpack.64",
            "ingest, msgpack, 64/request, 1 generator",
            "ingest",
            dict(fmt="msgpack", per_req=64, tag="a64", worker=0),
            64,
            "request",
            2,
            2,
        ),
        PairCase(
            f"lease_ack.msgpack.{s.batch}",
            f"lease + ack, msgpack, batches of {s.batch}, 1 trainer (max_reuse=1)",
            "lease_ack",
            dict(fmt="msgpack", size=s.batch),
            s.batch,
            "lease + ack",
            1,
            1,
            dict(max_reuse=1),
        ),
    ]


@dataclass
class PairSide:
    """One side's figures for one case, over every round."""

    rates: list[float] = field(default_factory=list)  # rollouts/s, one per A B B A cycle
    cpu_s: float = 0.0  # the server's CPU over the rounds' loads, warm-up included
    cpu_ops: int = 0  # the operations it served in that time

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def cpu_per_op_us(self) -> float:
        return self.cpu_s / self.cpu_ops * 1e6


def auth_rows(b: Bench) -> list[Row]:
    """Ingest and lease + ack with auth off and on (see :func:`paired_rows`); the on side's
    load presents a token made through ``POST /v1/tokens``."""
    admin = secrets.token_urlsafe(32)
    token: str | None = None

    def prepare(servers: dict[str, Server]) -> dict[str, str | None]:
        nonlocal token
        token = token or bench_token(servers["on"], admin)  # the database keeps it
        check_auth(servers, token)
        return {"off": None, "on": token}

    return paired_rows(b, auth_toggle(admin), prepare, lambda _: contextlib.nullcontext())


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


def scrape_row(server: Server, n: int, scrapes: int) -> Row:
    http = Http(server.address)
    cpu0, t0 = proc_cpu_s(server.pid), time.monotonic()
    size = 0
    for _ in range(scrapes):
        status, data, _ = http.call("GET", "/metrics")
        expect(status, data, 200)
        size = len(data)
    cpu_ms = (proc_cpu_s(server.pid) - cpu0) / scrapes * 1e3
    wall_ms = (time.monotonic() - t0) / scrapes * 1e3
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


def paired_rows(
    b: Bench,
    toggle: Toggle,
    prepare: Callable[[dict[str, Server]], dict[str, str | None]],  # -> each side's token
    during: Callable[[dict[str, Server]], contextlib.AbstractContextManager[None]],
) -> list[Row]:
    """Ingest (JSON 1 a request, msgpack 64 a request) and lease + ack (msgpack) with
    ``toggle`` off and on. One client drives both brokers in turn, a few operations at a time
    (A B B A), so that both run at the same moments of the machine's drifting speed; each side's
    figure is the median of its rates over all those cycles. Every round starts a new pair of
    brokers (a process can be a few per cent faster than its twin for as long as it lives) and
    the side that leads alternates."""
    s = b.sizes
    cases = pair_cases(s)
    got = {case.key: {side: PairSide() for side in PAIR_SIDES} for case in cases}
    with postgres_database(b.pg_url, b.app_dir, b.workdir or Path(tempfile.gettempdir())) as db:
        for rnd in range(s.auth_rounds):
            order = PAIR_SIDES if rnd % 2 == 0 else PAIR_SIDES[::-1]
            b.say(
                f"{toggle.key}: round {rnd + 1}/{s.auth_rounds}, a new pair of brokers, "
                f"{order[0]} leads"
            )
            with broker_pair(b, db, toggle) as servers:
                tokens = prepare(servers)
                for case in cases:
                    b.say(f"{toggle.key}: {case.what}, round {rnd + 1}/{s.auth_rounds}")
                    sides = [(side, servers[side], tokens[side]) for side in order]
                    with during(servers):
                        pair_round(b, toggle, case, sides, got[case.key])
    rows: list[Row] = []
    for case in cases:
        rows += pair_case_rows(toggle, case, got[case.key]["off"], got[case.key]["on"])
    return rows


def pair_round(
    b: Bench,
    toggle: Toggle,
    case: PairCase,
    sides: list[tuple[str, Server, str | None]],
    got: dict[str, PairSide],
) -> None:
    """One round of ``case``: a run on each server (filled first for lease + ack), then one
    client alternating between them; adds each side's figures to ``got``."""
    s = b.sizes
    specs, runs = [], []
    for side, server, token in sides:
        run = b.new_run(f"{toggle.key}-{side}", server=server, token=token, **case.config)
        runs.append(run)
        where = dict(path=f"/v1/runs/{run}/rollouts") if case.kind == "ingest" else dict(run_id=run)
        specs.append({**case.spec, **where, "address": server.address, "token": token})
        if case.kind == "lease_ack":
            b.fill(run, s.auth_lease_fill, "al", server=server, token=token)
    duration = 2 * s.auth_s if case.kind == "ingest" else 600.0  # lease + ack: until empty
    cpu0 = [proc_cpu_s(server.pid) for _, server, _ in sides]
    g = run_group(
        load.http_alternate,
        [
            dict(
                kind=case.kind,
                sides=specs,
                block_ops=case.block_ops,
                duration=duration,
                warmup=case.warmup,
            )
        ],
        timeout=duration + 300,
    )
    res = g.results[0]
    assert isinstance(res, load.Alternated)
    for i, ((side, server, _), c0, one) in enumerate(zip(sides, cpu0, res.sides, strict=True)):
        acc = got[side]
        acc.cpu_s += proc_cpu_s(server.pid) - c0
        acc.cpu_ops += one.ops + one.empty + case.warmup
        acc.rates += [cycle[i][0] / cycle[i][1] for cycle in res.cycles]
    for run in runs:
        b.drop_run(run)


def pair_case_rows(toggle: Toggle, case: PairCase, off: PairSide, on: PairSide) -> list[Row]:
    paired = sorted(a / b for a, b in zip(on.rates, off.rates, strict=True))
    n = len(paired)
    ratio = on.rate / off.rate
    name = toggle.key

    def us_per_op(rate: float) -> float:
        return case.per_op / rate * 1e6

    off_row = Row(
        f"{name}.{case.key}.off",
        toggle.title,
        f"{case.what}, {name} off",
        off.rate,
        "rollouts/s",
        tokens_per_s=off.rate * TOKENS,
        note=f"median of {n} cycles; {us_per_op(off.rate):,.0f} µs per {case.op}, "
        f"server CPU {off.cpu_per_op_us():,.0f} µs",
    )
    on_row = Row(
        f"{name}.{case.key}.on",
        toggle.title,
        f"{case.what}, {toggle.on_text}",
        on.rate,
        "rollouts/s",
        tokens_per_s=on.rate * TOKENS,
        note=f"on/off ×{ratio:.3f}; the cycles' own on/off: median ×{statistics.median(paired):.3f}"
        f", middle half ×{paired[n // 4]:.3f} to ×{paired[(3 * n) // 4]:.3f}; "
        f"{us_per_op(on.rate) - us_per_op(off.rate):+,.0f} µs per {case.op}, "
        f"server CPU {on.cpu_per_op_us() - off.cpu_per_op_us():+,.0f} µs",
    )
    on_row.target(f"≥{toggle.need}× {name} off", ratio, toggle.need)
    return [off_row, on_row]


WORKERS = (1, 2)  # the API processes (serve --workers) of the brokers compared
WORKERS_SECTION = "API processes (serve --workers)"
WORKERS_PROCS = 4  # generators and trainers of the --workers rows


def workers_rows(b: Bench) -> list[Row]:
    """Ingest (JSON 1 a request, msgpack 64 a request) from 4 generators and lease + ack (msgpack)
    by 4 trainers against ``rollout-broker serve --workers 1`` and ``--workers 2``, both
    started through the CLI on the run's Redis (a key prefix each) and one new database, with
    no background workers. The two are measured in turn, the side that leads alternating, and
    repeated; the best of each is kept, and the ``--workers 2`` rows' notes give the ratio."""
    from benchmarks.servers import cli_server

    s = b.sizes
    size = s.batch
    workdir = b.workdir or Path(tempfile.gettempdir())
    cases = (("json", 1), ("msgpack", 64))
    got: dict[str, list[Group]] = {}
    with postgres_database(b.pg_url, b.app_dir, workdir) as db, contextlib.ExitStack() as stack:
        servers: dict[int, Server] = {}
        prefixes: dict[int, str] = {}
        for n in WORKERS:
            prefix = prefixes[n] = f"{b.prefix}w{n}"
            stack.callback(
                lambda p=prefix: delete_keys(
                    b.rc, list(b.rc.scan_iter(match=keys.every_key(p), count=2000))
                )
            )
            env = {
                "BROKER_REDIS_URL": b.redis.url,
                "BROKER_REDIS_PREFIX": prefix,
                "BROKER_DATABASE_URL": db,
            }
            b.say(f"workers: starting `serve --workers {n}`")
            servers[n] = stack.enter_context(
                cli_server(
                    f"broker-workers-{n}",
                    "--workers",
                    str(n),
                    cwd=b.app_dir,
                    workdir=workdir,
                    env=env,
                    processes=n,
                )
            )

        def drop(n: int, run: str) -> None:
            delete_keys(b.rc, list(b.rc.scan_iter(match=keys.run_base(prefixes[n], run) + "*")))

        pools: dict[int, str] = {}
        for n, server in servers.items():
            pools[n] = b.new_run(f"workers{n}-lease", server=server, max_reuse=10_000)
            b.fill(pools[n], s.workers_lease_fill, f"wl{n}", server=server)
        for rep in range(s.repeats):
            for n in WORKERS if rep % 2 == 0 else WORKERS[::-1]:
                server = servers[n]
                for fmt, per in cases:
                    b.say(f"workers: --workers {n}, ingest {fmt} {per}/request (#{rep + 1})")
                    run = b.new_run(f"workers{n}-{fmt}-{per}", server=server)
                    g = run_group(
                        load.http_ingest,
                        [
                            dict(
                                address=server.address,
                                path=f"/v1/runs/{run}/rollouts",
                                fmt=fmt,
                                per_req=per,
                                tag=f"w{per}",
                                worker=w,
                                duration=s.workers_s,
                                max_ops=BIG,
                            )
                            for w in range(WORKERS_PROCS)
                        ],
                        timeout=s.workers_s + 300,
                    )
                    got.setdefault(f"ingest.{fmt}.{per}.w{n}", []).append(g)
                    drop(n, run)
                b.say(f"workers: --workers {n}, lease + ack of {size} (#{rep + 1})")
                g = b.lease_ack(pools[n], size, WORKERS_PROCS, s.workers_s, server=server)
                got.setdefault(f"lease_ack.msgpack.{size}.w{n}", []).append(g)

    def what(key: str) -> str:
        if key.startswith("ingest."):
            _, fmt, per = key.split(".")
            return f"ingest, {fmt}, {per}/request, {WORKERS_PROCS} generators"
        return f"lease + ack, msgpack, batches of {size}, {WORKERS_PROCS} trainers"

    rows: list[Row] = []
    one = WORKERS[0]
    for key in (*(f"ingest.{fmt}.{per}" for fmt, per in cases), f"lease_ack.msgpack.{size}"):
        best = {n: best_rate(got[f"{key}.w{n}"]) for n in WORKERS}
        ops = "requests" if key.startswith("ingest") else "batches"
        for n, g in best.items():
            note = f"{g.ops / g.span:,.0f} {ops}/s"
            if n != one:
                note += f"; --workers {n} / --workers {one}: ×{g.rate / best[one].rate:.2f}"
            rows.append(
                Row(
                    f"workers.{key}.w{n}",
                    WORKERS_SECTION,
                    f"{what(key)}, serve --workers {n}",
                    g.rate,
                    "rollouts/s",
                    tokens_per_s=g.rate * TOKENS,
                    note=note,
                )
            )
    return rows


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


SECTIONS = {
    "memory": memory_rows,
    "ingest": ingest_rows,
    "lease": lease_rows,
    "scaling": scaling_rows,
    "work": work_rows,
    "bodies": body_rows,
    "long": long_rows,
    "auth": auth_rows,
    "metrics": metrics_rows,
    "workers": workers_rows,
    "drain": drain_rows,
    "cluster": cluster_rows,
}


# -- output ---------------------------------------------------------------------------------
def fmt_value(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if unit == "rollouts/s":
        return f"{v:,.0f} r/s"
    if unit == "prompts/s":
        return f"{v:,.0f} prompts/s"
    if unit == "ms":
        return f"{v:.2f} ms" if v < 100 else f"{v:,.0f} ms"
    return f"{v:,.0f} B"


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"×{r:.2f}"


def fmt_targets(row: Row) -> str:
    parts = []
    for t in row.targets:
        verdict = "PASS" if t["ok"] else "MISS"
        ratio = "–" if t["ratio"] is None else f"{t['ratio']:.2f}"
        parts.append(f"{t['name']}: {ratio} {verdict}")
    return "; ".join(parts)


def table(rows: list[Row]) -> str:
    head = [
        "measure",
        "broker",
        "tokens/s",
        "raw Redis",
        "×raw",
        "naive dict",
        "×naive",
        "target",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            lines.append(f"| **{section}** |" + " |" * (len(head) - 1))
        toks = "–" if r.tokens_per_s is None else f"{r.tokens_per_s / 1e6:.2f} M"
        cells = [
            r.measure,
            fmt_value(r.value, r.unit),
            toks,
            fmt_value(r.raw, r.unit),
            fmt_ratio(r.vs_raw),
            fmt_value(r.naive, r.unit),
            fmt_ratio(r.vs_naive),
            fmt_targets(r),
            r.note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(rt: RedisTarget, app_dir: Path) -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    rev = subprocess.run(
        ["git", "-C", str(app_dir), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(app_dir), "status", "--porcelain", "--untracked-files=no", "app"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "redis": f"{rt.version} ({'private server' if rt.private else 'shared server: ' + rt.url})",
        "server": uvicorn_stack(),
        "app": f"{app_dir} @ {rev or '?'}{' + local changes' if dirty else ''}",
    }


def summary(rows: list[Row]) -> str:
    checks = [(r, t) for r in rows for t in r.targets]
    missed = [f"{r.id} ({t['name']})" for r, t in checks if not t["ok"]]
    line = f"targets: {len(checks) - len(missed)} PASS, {len(missed)} MISS"
    return line + (": " + ", ".join(missed) if missed else "")


# -- main -----------------------------------------------------------------------------------
@contextlib.contextmanager
def harness(args: argparse.Namespace, sizes: Sizes) -> Iterator[Bench]:
    app_dir = Path(args.app_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="rb-bench-") as tmp:
        work = Path(tmp)
        with redis_server(work, args.redis_url) as rt:
            prefix = f"rbbench{uuid.uuid4().hex[:8]}"
            rc = rt.client()
            try:
                env = {"BROKER_REDIS_URL": rt.url, "BROKER_REDIS_PREFIX": prefix}
                with (
                    uvicorn_server(
                        "broker",
                        "app.main:create_app",
                        cwd=app_dir,
                        workdir=work,
                        env=env,
                        factory=True,
                    ) as broker,
                    uvicorn_server(
                        "naive",
                        "benchmarks.naive_app:app",
                        cwd=ROOT,
                        workdir=work,
                        env={  # the durable floor's writes, deleted with the raw keys
                            "BENCH_FLOOR_REDIS_URL": rt.url,
                            "BENCH_FLOOR_PREFIX": f"{prefix}:raw:floor:",
                        },
                    ) as naive,
                ):
                    yield Bench(
                        sizes,
                        rt,
                        broker,
                        naive,
                        prefix,
                        rc,
                        rt.pid,
                        app_dir=app_dir,
                        workdir=work,
                        pg_url=args.pg_url,
                    )
            finally:
                delete_keys(rc, list(rc.scan_iter(match=keys.every_key(prefix), count=2000)))
                rc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, ~15 s)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and machine as JSON")
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    p.add_argument("--app-dir", default=str(ROOT), help="the broker source tree to benchmark")
    p.add_argument(
        "--pg-url",
        default=os.environ.get("BENCH_PG_URL", PG_URL),
        help="Postgres server (its user may create databases) for the auth, metrics, workers "
        "and drain rows; "
        f"default $BENCH_PG_URL or {PG_URL}",
    )
    p.add_argument("--only", default=",".join(SECTIONS), help="sections: " + ",".join(SECTIONS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply every duration by this")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.scale != 1.0:
        sizes = replace(
            sizes,
            **{
                k: getattr(sizes, k) * args.scale
                for k in sizes.__dataclass_fields__
                if k.endswith("_s")
            },
        )
    wanted = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = set(wanted) - SECTIONS.keys()
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    started = time.monotonic()
    rows: list[Row] = []
    with harness(args, sizes) as bench:
        info = machine(bench.redis, Path(args.app_dir).resolve())
        meter = CpuMeter([p for p in bench.server_pids if p])
        meter.start()
        for name in SECTIONS:
            if name in wanted:
                t = time.monotonic()
                rows += SECTIONS[name](bench)
                bench.say(f"{name}: {time.monotonic() - t:.1f} s")
        info["cpu load"] = meter.report()
    elapsed = time.monotonic() - started
    header = [
        f"Rollout Broker benchmarks ({'quick' if args.quick else 'full'}, {elapsed:.0f} s): "
        f"{TOKENS}-token rollouts with logprobs ({RAW_BYTES:,} raw array bytes), "
        f"{ID_LEN}-char ids",
        *(f"- {k}: {v}" for k, v in info.items()),
        "- ×raw / ×naive: the broker's speed relative to the baseline (for latency and bytes: "
        "baseline ÷ broker); above 1 the broker is better",
        "",
    ]
    print("\n".join(header))
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "elapsed_s": elapsed,
                    "quick": args.quick,
                    "rows": [r.to_json() for r in rows],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
