"""``--only cluster``: one load spread over many runs, against one Redis node and against a
3-master Redis Cluster, in one run of the benchmark.

Both sides are started from the same ``redis-server`` binary with the same settings
(:mod:`benchmarks.rediscluster`), each with its own broker (one uvicorn process, as in
``benchmarks/servers.py``; ``BROKER_REDIS_CLUSTER=1`` for the cluster's). Every key of a run
carries the ``{run_id}`` hash tag, so a run lives on one slot: the run ids are chosen by their
slot so that every master holds as many runs as the others.

The load, the same on both sides: generators posting msgpack ingests of 64 rollouts to the runs
in turn, and trainers leasing batches from the runs in turn and acking them (``max_reuse=1``),
all at once over one window; each run is filled beforehand so the trainers start with rollouts
waiting. The windows run single, cluster, cluster, single (A B B A; one of each with
``--quick``) with new runs each, and the window with the most rollouts moved is kept per side.
Redis CPU is ``used_cpu_user + used_cpu_sys`` of ``INFO cpu``, its change over the window, per
node.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from redis.crc import key_slot

from app import keys
from benchmarks.harness import Bench, Row
from benchmarks.load import Http, Result, expect, run_group
from benchmarks.payloads import CONTENT_TYPE, TOKENS, ack_body, ingest_body, make_payload
from benchmarks.rediscluster import (
    MASTERS,
    Cluster,
    Node,
    cluster_binaries,
    node_port,
    redis_cluster,
    redis_nodes,
    server_version,
)
from benchmarks.servers import Server, proc_cpu_s, uvicorn_server

RUNS_PER_MASTER = 4  # 12 runs: every master holds 4
GENERATORS = 2  # load processes posting rollouts, each to every run in turn
TRAINERS = 2  # load processes leasing and acking, each from every run in turn
PER_REQ = 64  # rollouts per ingest request (msgpack)
BALANCE_NEED = 1.5  # the busiest master's Redis CPU at most 1.5x the idlest's
SECTION = "Redis Cluster (3 masters) against one node"


# -- runs -----------------------------------------------------------------------------------
def balanced_runs(cluster: Cluster, prefix: str, tag: str) -> list[str]:
    """``RUNS_PER_MASTER`` run ids per master: the first ids of the series ``cl<tag>-000``,
    ``cl<tag>-001``, … whose run key hashes to a slot of that master, interleaved by master
    (the id at index j lives on master j % MASTERS)."""
    per: list[list[str]] = [[] for _ in cluster.nodes]
    for i in range(10_000):
        run_id = f"cl{tag}-{i:03d}"
        m = cluster.master_of(key_slot(keys.run_key(prefix, run_id).encode()))
        if len(per[m]) < RUNS_PER_MASTER:
            per[m].append(run_id)
        if all(len(p) == RUNS_PER_MASTER for p in per):
            return [p[k] for k in range(RUNS_PER_MASTER) for p in per]
    raise RuntimeError("could not balance the runs over the masters")


def create_runs(server: Server, run_ids: list[str]) -> None:
    http = Http(server.address)
    try:
        for run_id in run_ids:
            cfg = {"capacity_rollouts": 1_000_000, "max_reuse": 1}
            body = json.dumps({"run_id": run_id, "config": cfg}).encode()
            status, data, _ = http.call("POST", "/v1/runs", body, "application/json")
            expect(status, data, 201)
    finally:
        http.close()


def drop_runs(nodes: list[Node], prefix: str, run_ids: list[str]) -> None:
    """Delete the runs' keys on whichever node holds them (one ``UNLINK`` per run and node: a
    run's keys share one slot)."""
    for node in nodes:
        r = node.client()
        try:
            for run_id in run_ids:
                found = list(r.scan_iter(match=keys.run_base(prefix, run_id) + "*", count=2000))
                for i in range(0, len(found), 1000):
                    r.unlink(*found[i : i + 1000])
        finally:
            r.close()


# -- the load -------------------------------------------------------------------------------
@dataclass
class Spread(Result):
    """One load process's figures, and which kind of process it was."""

    role: str = ""
    per_run: dict[str, int] = field(default_factory=dict)  # rollouts moved, by run


def spread_load(
    *,
    role: str,
    tag: str,
    address: tuple[str, int],
    run_ids: list[str],
    worker: int,
    size: int,
    duration: float,
    max_ops: int,
    barrier: Any,
) -> Spread:
    """A generator (``role`` ingest: ``PER_REQ`` msgpack rollouts a request) or a trainer
    (``role`` lease_ack: a lease of ``size``, then its ack) going over ``run_ids`` in turn,
    starting at a run of its own, on one connection, until ``duration`` or ``max_ops``. A trainer
    that finds a run empty (204) moves on to the next and counts it in ``empty``."""
    payload = make_payload()
    http = Http(address)
    ctype = CONTENT_TYPE["msgpack"]
    res = Spread(role=role)
    seq = 0
    turn = worker * len(run_ids) // max(1, GENERATORS if role == "ingest" else TRAINERS)

    def ingest(run_id: str) -> int:
        nonlocal seq
        items = [payload.msgpack_item(f"{tag}{worker:02d}{seq + i:029d}") for i in range(PER_REQ)]
        seq += PER_REQ
        body = ingest_body("msgpack", items)
        status, data, _ = http.call("POST", f"/v1/runs/{run_id}/rollouts", body, ctype)
        expect(status, data, 202)
        return PER_REQ

    def lease_ack(run_id: str) -> int:
        status, data, _ = http.call("GET", f"/v1/runs/{run_id}/batch?size={size}", accept=ctype)
        if status == 204:
            return 0
        expect(status, data, 200)
        doc = msgpack.unpackb(data, raw=False)
        rids = [r["rollout_id"] for r in doc["rollouts"]]
        path = f"/v1/runs/{run_id}/batches/{doc['batch_id']}/ack"
        status, data, _ = http.call("POST", path, ack_body("msgpack", rids, payload), ctype)
        expect(status, data, 200)
        return len(rids)

    step = ingest if role == "ingest" else lease_ack
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        run_id = run_ids[turn % len(run_ids)]
        turn += 1
        t = time.perf_counter()
        got = step(run_id)
        if got == 0:
            res.empty += 1
            continue
        res.lat.append(time.perf_counter() - t)
        res.ops += 1
        res.rollouts += got
        res.per_run[run_id] = res.per_run.get(run_id, 0) + got
    res.t1 = time.perf_counter()
    http.close()
    return res


@dataclass
class Window:
    """One side's measurement: rollouts/s each way, and each node's Redis CPU seconds."""

    ingest: float
    lease_ack: float
    ingested: int
    acked: int
    empty: int
    seconds: float
    cpu_s: list[float]  # Redis, per node
    broker_cpu_s: float  # the broker's uvicorn process
    load_cpu_s: float  # the load processes together
    per_run: dict[str, int]  # rollouts moved (ingested and acked), by run

    def cores(self, cpu_s: float) -> str:
        return f"{cpu_s / self.seconds:.2f} cores"

    @property
    def moved(self) -> float:
        return self.ingest + self.lease_ack

    @property
    def rollouts(self) -> int:
        return self.ingested + self.acked


def rate(results: list[Spread]) -> tuple[float, int, float]:
    n = sum(r.rollouts for r in results)
    span = max(r.t1 for r in results) - min(r.t0 for r in results)
    return (n / span if span > 0 else 0.0), n, span


def measure(
    b: Bench, server: Server, nodes: list[Node], prefix: str, run_ids: list[str], fill: int
) -> Window:
    """Fill every run with ``fill`` rollouts, then generators and trainers over all runs for
    the window, Redis CPU read from every node just before and just after."""
    s = b.sizes
    create_runs(server, run_ids)
    per_proc = len(run_ids) * fill // PER_REQ // GENERATORS
    run_group(
        spread_load,
        [
            dict(
                role="ingest",
                tag="f",
                address=server.address,
                run_ids=run_ids,
                worker=w,
                size=s.batch,
                duration=600.0,
                max_ops=per_proc,
            )
            for w in range(GENERATORS)
        ],
        timeout=660,
    )
    window = 3 * s.lease_s
    specs = [
        dict(role="ingest", tag="w", worker=w, size=s.batch, max_ops=10**9)
        for w in range(GENERATORS)
    ]
    specs += [
        dict(role="lease_ack", tag="t", worker=w, size=s.batch, max_ops=10**9)
        for w in range(TRAINERS)
    ]
    cpu0 = [n.cpu_s() for n in nodes]
    broker0, load0 = proc_cpu_s(server.pid), children_cpu_s()
    g = run_group(
        spread_load,
        [
            {**spec, "address": server.address, "run_ids": run_ids, "duration": window}
            for spec in specs
        ],
        timeout=window + 300,
    )
    cpu = [n.cpu_s() - c0 for n, c0 in zip(nodes, cpu0, strict=True)]
    broker_cpu, load_cpu = proc_cpu_s(server.pid) - broker0, children_cpu_s() - load0
    drop_runs(nodes, prefix, run_ids)
    res = [r for r in g.results if isinstance(r, Spread)]
    ing, ingested, span_i = rate([r for r in res if r.role == "ingest"])
    ack, acked, span_a = rate([r for r in res if r.role == "lease_ack"])
    empty = sum(r.empty for r in res)
    span = max(span_i, span_a)
    per_run = {run_id: sum(r.per_run.get(run_id, 0) for r in res) for run_id in run_ids}
    return Window(ing, ack, ingested, acked, empty, span, cpu, broker_cpu, load_cpu, per_run)


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the load processes)."""
    t = os.times()
    return t.children_user + t.children_system


# -- the section ----------------------------------------------------------------------------
@contextlib.contextmanager
def started_together(
    managers: Sequence[contextlib.AbstractContextManager[Server]],
) -> Iterator[list[Server]]:
    """Enter ``managers`` at once, each from a thread of its own (a broker takes seconds to
    answer its first ``/healthz``); exit them in reverse order, also when one failed to start."""
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(managers)) as pool:
            futures = [pool.submit(m.__enter__) for m in managers]
        servers, errors = [], []
        for m, f in zip(managers, futures, strict=True):
            try:
                servers.append(f.result())
                stack.push(m)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        yield servers


def cluster_rows(b: Bench) -> list[Row]:
    found = cluster_binaries()
    if found is None:
        b.say("cluster: skipped, no redis-server 5.0+ with a redis-cli beside it or on PATH")
        return []
    binary, cli = found
    s = b.sizes
    prefix = f"rbcl{uuid.uuid4().hex[:8]}"
    n_runs = MASTERS * RUNS_PER_MASTER
    fill = max(2 * s.batch, s.lease_fill // n_runs // PER_REQ * PER_REQ)
    order = ("single", "cluster", "cluster", "single")[: 2 * s.repeats]
    workdir = b.workdir or Path(tempfile.gettempdir())
    got: dict[str, list[Window]] = {"single": [], "cluster": []}
    b.say(f"cluster: starting one node and a {MASTERS}-master cluster ({binary})")
    single_dir = Path(tempfile.mkdtemp(prefix="rb-single-", dir=workdir))
    try:
        with (
            redis_nodes(binary, [node_port()], single_dir, cluster=False) as single,
            redis_cluster(binary, cli, workdir) as cluster,
        ):
            base = {"BROKER_REDIS_PREFIX": prefix}
            brokers = [
                uvicorn_server(
                    f"broker-{side}",
                    "app.main:create_app",
                    cwd=b.app_dir,
                    workdir=workdir,
                    env={**base, "BROKER_REDIS_URL": url, "BROKER_REDIS_CLUSTER": flag},
                    factory=True,
                )
                for side, url, flag in (
                    ("single", single[0].url, "0"),
                    ("cluster", cluster.url, "1"),
                )
            ]
            with started_together(brokers) as (broker_single, broker_cluster):
                sides = {
                    "single": (broker_single, single),
                    "cluster": (broker_cluster, cluster.nodes),
                }
                for k, side in enumerate(order):
                    run_ids = balanced_runs(cluster, prefix, str(k))
                    server, nodes = sides[side]
                    b.say(
                        f"cluster: {side}, {n_runs} runs filled with {fill:,} rollouts each, "
                        f"then {GENERATORS} generators + {TRAINERS} trainers for "
                        f"{3 * s.lease_s:.1f} s (#{k + 1}/{len(order)})"
                    )
                    got[side].append(measure(b, server, nodes, prefix, run_ids, fill))
                slots = [cluster.slot_text(i) for i in range(MASTERS)]
                ports = [n.port for n in cluster.nodes]
    finally:
        shutil.rmtree(single_dir, ignore_errors=True)

    one = max(got["single"], key=lambda w: w.moved)
    many = max(got["cluster"], key=lambda w: w.moved)
    version = server_version(binary)
    load_text = f"{n_runs} runs, {GENERATORS} generators + {TRAINERS} trainers"
    rows: list[Row] = []
    for key, what, attr, count in (
        ("ingest", f"ingest, msgpack, {PER_REQ}/request", "ingest", "ingested"),
        ("lease_ack", f"lease + ack, msgpack, batches of {s.batch}", "lease_ack", "acked"),
    ):
        for side, w in (("single", one), ("cluster", many)):
            v = float(getattr(w, attr))
            note = f"{getattr(w, count):,} rollouts in {w.seconds:.1f} s"
            if side == "cluster":
                note = f"cluster/single ×{v / getattr(one, attr):.2f}; " + note
            if key == "ingest":
                note += (
                    f"; over the window the broker process used {w.cores(w.broker_cpu_s)}, "
                    f"the load processes {w.cores(w.load_cpu_s)}, Redis {w.cores(sum(w.cpu_s))}"
                )
            else:
                note += f"; {w.empty} leases found a run empty (204)"
            where = "one node" if side == "single" else f"{MASTERS}-master cluster"
            rows.append(
                Row(
                    f"cluster.{key}.{side}",
                    SECTION,
                    f"{what}, {load_text} at once, {where}",
                    v,
                    "rollouts/s",
                    tokens_per_s=v * TOKENS,
                    note=note,
                )
            )

    def cpu_note(cpu_s: float, w: Window) -> str:
        return (
            f"{w.cores(cpu_s)} over the {w.seconds:.1f} s window; "
            f"{cpu_s / w.rollouts * 1e6:.1f} µs per rollout moved"
        )

    single_cpu = one.cpu_s[0]
    rows.append(
        Row(
            "cluster.redis_cpu.single",
            SECTION,
            f"Redis CPU (used_cpu_user + used_cpu_sys Δ) over the window, one node (redis "
            f"{version})",
            single_cpu * 1e3,
            "ms",
            note=cpu_note(single_cpu, one),
        )
    )
    low = min(many.cpu_s)
    # balanced_runs interleaves the masters: the run at index j lives on master j % MASTERS
    moved = [0] * MASTERS
    for j, n in enumerate(many.per_run.values()):
        moved[j % MASTERS] += n
    for i, cpu_s in enumerate(many.cpu_s):
        rows.append(
            Row(
                f"cluster.redis_cpu.master{i + 1}",
                SECTION,
                f"Redis CPU over the window, cluster master {i + 1} ({RUNS_PER_MASTER} runs)",
                cpu_s * 1e3,
                "ms",
                note=f"×{cpu_s / low:.2f} the least busy master; {many.cores(cpu_s)}; "
                f"{moved[i]:,} rollouts moved on its runs, {cpu_s / max(1, moved[i]) * 1e6:.1f} "
                f"µs each; slots {slots[i]}, port {ports[i]}",
            )
        )
    total = sum(many.cpu_s)
    balance = max(many.cpu_s) / low if low > 0 else None
    row = Row(
        "cluster.redis_cpu.all",
        SECTION,
        f"Redis CPU over the window, the {MASTERS} cluster masters together",
        total * 1e3,
        "ms",
        note=f"busiest/least busy master ×{balance or float('nan'):.2f}; "
        f"×{total / single_cpu:.2f} the one node's; " + cpu_note(total, many),
    )
    row.target(f"≤{BALANCE_NEED}× busiest/least busy master", balance, BALANCE_NEED, at_most=True)
    rows.append(row)
    return rows
