"""``--only replicas``: throughput with ``BROKER_REDIS_WAIT_REPLICAS=1`` against 0 (see
:mod:`benchmarks.pairs`), on the run's private Redis with one replica of its own attached for the
section: what it costs that every answer waits for the replica to acknowledge its write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import redis.asyncio

from app.accounting.consumers import ConsumerGroup
from benchmarks.harness import Bench, Row
from benchmarks.load import Http, expect
from benchmarks.pairs import Toggle, paired_rows
from benchmarks.servers import HOST, Server, find_redis_server, free_port, wait_ping

REPLICAS_NEED = 0.8  # waiting for one replica on this machine may cost at most 20 % of the rate
WAIT_TIMEOUT_MS = 1000

REPLICAS_TOGGLE = Toggle(
    "replicas",
    "Waiting for a replica (BROKER_REDIS_WAIT_REPLICAS)",
    "BROKER_REDIS_WAIT_REPLICAS",
    REPLICAS_NEED,
    {
        "off": {"BROKER_REDIS_WAIT_REPLICAS": "0"},
        "on": {
            "BROKER_REDIS_WAIT_REPLICAS": "1",
            "BROKER_REDIS_WAIT_TIMEOUT_MS": str(WAIT_TIMEOUT_MS),
        },
    },
    "every answer after WAIT 1 (one replica, same machine)",
)


@contextlib.contextmanager
def replica_of(master_url: str, workdir: Path) -> Iterator[None]:
    """A redis-server replicating ``master_url``, in sync when the block starts, stopped after."""
    binary = find_redis_server()
    assert binary is not None  # the run's private Redis came from it
    port = free_port()
    master = redis.Redis.from_url(master_url)
    where = master.connection_pool.connection_kwargs
    log_path = workdir / "redis-replica.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                *("--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"),
                *("--dir", str(workdir), "--replicaof", str(where["host"]), str(where["port"])),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_ping(redis.Redis(host=HOST, port=port), proc, log_path)
            deadline = time.monotonic() + 30
            master.set("bench:replica:attached", 1)
            while master.execute_command("WAIT", 1, 1000) < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the replica did not attach: see {log_path}")
            yield
        finally:
            master.delete("bench:replica:attached")
            master.close()
            proc.terminate()
            proc.wait(10)


async def _drain_heartbeat(url: str, prefix: str) -> None:
    """A drain consumer's heartbeat, as a worker sends it: the pair runs none, and /readyz
    answers 503 without one."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        await ConsumerGroup(client, prefix).beat("bench-drain")
    finally:
        await client.aclose()


def check_waits(b: Bench, servers: dict[str, Server]) -> None:
    """The setting is on where it should be: /readyz of ``on`` counts the master's replicas."""
    asyncio.run(_drain_heartbeat(b.redis.url, b.prefix))
    for side, want in (("on", True), ("off", False)):
        http = Http(servers[side].address)
        status, data, _ = http.call("GET", "/readyz")
        http.close()
        expect(status, data, 200)
        assert ("replicas" in json.loads(data)["checks"]) is want, (side, data)


def replicas_rows(b: Bench) -> list[Row]:
    """Ingest and lease + ack with the setting off and on, both against the master that has
    the replica; on a shared Redis (no private redis-server) the section is skipped."""
    if not b.redis.private:
        b.say("replicas: skipped (needs a private redis-server to attach a replica to)")
        return []

    def prepare(servers: dict[str, Server]) -> dict[str, str | None]:
        check_waits(b, servers)
        return {"off": None, "on": None}

    with replica_of(b.redis.url, b.workdir or Path(tempfile.gettempdir())):
        return paired_rows(b, REPLICAS_TOGGLE, prepare, lambda _: contextlib.nullcontext())
