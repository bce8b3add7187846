"""Outages of Redis and Postgres are ``503 Unavailable`` with ``Retry-After`` in the error body,
never ``500``; anything else that goes wrong stays a ``500``. The slow test SIGKILLs a Redis of
its own under a uvicorn process (on a cluster, the master of the run's slot) and starts it again
from its append-only file; run with ``-s``, it prints how long each 503 took."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio
import redis.exceptions
import sqlalchemy.exc
from fastapi import FastAPI
from sqlalchemy import text

from app import keys
from app.access import policy
from app.db import create_engine
from app.errors import outage_of
from app.main import create_app
from app.settings import Settings
from tests.api.support import assert_error
from tests.processes import ApiProcess, KillableRedis, RedisServer, broker_env
from tests.services import REDIS_URL


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


async def _asyncpg_connect() -> None:
    await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{_closed_port()}/x", timeout=5)


async def _sqlalchemy_connect() -> None:
    engine = create_engine(f"postgresql+asyncpg://postgres@localhost:{_closed_port()}/x")
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()


async def _lost_postgres_connection() -> None:
    orig = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")
    raise sqlalchemy.exc.DBAPIError("SELECT 1", None, orig, connection_invalidated=True)


async def _redis_down() -> None:
    raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6390")


async def _redis_timeout() -> None:
    raise redis.exceptions.TimeoutError("Timeout reading from socket")


async def _redis_loading() -> None:
    raise redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory")


async def _redis_slot_moving() -> None:
    # The cluster client's redirections did not settle (a slot being moved).
    raise redis.exceptions.ClusterError("TTL exhausted.")


class _ClosedTransportWriter:
    """A stream writer over a transport that was closed under it, as uvloop's raises."""

    def writelines(self, _: object) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


async def _redis_connection_closed_under_a_write() -> None:
    # What redis-py's cluster client meets when it hands out a connection it is closing.
    conn = redis.asyncio.ConnectionPool.from_url(REDIS_URL).make_connection()
    await conn.connect()
    open_writer, conn._writer = conn._writer, _ClosedTransportWriter()  # type: ignore[assignment]
    try:
        await conn.send_packed_command(b"PING\r\n", check_health=False)
    finally:
        assert open_writer is not None
        open_writer.close()


async def _redis_in_a_group() -> None:
    raise ExceptionGroup("tasks", [redis.exceptions.ConnectionError("reset")])


async def _app_file_missing() -> None:
    open("/nonexistent/rollout-broker").close()  # noqa: ASYNC230 - the app's own OSError


async def _redis_wrong_type() -> None:
    raise redis.exceptions.ResponseError("WRONGTYPE Operation against a key")


async def _bug() -> None:
    raise ValueError("a bug")


async def _mixed_group() -> None:
    raise ExceptionGroup("tasks", [redis.exceptions.ConnectionError("reset"), ValueError("bug")])


OUTAGES: dict[str, tuple[Callable[[], Any], str]] = {
    "redis_down": (_redis_down, "Redis"),
    "redis_timeout": (_redis_timeout, "Redis"),
    "redis_loading": (_redis_loading, "Redis"),
    "redis_in_a_group": (_redis_in_a_group, "Redis"),
    "redis_slot_moving": (_redis_slot_moving, "Redis"),
    "redis_closed_under_a_write": (_redis_connection_closed_under_a_write, "Redis"),
    "asyncpg_connect": (_asyncpg_connect, "Postgres"),
    "sqlalchemy_connect": (_sqlalchemy_connect, "Postgres"),
    "lost_postgres_connection": (_lost_postgres_connection, "Postgres"),
}
BUGS: dict[str, Callable[[], Any]] = {
    "app_file_missing": _app_file_missing,
    "redis_wrong_type": _redis_wrong_type,
    "bug": _bug,
    "mixed_group": _mixed_group,
}


@pytest.fixture
async def failing(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """The app with a route ``/fail/{name}`` that runs one of the failures above."""
    app: FastAPI = create_app(settings)
    monkeypatch.setitem(policy.ROUTES, ("GET", "/fail/{name}"), policy.reading(policy.PUBLIC))

    async def fail(name: str) -> None:
        await (OUTAGES[name][0] if name in OUTAGES else BUGS[name])()

    app.add_api_route("/fail/{name}", fail)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c


@pytest.mark.parametrize("name", sorted(OUTAGES))
async def test_a_store_connection_failure_is_503_with_retry_after(
    failing: httpx.AsyncClient, name: str
) -> None:
    resp = await failing.get(f"/fail/{name}")
    detail = assert_error(resp, 503, "Unavailable")
    assert resp.headers["retry-after"] == "1"  # BROKER_RETRY_AFTER_S
    assert detail.startswith(f"{OUTAGES[name][1]} is unreachable"), detail
    assert "127.0.0.1" not in detail  # no addresses of the broker's own services


@pytest.mark.parametrize("name", sorted(BUGS))
async def test_other_failures_stay_500(failing: httpx.AsyncClient, name: str) -> None:
    resp = await failing.get(f"/fail/{name}")
    assert_error(resp, 500, "InternalError")
    assert "retry-after" not in resp.headers


def test_only_explicit_causes_make_an_outage() -> None:
    cause = redis.exceptions.ConnectionError("reset")
    try:
        raise RuntimeError("wrapped") from cause
    except RuntimeError as exc:
        assert outage_of(exc) == "Redis"
    try:
        try:
            raise cause
        except redis.exceptions.ConnectionError:
            raise KeyError("raised while handling it") from None
    except KeyError as exc:
        assert outage_of(exc) is None
    assert outage_of(ConnectionRefusedError(111, "refused")) is None  # not from a driver


async def test_an_unreachable_accounting_database_is_503(settings: Settings) -> None:
    down = settings.model_copy(
        update={"database_url": f"postgresql+asyncpg://postgres@127.0.0.1:{_closed_port()}/x"}
    )
    app = create_app(down)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            assert (await c.post("/v1/runs", json={"run_id": "pg"})).status_code == 201
            resp = await c.get("/v1/runs/pg/accounting")
    detail = assert_error(resp, 503, "Unavailable")
    assert detail.startswith("Postgres is unreachable")
    assert resp.headers["retry-after"] == "1"


# -- a real outage -------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection, so a test sees whether the server keeps it open."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n"
        if body:
            head += "Content-Type: application/json\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        await self.writer.drain()
        status_line = await asyncio.wait_for(self.reader.readline(), 20)
        if not status_line:
            raise ConnectionError("the server closed the connection")
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, value = line.decode().split(":", 1)
            headers[name.strip().lower()] = value.strip()
        content = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, content

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def _rollouts(*ids: str) -> bytes:
    docs = [
        {"rollout_id": i, "policy_version": 0, "response_ids": [1, 2], "reward": 1.0} for i in ids
    ]
    return httpx.Request("POST", "http://x", json={"rollouts": docs}).read()


@pytest.mark.slow
async def test_a_redis_that_stops_answering_is_503_after_the_brokers_redis_timeout(
    tmp_path: Path,
) -> None:
    """A Redis that keeps its connections open and answers nothing: the API gives up after
    BROKER_REDIS_TIMEOUT_S, not redis-py's default (5 s). At 0.5 s here, the 503 comes well
    within the client's 3 s."""
    redis_server = RedisServer(tmp_path)
    await redis_server.start()
    env = broker_env(
        BROKER_REDIS_URL=redis_server.url,
        BROKER_REDIS_PREFIX="frozen",
        BROKER_REDIS_TIMEOUT_S="0.5",
    )
    api = ApiProcess(env, tmp_path / "api.log")
    try:
        await api.start()
        async with httpx.AsyncClient(base_url=api.url, timeout=3.0) as client:
            assert (await client.post("/v1/runs", json={"run_id": "r"})).status_code == 201
            redis_server.freeze()
            try:
                for path in ("/v1/runs/r", "/v1/runs/r/batch?size=1"):
                    detail = assert_error(await client.get(path), 503, "Unavailable")
                    assert "TimeoutError" in detail, detail
            finally:
                redis_server.thaw()
            assert (await client.get("/v1/runs/r")).status_code == 200
    finally:
        await api.stop()
        await redis_server.kill()


@pytest.mark.slow
async def test_redis_killed_under_the_api_is_503_and_the_connection_stays_open(
    backend: str, tmp_path: Path
) -> None:
    """On a cluster the node killed is the master of the run's slot, with no replica to take
    over: the cluster client gives up on it (after its own retries) and the request is a 503
    like any other outage, not a 500 and not an answer that never comes."""
    redis_server = KillableRedis(backend, tmp_path, keys.run_key("outage", "r"))
    await redis_server.start()
    env = broker_env(**redis_server.backend.env(), BROKER_REDIS_PREFIX="outage")
    api = ApiProcess(env, tmp_path / "api.log")
    conn: Connection | None = None
    try:
        await api.start()
        conn = await Connection.open(api.port)
        status, _, _ = await conn.request("POST", "/v1/runs", b'{"run_id": "r"}')
        assert status == 201
        status, _, _ = await conn.request("POST", "/v1/runs/r/rollouts", _rollouts("a", "b"))
        assert status == 202

        await redis_server.kill_run_node()
        down = [
            ("POST", "/v1/runs/r/rollouts", _rollouts("c")),
            ("GET", "/v1/runs/r/batch?size=1&batch_id=batch-one", b""),
            ("POST", "/v1/runs/r/batches/batch-one/ack", b"{}"),
            ("GET", "/v1/runs/r", b""),
        ]
        for method, path, body in down:  # all on the one connection
            started = time.monotonic()
            status, headers, content = await conn.request(method, path, body)
            took = time.monotonic() - started
            print(f"{backend}, Redis down: {method} {path} {status} in {took:.2f} s")
            assert status == 503, (path, content)
            assert headers["retry-after"] == "1"
            answer = httpx.Response(status, headers=headers, content=content)
            assert_error(answer, 503, "Unavailable")

        await redis_server.restart_run_node()  # the same port, from its append-only file
        status, _, content = await conn.request("POST", "/v1/runs/r/rollouts", _rollouts("b", "c"))
        assert (status, httpx.Response(status, content=content).json()["duplicates"]) == (202, 1)
        status, _, content = await conn.request("GET", "/v1/runs/r/batch?size=3&batch_id=batch-two")
        assert status == 200
        got = {r["rollout_id"] for r in httpx.Response(200, content=content).json()["rollouts"]}
        assert got == {"a", "b", "c"}
    finally:
        if conn is not None:
            await conn.close()
        await api.stop()
        await redis_server.stop()
    log = (tmp_path / "api.log").read_text()
    # Answered by the app's handler: no request's exception reached uvicorn.
    assert "Exception in ASGI application" not in log and "unhandled error" not in log, log
    assert "Redis unreachable" in log
