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
from rollout_broker_client import AsyncBrokerClient

from app import keys
from app.events import decode_entry
from tests.processes import KillableRedis
from tests.traffic import GROUP, Replay, Traffic, brokers

pytestmark = pytest.mark.slow

PREFIX = "chaos"
RUN = "chaos-run"
MIN_PER_GENERATOR = 200  # rollouts; generators go on until the last kill is behind them
AUDIT = "audit"  # the consumer group that never reads


async def test_nothing_lost_or_doubled_through_worker_replica_and_redis_kills(
    backend: str, database_url: str, tmp_path: Path
) -> None:
    redis_server = KillableRedis(backend, tmp_path, keys.run_key(PREFIX, RUN))
    await redis_server.start()
    apis, worker = brokers(redis_server.backend.env(), database_url, PREFIX, tmp_path)
    redis = redis_server.backend.client()
    clients: list[AsyncBrokerClient] = []
    try:
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        clients = [AsyncBrokerClient(a.url) for a in apis]
        # Before the run exists: a drain that read, applied and trimmed its first events before
        # this group was made would leave them out of the replay.
        await redis.xgroup_create(keys.events_key(PREFIX, RUN), AUDIT, id="0", mkstream=True)
        await clients[0].create_run(
            RUN, {"group_size": GROUP, "max_staleness": 1000, "lease_timeout_s": 60}
        )

        traffic = Traffic(clients, RUN, MIN_PER_GENERATOR, pause_s=0.01)

        async def chaos() -> None:
            await traffic.progressed(40)
            await worker.kill()
            await worker.start()
            await traffic.progressed(80)
            await apis[0].kill()
            await apis[0].start()
            await traffic.progressed(120)
            await redis_server.kill_run_node()
            await redis_server.restart_run_node()
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
