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
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from app import keys
from benchmarks.harness import FULL, QUICK, ROOT, Bench, Row, Sizes, delete_keys
from benchmarks.payloads import ID_LEN, RAW_BYTES, TOKENS
from benchmarks.report import machine, summary, table
from benchmarks.sections.auth import auth_rows
from benchmarks.sections.bodies import body_rows
from benchmarks.sections.cluster import cluster_rows
from benchmarks.sections.drain import drain_rows
from benchmarks.sections.ingest import ingest_rows
from benchmarks.sections.lease import lease_rows
from benchmarks.sections.long import long_rows
from benchmarks.sections.memory import memory_rows
from benchmarks.sections.metrics import metrics_rows
from benchmarks.sections.replicas import replicas_rows
from benchmarks.sections.scaling import scaling_rows
from benchmarks.sections.tokens import tokens_rows
from benchmarks.sections.work import work_rows
from benchmarks.sections.workers import workers_rows
from benchmarks.servers import PG_URL, CpuMeter, redis_server, uvicorn_server

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
    "replicas": replicas_rows,
    "tokens": tokens_rows,
}


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
