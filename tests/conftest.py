"""The one set of fixtures on real services (see ``tests/services.py`` for which ones and how to
point the tests elsewhere): a Redis key prefix of each test's own, deleted afterwards; a Postgres
database migrated by Alembic, the test's alone while it runs and emptied after it; and the app
served in-process on both."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.broker.store import RedisStore
from app.db import create_engine, create_sessionmaker, upgrade_to_head
from app.main import create_app
from app.settings import Settings
from app.wiring import MIN_REDIS_VERSION, RedisTooOldError, check_redis_version
from tests.helpers import SecretWatch
from tests.processes import ROOT, RedisClusterServers, redis_server_binary, server_version
from tests.services import (
    CLUSTER_URL,
    REDIS_URL,
    WAKE_FALLBACK_S,
    RedisBackend,
    create_database,
    delete_prefix,
    drop_database,
    empty_database,
    new_prefix,
    rows_left,
    url_of_database,
)


@pytest.fixture(scope="session", autouse=True)
def no_secret_in_any_log_line() -> Iterator[SecretWatch]:
    """Every log record of the session, from INFO up, is checked for token secrets."""
    watch = SecretWatch()
    root = logging.getLogger()
    level = root.level
    root.addHandler(watch)
    root.setLevel(min(level, logging.INFO))
    yield watch
    root.removeHandler(watch)
    root.setLevel(level)
    assert not watch.leaks, watch.leaks


@pytest_asyncio.fixture(scope="session")
async def migrated_database() -> AsyncIterator[str]:
    """The name of a database at the latest schema, built once by Alembic; dropped at the end."""
    name = await create_database()
    try:
        await upgrade_to_head(url_of_database(name))
        yield name
    finally:
        await drop_database(name)


@pytest.fixture
async def database_url(migrated_database: str) -> AsyncIterator[str]:
    """The migrated database (SQLAlchemy async URL), the test's alone while it runs and emptied
    after it, so no test sees another's rows."""
    left = await rows_left(migrated_database)
    assert not left, f"an earlier test left rows behind: {left}"
    yield url_of_database(migrated_database)
    await empty_database(migrated_database)


@pytest.fixture
async def database_factory() -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Makes empty databases (no schema) for the test; all dropped after it."""
    names: list[str] = []

    async def create() -> str:
        names.append(await create_database())
        return url_of_database(names[-1])

    yield create
    for name in names:
        await drop_database(name)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return create_sessionmaker(engine)


BOTH_BACKENDS = ("tests/api/", "tests/accounting/", "tests/broker/", "tests/test_chaos.py")
"""Tests run on one Redis node and on a Redis Cluster: the HTTP contract, the store and its
scripts, the accounting drain, the chaos suite. The rest run on one node."""


def pytest_configure(config: pytest.Config) -> None:
    """Processes the tests start take SIGINT as Ctrl-C (several tests stop a command with it),
    however the suite itself was started: a background job of a non-interactive shell starts
    with SIGINT ignored, and an ignored signal stays ignored in every child, where Python then
    never raises KeyboardInterrupt. A handled signal is reset to its default in a child.

    And they cache the project's bytecode: a run starts about 350 Python processes (API
    processes, workers, `serve`, the test processes), and where the environment sets
    PYTHONDONTWRITEBYTECODE each would compile every module of the broker again, about 0.3 s
    of CPU a process. __pycache__ is ignored by git, as usual."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """The tests need Redis 7.0 or later: the one on BROKER_TEST_REDIS_URL, each node of
    BROKER_TEST_REDIS_CLUSTER_URL, and the redis-server the tests start their own from. An older
    one ends the session before any test, with one message; checked once, by the process that
    starts pytest-xdist's workers (before it starts them). A Redis that does not answer is left
    to the tests that need it."""
    if hasattr(session.config, "workerinput"):
        return
    if too_old := asyncio.run(_redis_too_old()):
        pytest.exit(
            "the tests need Redis 7.0 or later:\n  " + "\n  ".join(too_old),
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


async def _redis_too_old() -> list[str]:
    found = []
    servers = [("BROKER_TEST_REDIS_URL", RedisBackend(REDIS_URL, cluster=False))]
    if CLUSTER_URL:
        servers.append(("BROKER_TEST_REDIS_CLUSTER_URL", RedisBackend(CLUSTER_URL, cluster=True)))
    for variable, backend in servers:
        client = backend.client()
        try:
            await check_redis_version(
                client, Settings(redis_url=backend.url, redis_cluster=backend.cluster)
            )
        except RedisTooOldError as exc:
            found.append(f"{variable}: {exc}")
        finally:
            await client.aclose()
    binary = redis_server_binary()
    version = server_version(binary) if binary else None
    if version is not None and version < MIN_REDIS_VERSION:
        where = (
            "BROKER_TEST_REDIS_SERVER"
            if os.environ.get("BROKER_TEST_REDIS_SERVER")
            else "redis-server (none on PATH is 7.0 or later: set BROKER_TEST_REDIS_SERVER)"
        )
        found.append(f"{where}: {binary} is Redis {'.'.join(map(str, version))}")
    return found


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        where = Path(str(metafunc.definition.path)).relative_to(ROOT).as_posix()
        if where.startswith(BOTH_BACKENDS) and not metafunc.definition.get_closest_marker(
            "one_node"
        ):
            metafunc.parametrize("backend", ["redis", "cluster"])


@pytest.fixture
def backend() -> str:
    """``redis`` (one node) or ``cluster``; see BOTH_BACKENDS."""
    return "redis"


@pytest.fixture(scope="session")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Redis Cluster of ``BROKER_TEST_REDIS_CLUSTER_URL`` (.ci/run starts one), or else a
    3-master cluster of the session's own, started when a test first needs it. Tests keep to
    their own key prefixes on it as on the single node."""
    if CLUSTER_URL:
        yield CLUSTER_URL
        return
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    try:
        servers.start()
        yield servers.url
    finally:
        servers.kill()


@pytest.fixture
def redis_backend(request: pytest.FixtureRequest, backend: str) -> RedisBackend:
    """Where the test's Redis is: its URL, whether it is a cluster, and the ``BROKER_*``
    variables a broker process needs to use it."""
    if backend == "cluster":
        return RedisBackend(request.getfixturevalue("cluster_url"), cluster=True)
    return RedisBackend(REDIS_URL, cluster=False)


@pytest.fixture
async def redis(redis_backend: RedisBackend) -> AsyncIterator[Redis]:
    client = redis_backend.client()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis: Redis) -> AsyncIterator[str]:
    """The test's key prefix; every key under it is deleted after the test."""
    p = new_prefix()
    yield p
    await delete_prefix(redis, p)


@pytest.fixture
def store(redis: Redis, prefix: str) -> RedisStore:
    return RedisStore(redis, prefix)


@pytest.fixture
def settings(
    request: pytest.FixtureRequest, prefix: str, database_url: str, redis_backend: RedisBackend
) -> Settings:
    """The app's settings on the test's services. A long poll re-checks only when woken, unless
    the test is marked ``wake_fallback_s(seconds)``: one that counts on the re-check. Requests
    may be addressed to ``broker`` (the tests' in-process base URL) as to a served name."""
    marker = request.node.get_closest_marker("wake_fallback_s")
    return Settings(
        allowed_hosts=("broker",),
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        database_url=database_url,
        redis_prefix=prefix,
        max_body_bytes=1 << 20,
        wake_fallback_s=marker.args[0] if marker else WAKE_FALLBACK_S,
    )


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process, with its lifespan; an unhandled exception becomes the 500 response a
    real server would send, so a test can assert on it."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://broker", timeout=30.0
        ) as c:
            yield c


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Once an xdist worker's tests and fixtures are done, it ignores SIGINT. execnet sends a
    worker that is still busy 5 s after the controller closed it a SIGINT of its own
    (gateway_base.WorkerGateway._terminate_execution); pytest's final garbage collections can
    take that long on a loaded machine, and the signal then lands as a KeyboardInterrupt in
    whatever runs, such as hypothesis's gc callback."""
    if hasattr(session.config, "workerinput"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
