"""Fixtures of the HTTP contract tests: `api_servers` starts real API processes (uvicorn)
against the test's Redis prefix and database (the in-process `api` is in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.services import WAKE_FALLBACK_S, RedisBackend

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ApiServer:
    url: str
    proc: asyncio.subprocess.Process
    log: Path


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def _start_server(
    redis_backend: RedisBackend, prefix: str, database_url: str, log: Path
) -> ApiServer:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BROKER_")},
        **redis_backend.env(),
        "BROKER_DATABASE_URL": database_url,
        "BROKER_REDIS_PREFIX": prefix,
        "BROKER_WAKE_FALLBACK_S": str(WAKE_FALLBACK_S),
        "PYTHONPATH": str(ROOT),
    }
    for attempt in range(3):
        port = _free_port()
        with log.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "uvicorn",
                "app.main:create_app",
                "--factory",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
                cwd=str(ROOT),
                env=env,
                stdout=out,
                stderr=out,
            )
        server = ApiServer(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2.0) as c:
            while time.monotonic() < deadline and proc.returncode is None:
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get(server.url + "/healthz")).status_code == 200:
                        return server
                await asyncio.sleep(0.05)
        await _stop_server(server)
        if attempt == 2 or time.monotonic() >= deadline:
            break
    raise RuntimeError(f"API process did not become healthy; log:\n{_read(log)}")


async def _stop_server(server: ApiServer) -> None:
    proc = server.proc
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.fixture
async def api_servers(
    redis_backend: RedisBackend, prefix: str, database_url: str, tmp_path: Path
) -> AsyncIterator[list[str]]:
    """Two API processes on different ports sharing the test's Redis prefix and database."""
    servers: list[ApiServer] = []
    try:
        started = await asyncio.gather(
            _start_server(redis_backend, prefix, database_url, tmp_path / "api0.log"),
            _start_server(redis_backend, prefix, database_url, tmp_path / "api1.log"),
            return_exceptions=True,
        )
        for s in started:
            if isinstance(s, ApiServer):
                servers.append(s)
        for s in started:
            if isinstance(s, BaseException):
                raise s
        yield [s.url for s in servers]
    finally:
        await asyncio.gather(*(_stop_server(s) for s in servers))
