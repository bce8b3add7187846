"""The broker's Redis client on a cluster: built from ``BROKER_REDIS_CLUSTER`` and a URL naming
any node, or several of which some may be down."""

from __future__ import annotations

from redis.asyncio.cluster import RedisCluster

from app.settings import Settings
from app.wiring import redis_client
from tests.processes import free_port
from tests.services import new_prefix


async def test_a_cluster_url_gives_a_cluster_client_that_reaches_every_slot(
    cluster_url: str,
) -> None:
    client = redis_client(Settings(redis_url=cluster_url, redis_cluster=True))
    assert isinstance(client, RedisCluster)
    prefix = new_prefix()
    names = [f"{prefix}:{{run-{i}}}:run" for i in range(12)]  # slots on every master
    try:
        for name in names:
            await client.set(name, name)
        assert [await client.get(n) for n in names] == [n.encode() for n in names]
        owners = {client.get_node_from_key(n).name for n in names}
        assert len(owners) == 3
    finally:
        for name in names:
            await client.delete(name)
        await client.aclose()


async def test_several_seed_nodes_start_from_the_first_that_answers(cluster_url: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    url = f"redis://{dead},{cluster_url.removeprefix('redis://')}"
    client = redis_client(Settings(redis_url=url, redis_cluster=True))
    try:
        assert await client.ping()
        nodes = {n.name for n in client.get_nodes()}
        assert dead not in nodes and len(nodes) == 3
    finally:
        await client.aclose()


def test_a_single_node_url_stays_a_single_node_client() -> None:
    client = redis_client(Settings(redis_url="redis://127.0.0.1:6379/0"))
    assert not isinstance(client, RedisCluster)
