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
from collections import Counter
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from rollout_broker_client import AsyncBrokerClient, Rollout

from app.accounting.events import Acked, Leased, Retired, Returned, decode_entry
from app.broker import keys
from tests.processes import (
    ApiProcess,
    RedisClusterServers,
    RedisServer,
    broker_env,
    worker_process,
)

pytestmark = pytest.mark.slow

PREFIX = "chaos"
RUN = "chaos-run"
GROUP = 2
MIN_PER_GENERATOR = 200  # rollouts; generators go on until the last kill is behind them
AUDIT = "audit"  # the consumer group that never reads


def group_of(generator: int, g: int, rng: np.random.Generator) -> list[Rollout]:
    gid = f"g{generator}-{g}"
    out = []
    for k in range(GROUP):
        n = int(rng.integers(2, 12))
        out.append(
            Rollout(
                rollout_id=f"{gid}-{k}",
                group_id=gid,
                policy_version=0,
                response_ids=rng.integers(0, 32_000, size=n),
                logprobs=-rng.random(n).astype(np.float32),
                reward=float(k),
            )
        )
    return out


class ChaosRedis:
    """The test's own Redis: one node, or a 3-master cluster of which the node serving the
    run's slot is the one killed. Both append to an AOF with fsync always."""

    def __init__(self, backend: str, data_dir: Path) -> None:
        self.node = RedisServer(data_dir) if backend == "redis" else None
        self.cluster = None if self.node else RedisClusterServers(data_dir, aof=True)
        self.url = self.node.url if self.node else self.cluster.seeds  # type: ignore[union-attr]

    def env(self) -> dict[str, str]:
        return {"BROKER_REDIS_URL": self.url, "BROKER_REDIS_CLUSTER": str(int(not self.node))}

    def client(self) -> Redis:
        if self.cluster is None:
            return Redis.from_url(self.url)
        return cast(Redis, RedisCluster.from_url(self.cluster.url))

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
    env = broker_env(
        **redis_server.env(),
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=PREFIX,
        BROKER_SWEEP_INTERVAL_S="0.2",
        BROKER_DRAIN_BLOCK_MS="50",
        BROKER_WAKE_FALLBACK_S="0.5",
    )
    apis = [ApiProcess(env, tmp_path / f"api{i}.log") for i in range(2)]
    worker = worker_process(env, tmp_path / "worker.log")
    redis = redis_server.client()
    clients: list[AsyncBrokerClient] = []
    try:
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        clients = [AsyncBrokerClient(a.url) for a in apis]
        await clients[0].create_run(
            RUN, {"group_size": GROUP, "max_staleness": 1000, "lease_timeout_s": 60}
        )
        await redis.xgroup_create(keys.events_key(PREFIX, RUN), AUDIT, id="0", mkstream=True)

        sent: dict[str, int] = {}  # rollout_id -> tokens, of every rollout a generator sent
        acked: list[int] = []  # sizes of the batches the trainers were told are acknowledged
        calm = asyncio.Event()  # the last kill is behind us
        generating = 2

        async def generate(i: int) -> None:
            nonlocal generating
            rng = np.random.default_rng(i)
            g = 0
            async with clients[i].writer(RUN, batch_size=2 * GROUP) as writer:
                while not calm.is_set() or g * GROUP < MIN_PER_GENERATOR:
                    for r in group_of(i, g, rng):
                        sent[r.rollout_id] = len(r.response_ids)  # type: ignore[arg-type]
                        await writer.add(r)
                    g += 1
                    await asyncio.sleep(0.01)  # traffic goes on through every kill
            generating -= 1

        async def train(i: int) -> None:
            while generating or sum(acked) < len(sent):
                batch = await clients[i].lease_batch(RUN, 4 * GROUP, wait_s=0.5, partial=True)
                if batch is None:
                    continue
                result = await clients[i].ack(RUN, batch.batch_id)
                acked.append(result.consumed)

        async def progressed(rollouts: int) -> None:
            while sum(acked) < rollouts:  # noqa: ASYNC110 - the trainers make progress
                await asyncio.sleep(0.02)

        async def chaos() -> None:
            await progressed(40)
            await worker.kill()
            await worker.start()
            await progressed(80)
            await apis[0].kill()
            await apis[0].start()
            await progressed(120)
            await redis_server.kill_and_restart()
            await progressed(160)
            await worker.kill()
            await worker.start()
            await progressed(200)
            calm.set()

        await asyncio.wait_for(
            asyncio.gather(generate(0), generate(1), train(0), train(1), chaos()), 150
        )
        total = len(sent)
        acc = await clients[1].wait_for_accounting(RUN, timeout_s=60)

        # -- the whole event stream, replayed ---------------------------------------------
        await redis.aclose()  # its connections died with the server it talked to
        redis = redis_server.client()
        entries = await redis.xrange(keys.events_key(PREFIX, RUN))
        events = [decode_entry(RUN, eid, fields) for eid, fields in entries]
        accepted: Counter[str] = Counter()
        uses: Counter[str] = Counter()
        live_lease: dict[str, str] = {}  # rollout_id -> batch holding it
        double_leases = 0
        for e in events:
            body = e.body
            if e.type == "accepted":
                accepted.update(i.rollout_id for i in body.items)  # type: ignore[union-attr]
            elif isinstance(body, Leased):
                for item in body.items:
                    if item.rollout_id in live_lease:
                        double_leases += 1
                    live_lease[item.rollout_id] = body.batch_id
            elif isinstance(body, Acked):
                for a in body.items:
                    uses[a.rollout_id] += 1
                    live_lease.pop(a.rollout_id, None)
            elif isinstance(body, Returned):
                for r in body.items:
                    live_lease.pop(r.rollout_id, None)
            elif isinstance(body, Retired):
                for t in body.items:
                    live_lease.pop(t.rollout_id, None)
        lost = set(sent) - set(accepted)
        print(
            f"chaos: {len(sent)} rollouts sent, {sum(accepted.values())} accepted, "
            f"{len(lost)} lost, {double_leases} double leases, {len(acked)} batches acked, "
            f"{len(entries)} events; kills: worker {worker.kills}, api {apis[0].kills}, redis 1"
        )
        assert total >= 2 * MIN_PER_GENERATOR
        assert not lost
        assert set(accepted.values()) == {1}  # accepted once, whatever was retried
        assert double_leases == 0
        assert uses == Counter(dict.fromkeys(sent, 1))  # each used exactly once (max_reuse 1)

        # -- ledger == live == what the clients were told ------------------------------------
        assert acc.rollouts_received == total
        assert acc.samples_consumed == sum(acked) == total
        assert acc.tokens_generated == sum(sent.values())
        assert acc.buffered == acc.leased == 0
        assert acc.live is not None and (acc.live.buffered, acc.live.leased) == (0, 0)
        assert acc.dead_letters == 0
        assert acc.batches.acked == len(acked)
    finally:
        for c in clients:
            await c.close()
        await asyncio.gather(*(a.stop() for a in apis), worker.stop(), return_exceptions=True)
        await redis.aclose()
        await redis_server.stop()
