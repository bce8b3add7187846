"""Settings that bound how long the broker waits on Redis: set by the broker, not left to
redis-py's defaults, and checked against each other at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster

from app.settings import Settings
from app.wiring import redis_client


@pytest.mark.parametrize("cluster", [False, True], ids=["one-node", "cluster"])
async def test_the_redis_timeouts_are_the_brokers_setting(cluster: bool) -> None:
    """The operator's setting, not redis-py's default. Nothing is connected: the client is only
    built."""
    client = redis_client(
        Settings(redis_url="redis://127.0.0.1:1", redis_cluster=cluster, redis_timeout_s=2.5)
    )
    try:
        if cluster:
            assert isinstance(client, RedisCluster)
            kwargs = client.connection_kwargs
        else:
            kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (2.5, 2.5)
    finally:
        await client.aclose()


def test_an_idle_drain_blocks_for_at_most_half_the_redis_timeout() -> None:
    Settings(drain_block_ms=2500)  # half of the default 5 s
    Settings(drain_block_ms=10_000, redis_timeout_s=20)
    with pytest.raises(ValidationError) as caught:
        Settings(drain_block_ms=2501)
    assert (
        "BROKER_DRAIN_BLOCK_MS (2501 ms) must be at most half of BROKER_REDIS_TIMEOUT_S (5 s)"
        in str(caught.value)
    )
    with pytest.raises(ValidationError):
        Settings(drain_block_ms=200, redis_timeout_s=0.3)


def test_a_wait_for_replicas_lasts_at_most_half_the_redis_timeout() -> None:
    assert Settings().redis_wait_replicas == 0  # off unless asked for
    Settings(redis_wait_replicas=1, redis_wait_timeout_ms=2500)
    with pytest.raises(ValidationError) as caught:
        Settings(redis_wait_replicas=1, redis_wait_timeout_ms=2501)
    assert (
        "BROKER_REDIS_WAIT_TIMEOUT_MS (2501 ms) must be at most half of BROKER_REDIS_TIMEOUT_S "
        "(5 s)" in str(caught.value)
    )
    with pytest.raises(ValidationError):
        Settings(redis_wait_replicas=-1)
    # Off, the timeout is not used: a short Redis timeout needs no shorter one.
    assert Settings(redis_timeout_s=0.5).redis_wait_timeout_ms == 1000
