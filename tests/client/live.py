"""A real broker in a subprocess for tests: ``rollout-broker serve`` on a free port, against the
test Redis (a key prefix of its own) and a Postgres database of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import redis

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("BROKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get("BROKER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432")
_LISTENING = re.compile(r"Uvicorn running on (http://\S+)")


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.log)


def _admin(sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(f"{PG_URL}/postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A new, empty Postgres database, dropped afterwards; yields its asyncpg URL."""
    name = f"rbt_{uuid.uuid4().hex[:12]}"
    _admin(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+asyncpg://{PG_URL.split('://', 1)[1]}/{name}"
    finally:
        _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """A key prefix of its own on the test Redis, its keys deleted afterwards."""
    prefix = f"rbt{uuid.uuid4().hex[:10]}"
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
        client.close()


def broker_env(prefix: str, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_DATABASE_URL=database_url,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def serve(env: Mapping[str, str], *, timeout_s: float = 60.0) -> Iterator[LiveServer]:
    """``rollout-broker serve --port 0 --with-workers``; yields once it listens (uvicorn logs
    the bound address only after the app's start-up has completed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--with-workers"],
        cwd=REPO,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = LiveServer("", proc)
    listening = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.log.append(line)
            m = _LISTENING.search(line)
            if m and not listening.is_set():
                server.url = m.group(1)
                listening.set()
        listening.set()  # the process ended: stop waiting

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        listening.wait(timeout_s)
        if not server.url:
            raise RuntimeError(f"the broker did not start:\n{server.output()}")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
