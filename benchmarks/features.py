"""What the features cost the plain trainer path: ``python -m benchmarks.features`` (about a
minute; ``--rounds 3 --tokens 16`` for a quick look).

A private Redis and the broker (uvicorn, the real API process) on 127.0.0.1. Runs of groups of
8 hold the same 1,024-token rollouts (msgpack, raw arrays, rewards 0 to 6 in a group, the run at
policy version 1, ``max_reuse`` 1), posted before anything is timed, and differ in one feature:
- **plain**: nothing more;
- **loss masks**: every rollout has a ``loss_mask`` whose last quarter is 0 (a tool turn);
- **per-token versions**: every rollout was sampled across a weight update, ``policy_version``
  0 and ``versions`` ``[[0, 0], [512, 1]]``;
- **rewards pending**: as many rollouts again, of other groups, posted without rewards and
  waiting for a verifier while the trainer leases the scored ones;
- **a consumer**: one consumer of kind ``rollouts``, source ``trained``
  (``python -m benchmarks.consumers`` has more of them).

Each round takes turns between the runs: a lease of ``--batch`` rollouts and its ack with the
trainer's logprobs of every rollout (so the ack measures them: what masks change), timed
together. Each row is the median of ``--rounds`` rounds and the median time Redis spent in the
lease and ack scripts (SLOWLOG, every command logged), each with its ratio to the plain run of
the same run: a feature meets the target when both are at most 1.03.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any

import msgpack
import numpy as np
import redis

from benchmarks.consumers import GROUP, JSON_BODY, timed_with_scripts
from benchmarks.measure_http import (
    MSGPACK,
    Conn,
    served,
    turn_args,
)
from benchmarks.servers import Server

NEED = 1.03  # the most a feature may cost the plain path


def setups(tokens: int) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]], bool]]:
    """Per row: what each rollout adds, the run's consumers, and whether as many rollouts wait
    for rewards beside the scored ones."""
    mask = np.ones(tokens, np.uint8)
    mask[3 * tokens // 4 :] = 0
    half = max(tokens // 2, 1)
    return {
        "plain": ({}, [], False),
        "loss masks": ({"loss_mask": mask.tobytes()}, [], False),
        "per-token versions": ({"policy_version": 0, "versions": [[0, 0], [half, 1]]}, [], False),
        "rewards pending": ({}, [], True),
        "a consumer": ({}, [{"name": "t0", "source": "trained"}], False),
    }


def post(conn: Conn, run: str, docs: list[dict[str, Any]]) -> None:
    for start in range(0, len(docs), 64):
        body = msgpack.packb({"rollouts": docs[start : start + 64]}, use_bin_type=True)
        conn.call("POST", f"/v1/runs/{run}/rollouts", body, **{"content-type": MSGPACK})


def make_run(conn: Conn, run: str, setup: tuple[Any, ...], n: int, tokens: int) -> bytes:
    """The run of one setup, filled; returns the logprobs the trainer acks with (raw float32)."""
    extra, consumers, pending = setup
    config = {"max_reuse": 1, "group_size": GROUP, "capacity_rollouts": 10 * n,
              "max_staleness": 4, "kl_max": 1e12, "kl_flush": 1e12}  # fmt: skip
    conn.call(
        "POST", "/v1/runs", json.dumps({"run_id": run, "config": config}).encode(), **JSON_BODY
    )
    conn.call("POST", f"/v1/runs/{run}/policy", b'{"version": 1}', **JSON_BODY)
    for c in consumers:
        conn.call("POST", f"/v1/runs/{run}/consumers", json.dumps(c).encode(), **JSON_BODY)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, tokens).astype("<i4").tobytes()
    lps = (-rng.exponential(1.0, tokens)).astype("<f4")

    def doc(i: int, reward: float | None, group: str) -> dict[str, Any]:
        return {"rollout_id": f"{group}{i}", "policy_version": 1, "response_ids": ids,
                "logprobs": lps.tobytes(), "reward": reward, "group_id": f"{group}{i // GROUP}",
                **extra}  # fmt: skip

    post(conn, run, [doc(i, float(i % 7), "x") for i in range(n)])
    if pending:
        post(conn, run, [doc(i, None, "u") for i in range(n)])
    return (lps - np.float32(0.01)).tobytes()  # the policy moved a little


def lease_ack(conn: Conn, run: str, size: int, new_lps: bytes) -> float:
    """Seconds of one lease of ``size`` (msgpack answer) and its ack with every rollout's
    logprobs."""
    t0 = time.perf_counter()
    got = conn.call("GET", f"/v1/runs/{run}/batch?size={size}", accept=MSGPACK)
    assert len(got["rollouts"]) == size, (run, len(got["rollouts"]))
    body = msgpack.packb(
        {"logprobs": {r["rollout_id"]: new_lps for r in got["rollouts"]}}, use_bin_type=True
    )
    path = f"/v1/runs/{run}/batches/{got['batch_id']}/ack"
    conn.call("POST", path, body, **{"content-type": MSGPACK})
    return time.perf_counter() - t0


def run_rounds(
    server: Server, rc: redis.Redis, rounds: int, batch: int, tokens: int
) -> dict[str, tuple[float, float]]:
    conn = Conn(server)
    n = (rounds + 1) * batch
    tag = uuid.uuid4().hex[:6]
    runs, acks = {}, {}
    for i, (name, setup) in enumerate(setups(tokens).items()):
        runs[name] = f"f{i}-{tag}"
        acks[name] = make_run(conn, runs[name], setup, n, tokens)
    calls = {
        name: functools.partial(lease_ack, conn, run, batch, acks[name])
        for name, run in runs.items()
    }
    return timed_with_scripts(rc, rounds, calls, runs)


def main(argv: list[str] | None = None) -> int:
    args = turn_args("python -m benchmarks.features", __doc__, argv)
    with served(args, "features") as (server, rc):
        rows = run_rounds(server, rc, args.rounds, args.batch, args.tokens)
    print(
        f"lease + ack (with logprobs) of {args.batch} × {args.tokens:,}-token rollouts over HTTP "
        f"(msgpack), median of {args.rounds} rounds; target ≤{NEED:g}× plain"
    )
    print("| run | latency | ratio | Redis: lease + ack scripts | ratio | target |")
    print("|---|---|---|---|---|---|")
    b_sec, b_us = rows["plain"]
    for name, (sec, us) in rows.items():
        worst = max(sec / b_sec, us / b_us)  # what the trainer waits, and what Redis spends
        verdict = "" if name == "plain" else ("PASS" if worst <= NEED else "MISS")
        print(
            f"| {name} | {sec * 1e3:,.1f} ms | ×{sec / b_sec:.2f} | {us:,.0f} µs | "
            f"×{us / b_us:.2f} | {verdict} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
