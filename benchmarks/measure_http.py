"""``measure`` over HTTP beside the ack of the same batch: ``python -m benchmarks.measure_http``.

A private Redis and the broker (uvicorn, the real API process) on 127.0.0.1; one run holding
256 rollouts of 1,024 tokens (float32 behaviour logprobs, a generator_id each, so the ack also
sums per generator), reusable without limit. Each round leases the whole batch twice (a
lease is not timed) and takes turns between the calls timed:

- ``ack``: an ack carrying the trainer's logprobs (msgpack, float32 bytes): the baseline;
- ``measure``: a measure with the same logprobs (msgpack in, msgpack weights out);
- ``ack after measure``: the ack of that batch, with no logprobs (the kept ones are used).

Each row is the median latency of ``--rounds`` calls, seen by a keep-alive ``http.client``
connection with pre-encoded bodies, and the API process's mean CPU time per call (all its
threads, from /proc/<pid>/task/*/schedstat: nanoseconds, not clock ticks); the ratios are
against the ack in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

from app import keys
from benchmarks.harness import delete_keys
from benchmarks.servers import HOST, Server, redis_server, uvicorn_server

ROOT = Path(__file__).resolve().parents[1]
MSGPACK = "application/msgpack"


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of a live process."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


class Conn:
    """One keep-alive connection to the broker."""

    def __init__(self, server: Server) -> None:
        self.c = http.client.HTTPConnection(HOST, server.port, timeout=120)

    def call(self, method: str, path: str, body: bytes | None = None, **headers: str) -> Any:
        self.c.request(method, path, body=body, headers=headers)
        resp = self.c.getresponse()
        data = resp.read()
        if resp.status // 100 != 2:
            raise RuntimeError(f"{method} {path}: {resp.status} {data[:300]!r}")
        if resp.getheader("content-type", "").startswith(MSGPACK):
            return msgpack.unpackb(data, raw=False)
        return json.loads(data)


def _ingest(
    conn: Conn, run: str, rollouts: int, tokens: int, generators: bool
) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    old: dict[str, np.ndarray[Any, Any]] = {}
    for start in range(0, rollouts, 64):
        docs = []
        for i in range(start, min(rollouts, start + 64)):
            rid = f"x{i}"
            old[rid] = -rng.exponential(1.0, tokens).astype("<f4")
            docs.append(
                {
                    "rollout_id": rid,
                    "policy_version": 0,
                    "response_ids": rng.integers(0, 50_000, tokens).astype("<i4").tobytes(),
                    "logprobs": old[rid].tobytes(),
                    "reward": 1.0,
                    **({"generator_id": f"gen-{i % 4}"} if generators else {}),
                }
            )
        body = msgpack.packb({"rollouts": docs}, use_bin_type=True)
        conn.c.request(
            "POST", f"/v1/runs/{run}/rollouts", body=body, headers={"content-type": MSGPACK}
        )
        resp = conn.c.getresponse()
        assert resp.status == 202, resp.read()
        resp.read()
    return old


def run_rounds(server: Server, rollouts: int, tokens: int, rounds: int) -> dict[str, Any]:
    conn = Conn(server)
    run, plain = f"m{uuid.uuid4().hex[:8]}", f"p{uuid.uuid4().hex[:8]}"
    config = {"max_reuse": 10_000, "kl_max": 1e12, "kl_flush": 1e12, "capacity_rollouts": 10_000}
    for r in (run, plain):
        conn.call(
            "POST",
            "/v1/runs",
            json.dumps({"run_id": r, "config": config}).encode(),
            **{"content-type": "application/json"},
        )
    old = _ingest(conn, run, rollouts, tokens, True)
    _ingest(conn, plain, rollouts, tokens, False)  # the same rollouts, without generator_id
    rng = np.random.default_rng(1)
    new = {
        rid: np.minimum(o + rng.normal(0, 0.05, o.size), 0).astype("<f4") for rid, o in old.items()
    }
    body = msgpack.packb({"logprobs": {r: v.tobytes() for r, v in new.items()}}, use_bin_type=True)
    send = {"content-type": MSGPACK, "accept": MSGPACK}
    times: dict[str, list[float]] = {
        "ack": [],
        "ack, no generator_id": [],
        "measure": [],
        "ack after measure": [],
    }
    cpu: dict[str, int] = dict.fromkeys(times, 0)

    def timed(name: str, path: str, content: bytes, counted: bool) -> Any:
        c0, t0 = cpu_ns(server.pid), time.perf_counter()
        got = conn.call("POST", path, content, **send)
        t1, c1 = time.perf_counter(), cpu_ns(server.pid)
        if counted:
            times[name].append(t1 - t0)
            cpu[name] += c1 - c0
        assert got["stats"]["kl_mean"] is not None, (name, got["stats"])  # measured
        return got

    def lease(r: str) -> str:
        got = conn.call("GET", f"/v1/runs/{r}/batch?size={rollouts}", accept=MSGPACK)
        return f"/v1/runs/{r}/batches/{got['batch_id']}"

    for round_ in range(rounds + 1):  # a first round to warm up, not counted
        counted = round_ > 0
        timed("ack", f"{lease(run)}/ack", body, counted)
        timed("ack, no generator_id", f"{lease(plain)}/ack", body, counted)
        b = lease(run)
        timed("measure", f"{b}/measure", body, counted)
        timed("ack after measure", f"{b}/ack", msgpack.packb({}), counted)
    n = max(1, rounds)
    return {k: (statistics.median(v) * 1e3, cpu[k] / n / 1e6) for k, v in times.items() if v}


@contextlib.contextmanager
def services(
    work: Path, redis_url: str | None, app_dir: Path
) -> Iterator[tuple[Server, redis.Redis]]:
    """The broker on a private Redis (or ``redis_url``), and a client of that Redis."""
    with redis_server(work, redis_url) as rt:
        prefix = f"rbmeasure{uuid.uuid4().hex[:8]}"
        env = {"BROKER_REDIS_URL": rt.url, "BROKER_REDIS_PREFIX": prefix}
        rc = rt.client()
        try:
            with uvicorn_server(
                "broker", "app.main:create_app", cwd=app_dir, workdir=work, env=env, factory=True
            ) as server:
                yield server, rc
        finally:
            delete_keys(rc, list(rc.scan_iter(match=keys.every_key(prefix), count=2000)))
            rc.close()


def turn_args(prog: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The command line of a benchmark that takes turns between runs: rounds, batch, tokens,
    and where its Redis and broker tree are."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    p.add_argument("--app-dir", default=str(ROOT), help="the broker source tree to benchmark")
    return p.parse_args(argv)


@contextlib.contextmanager
def served(args: argparse.Namespace, name: str) -> Iterator[tuple[Server, redis.Redis]]:
    """:func:`services` for ``args`` of :func:`turn_args`, in a temporary folder."""
    with (
        tempfile.TemporaryDirectory(prefix=f"rb-{name}-") as tmp,
        services(Path(tmp), args.redis_url, Path(args.app_dir).resolve()) as got,
    ):
        yield got


@contextlib.contextmanager
def every_command_logged(rc: redis.Redis) -> Iterator[None]:
    """Redis's SLOWLOG keeps every command meanwhile (read it before the block ends: its usual
    length is set back then)."""
    rc.config_set("slowlog-log-slower-than", 0)
    rc.config_set("slowlog-max-len", 1_000_000)
    try:
        yield
    finally:
        rc.config_set("slowlog-log-slower-than", 10_000)
        rc.config_set("slowlog-max-len", 128)


def timed_rounds(
    rc: redis.Redis, rounds: int, calls: dict[str, Callable[[], float]]
) -> dict[str, list[float]]:
    """The seconds each call reports in ``rounds`` rounds taking turns, after a first round to
    warm up, which is neither counted nor left in SLOWLOG."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 1):
        if round_ == 1:
            rc.slowlog_reset()
        for name, call in calls.items():
            took = call()
            if round_:
                times[name].append(took)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.measure_http", description=__doc__)
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    p.add_argument("--app-dir", default=str(ROOT), help="the broker source tree to benchmark")
    args = p.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="rb-measure-") as tmp,
        services(Path(tmp), args.redis_url, Path(args.app_dir).resolve()) as (server, _),
    ):
        rows = run_rounds(server, args.rollouts, args.tokens, args.rounds)
    print(
        f"{args.rollouts} rollouts × {args.tokens:,} tokens over HTTP (msgpack), "
        f"median latency and mean API CPU of {args.rounds} rounds"
    )
    print("| call | latency | ×ack | API CPU per call | ×ack |")
    print("|---|---|---|---|---|")
    base_ms, base_cpu = rows["ack"]
    for name, (ms, cpu_ms) in rows.items():
        print(
            f"| {name} | {ms:,.1f} ms | ×{ms / base_ms:.2f} | {cpu_ms:,.1f} ms "
            f"| ×{cpu_ms / base_cpu:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
