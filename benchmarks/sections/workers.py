"""``--only workers``: ``serve --workers 2`` against ``--workers 1``."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from app import keys
from benchmarks import load
from benchmarks.harness import BIG, Bench, Row, best_rate, delete_keys
from benchmarks.load import Group, run_group
from benchmarks.payloads import TOKENS
from benchmarks.servers import Server, postgres_database

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
