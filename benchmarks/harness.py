"""The harness every section runs on: the sizes of a run, a row of the table with its ratios and
targets, and :class:`Bench`, which holds the servers of the run and drives load at them.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from app import keys
from benchmarks import load, load_prompts
from benchmarks.load import Group, Http, expect, percentile, run_group
from benchmarks.payloads import TOKENS, rollout_id
from benchmarks.servers import PG_URL, RedisTarget, Server

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
            load_prompts.http_register,
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
            load_prompts.http_work_return,
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

    def work_return_partials(
        self, run_id: str, size: int, partials: int, tokens: int, duration: float
    ) -> Group:
        return run_group(
            load_prompts.http_work_return_partials,
            [
                dict(
                    address=self.broker.address,
                    run_id=run_id,
                    size=size,
                    partials=partials,
                    tokens=tokens,
                    duration=duration,
                    max_ops=BIG,
                )
            ],
            timeout=duration + 120,
        )

    def raw_work(self, size: int, duration: float) -> Group:
        return run_group(
            load_prompts.redis_work_return,
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


def best_rate(groups: list[Group]) -> Group:
    """The repeat with the highest rate: other load on the machine only ever slows a run."""
    return max(groups, key=lambda g: g.rate)


def best_latency(groups: list[Group]) -> Group:
    return min(groups, key=lambda g: percentile(g.latencies, 50))
