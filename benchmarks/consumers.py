"""What consumers cost the policy trainer, and how fast one reads:
``python -m benchmarks.consumers`` (about a minute; ``--rounds 5`` for a quick look).

A private Redis and the broker (uvicorn, the real API process) on 127.0.0.1. Runs of groups of
8 hold the same rollouts of 1,024 tokens (msgpack, raw arrays, rewards 0 to 6 in a group),
posted before anything is timed, with consumers of source ``trained``: none; one of kind
rollouts; three (two of kind rollouts, one of preferences, ``best_worst``); one of preferences
with ``pairs: all`` (28 pairs a group). Each acked batch is delivered to every one of them at
its first use, and with ``max_reuse`` 1 each rollout then retires from the trainer's buffer
while its consumers still hold it, so its blob is kept (the path consumers add to an ack). Each
round takes turns between the runs: a lease of ``--batch`` rollouts and its ack, timed together.
A fourth run has one consumer of source ``received``; there each round times the trainer's
lease + ack and then the consumer's lease + ack of as many items, both reading the same rollouts.

Each row is the median of ``--rounds`` rounds, seen by a keep-alive ``http.client`` connection,
with the ratio against the run without consumers (or against the trainer, for the consumer's
row) measured in the same run; and the median time Redis spent in the scripts of that lease and
ack, from its SLOWLOG (every command logged, each told apart by its run's key), the figure
consumers change and the one the machine's noise touches least.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import redis

from app.broker.scripts import LIBRARY
from benchmarks.measure_http import (
    MSGPACK,
    Conn,
    every_command_logged,
    served,
    timed_rounds,
    turn_args,
)
from benchmarks.servers import Server

JSON_BODY = {"content-type": "application/json"}
GROUP = 8


def post_rollouts(conn: Conn, run: str, n: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, tokens).astype("<i4").tobytes()
    lps = (-rng.exponential(1.0, tokens)).astype("<f4").tobytes()
    for start in range(0, n, 64):
        docs = [
            {
                "rollout_id": f"x{i}",
                "policy_version": 0,
                "response_ids": ids,
                "logprobs": lps,
                "reward": float(i % 7),
                "group_id": f"g{i // GROUP}",
            }
            for i in range(start, min(n, start + 64))
        ]
        body = msgpack.packb({"rollouts": docs}, use_bin_type=True)
        conn.call("POST", f"/v1/runs/{run}/rollouts", body, **{"content-type": MSGPACK})


def make_run(conn: Conn, run: str, consumers: list[dict[str, Any]], n: int, tokens: int) -> None:
    config = {
        "max_reuse": 1,
        "group_size": GROUP,
        "capacity_rollouts": 10 * n,
        "kl_max": 1e12,
        "kl_flush": 1e12,
    }
    body = json.dumps({"run_id": run, "config": config}).encode()
    conn.call("POST", "/v1/runs", body, **JSON_BODY)
    for c in consumers:
        conn.call("POST", f"/v1/runs/{run}/consumers", json.dumps(c).encode(), **JSON_BODY)
    post_rollouts(conn, run, n, tokens)


def lease_ack(conn: Conn, base: str, size: int) -> float:
    """Seconds of one lease of ``size`` (msgpack answer) and its ack."""
    t0 = time.perf_counter()
    got = conn.call("GET", f"{base}/batch?size={size}", accept=MSGPACK)
    items = got.get("rollouts") or got.get("pairs") or []
    assert len(items) == size, (base, len(items))
    conn.call("POST", f"{base}/batches/{got['batch_id']}/ack", b"{}", **JSON_BODY)
    return time.perf_counter() - t0


def script_us(rc: redis.Redis, runs: dict[str, str]) -> dict[str, float]:
    """Per row, the median µs Redis spent in one lease script plus one ack script of its run
    (of its consumer, for the reader's row), from SLOWLOG."""
    names = ("lease", "ack", "consumer_lease", "consumer_ack")
    of = {LIBRARY.functions[n].encode(): n for n in names}
    spent: dict[tuple[str, str], list[float]] = {}
    for entry in rc.slowlog_get(1_000_000):
        args = entry["command"].split()
        if len(args) < 4 or args[0] != b"FCALL" or args[1] not in of:
            continue
        name = of[args[1]]
        for row, run in runs.items():
            consumer = name.startswith("consumer")
            if f"{{{run}}}".encode() in args[3] and consumer == (row == "consumer reader"):
                spent.setdefault((row, name.removeprefix("consumer_")), []).append(
                    float(entry["duration"])
                )
    return {
        row: statistics.median(spent[(row, "lease")]) + statistics.median(spent[(row, "ack")])
        for row in runs
        if (row, "lease") in spent and (row, "ack") in spent
    }


def run_rounds(
    server: Server, rc: redis.Redis, rounds: int, batch: int, tokens: int
) -> dict[str, tuple[float, float]]:
    conn = Conn(server)
    n = (rounds + 1) * batch
    tag = uuid.uuid4().hex[:6]
    rollouts = {"name": "t0", "source": "trained"}
    pairs = {"name": "p0", "source": "trained", "kind": "preferences"}
    setups = {
        "no consumers": [],
        "1 consumer (rollouts)": [rollouts],
        "3 consumers (2 rollouts, 1 best_worst pairs)": [
            rollouts,
            {**rollouts, "name": "t1"},
            pairs,
        ],
        "1 consumer (all pairs)": [{**pairs, "pairs": "all"}],
    }
    runs = {}
    for i, (name, consumers) in enumerate(setups.items()):
        runs[name] = f"c{i}-{tag}"
        make_run(conn, runs[name], consumers, n, tokens)
    reader = f"rd-{tag}"
    make_run(conn, reader, [{"name": "rm", "source": "received"}], n, tokens)
    calls = {
        f"trainer, {name}": functools.partial(lease_ack, conn, f"/v1/runs/{run}", batch)
        for name, run in runs.items()
    }
    calls["trainer, beside a reader"] = functools.partial(
        lease_ack, conn, f"/v1/runs/{reader}", batch
    )
    calls["consumer reader"] = functools.partial(
        lease_ack, conn, f"/v1/runs/{reader}/consumers/rm", batch
    )
    rows = {f"trainer, {name}": run for name, run in runs.items()}
    rows |= {"trainer, beside a reader": reader, "consumer reader": reader}
    return timed_with_scripts(rc, rounds, calls, rows)


def timed_with_scripts(
    rc: redis.Redis, rounds: int, calls: dict[str, Callable[[], float]], runs: dict[str, str]
) -> dict[str, tuple[float, float]]:
    """Per call: its median seconds over ``rounds`` rounds taking turns (:func:`timed_rounds`),
    and the median µs Redis spent in the lease and ack scripts of its run (``runs``, by the
    call's name; :func:`script_us`)."""
    with every_command_logged(rc):
        times = timed_rounds(rc, rounds, calls)
        redis_us = script_us(rc, runs)
    return {name: (statistics.median(v), redis_us[name]) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = turn_args("python -m benchmarks.consumers", __doc__, argv)
    with served(args, "consumers") as (server, rc):
        rows = run_rounds(server, rc, args.rounds, args.batch, args.tokens)
    print(
        f"lease + ack of {args.batch} × {args.tokens:,}-token rollouts over HTTP (msgpack), "
        f"median of {args.rounds} rounds"
    )
    print("| call | latency | items/s | ratio | Redis: lease + ack scripts | ratio |")
    print("|---|---|---|---|---|---|")
    for name, (sec, us) in rows.items():
        base = "trainer, beside a reader" if name == "consumer reader" else "trainer, no consumers"
        b_sec, b_us = rows[base]
        print(
            f"| {name} | {sec * 1e3:,.1f} ms | {args.batch / sec:,.0f} | ×{sec / b_sec:.2f} "
            f"| {us:,.0f} µs | ×{us / b_us:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
