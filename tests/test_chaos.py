"""Chaos: generators and trainers run through the Python client against two API processes and
a worker, over a Redis of the test's own (AOF, fsync always), while the worker is SIGKILLed
twice, an API process once and Redis itself once, each started again. On the cluster backend
Redis is a 3-master cluster and the node killed is the one serving the run's slot.

An extra consumer group that never reads keeps the whole event stream (the drain trims only
what every group has read), and the test replays it: no rollout the clients were told was
accepted is missing, none was in two live leases at once, each was used exactly once, and the
ledger, the live state in Redis and what the clients were told all agree."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis import Redis as SyncRedis
from redis.crc import key_slot
from rollout_broker_client import AsyncBrokerClient

from app.accounting.events import decode_entry
from app.broker import keys
from tests.processes import (
    RedisClusterServers,
    RedisServer,
)
from tests.services import RedisBackend
from tests.traffic import GROUP, Replay, Traffic, brokers

pytestmark = pytest.mark.slow

PREFIX = "chaos"
RUN = "chaos-run"
MIN_PER_GENERATOR = 200  # rollouts; generators go on until the last kill is behind them
AUDIT = "audit"  # the consumer group that never reads


class ChaosRedis:
    """The test's own Redis: one node, or a 3-master cluster of which the node serving the
    run's slot is the one killed. Both append to an AOF with fsync always."""

    def __init__(self, backend: str, data_dir: Path) -> None:
        self.node = RedisServer(data_dir) if backend == "redis" else None
        self.cluster = None if self.node else RedisClusterServers(data_dir, aof=True)
        url = self.node.url if self.node else self.cluster.seeds  # type: ignore[union-attr]
        self.backend = RedisBackend(url, cluster=self.node is None)

    async def start(self) -> None:
        if self.node:
            await self.node.start()
        else:
            await asyncio.to_thread(self.cluster.start)  # type: ignore[union-attr]

    def _run_node(self) -> int:
        assert self.cluster is not None
        slot = key_slot(keys.run_key(PREFIX, RUN).encode())
        with SyncRedis(port=self.cluster.ports[0]) as probe:
            for first, last, (_, port, *_), *_ in probe.execute_command("CLUSTER SLOTS"):
                if first <= slot <= last:
                    return int(port)
        raise AssertionError(f"no node serves slot {slot}")

    async def kill_and_restart(self) -> None:
        if self.node:
            await self.node.kill()
            await self.node.start()
            return
        port = self._run_node()
        self.cluster.kill_node(port)  # type: ignore[union-attr]
        await asyncio.to_thread(self.cluster.start_node, port)  # type: ignore[union-attr]
        await asyncio.to_thread(self.cluster.wait_ok)  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.node:
            await self.node.kill()
        else:
            self.cluster.kill()  # type: ignore[union-attr]


async def test_nothing_lost_or_doubled_through_worker_replica_and_redis_kills(
    backend: str, database_url: str, tmp_path: Path
) -> None:
    redis_server = ChaosRedis(backend, tmp_path)
    await redis_server.start()
    apis, worker = brokers(redis_server.backend.env(), database_url, PREFIX, tmp_path)
    redis = redis_server.backend.client()
    clients: list[AsyncBrokerClient] = []
    try:
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        clients = [AsyncBrokerClient(a.url) for a in apis]
        await clients[0].create_run(
            RUN, {"group_size": GROUP, "max_staleness": 1000, "lease_timeout_s": 60}
        )
        await redis.xgroup_create(keys.events_key(PREFIX, RUN), AUDIT, id="0", mkstream=True)

        traffic = Traffic(clients, RUN, MIN_PER_GENERATOR, pause_s=0.01)

        async def chaos() -> None:
            await traffic.progressed(40)
            await worker.kill()
            await worker.start()
            await traffic.progressed(80)
            await apis[0].kill()
            await apis[0].start()
            await traffic.progressed(120)
            await redis_server.kill_and_restart()
            await traffic.progressed(160)
            await worker.kill()
            await worker.start()
            await traffic.progressed(200)
            traffic.calm.set()

        await traffic.run(chaos(), 150)
        acc = await clients[1].wait_for_accounting(RUN, timeout_s=60)

        # -- the whole event stream, replayed ---------------------------------------------
        await redis.aclose()  # its connections died with the server it talked to
        redis = redis_server.backend.client()
        entries = await redis.xrange(keys.events_key(PREFIX, RUN))
        replay = Replay([decode_entry(RUN, eid, fields) for eid, fields in entries])
        print(
            f"chaos: {traffic.summary(replay)}, {len(entries)} events; kills: worker "
            f"{worker.kills}, api {apis[0].kills}, redis 1"
        )
        traffic.check(replay, acc)
    finally:
        for c in clients:
            await c.close()
        await asyncio.gather(*(a.stop() for a in apis), worker.stop(), return_exceptions=True)
        await redis.aclose()
        await redis_server.stop()
