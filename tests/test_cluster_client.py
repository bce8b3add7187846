"""The broker's Redis client on a cluster: built from ``BROKER_REDIS_CLUSTER`` and a URL naming
any node, or several of which some may be down."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
import redis
import uvloop
from redis.asyncio.cluster import RedisCluster

from app.errors import outage_of
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


REDIS_PY = tuple(int(part) for part in redis.__version__.split(".")[:2])


@pytest.mark.skipif(
    REDIS_PY >= (8, 2),
    reason="redis-py 8.2 no longer closes a connection a command has taken: the race is gone",
)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_closed_under_a_command_during_a_failover_is_an_outage(
    cluster_url: str, loop: str
) -> None:
    """After an error on a node, redis-py's cluster client closes that node's idle connections
    while they are still in its free queue: a command that takes one meanwhile fails with a
    RuntimeError (uvloop, as uvicorn runs) or an AttributeError (asyncio). That is Redis
    failing under the request (503, retried by clients), not a bug of ours (500)."""

    async def race(spins: int) -> BaseException | None:
        client = redis_client(Settings(redis_url=cluster_url, redis_cluster=True))
        name = f"{new_prefix()}:{{race}}:run"
        try:
            await client.set(name, b"1")
            node = cast(RedisCluster, client).get_node_from_key(name)
            closing = asyncio.ensure_future(node.disconnect_free_connections())
            for _ in range(spins):
                await asyncio.sleep(0)
            try:
                await client.get(name)
            except Exception as exc:
                return exc
            finally:
                await closing
            return None
        finally:
            await client.delete(name)
            await client.aclose()

    run = uvloop.run if loop == "uvloop" else asyncio.run
    failures = [exc for spins in range(1, 6) if (exc := run(race(spins))) is not None]
    assert failures, "the race no longer happens with this redis-py: drop this test"
    assert [outage_of(exc) for exc in failures] == ["Redis"] * len(failures), failures
