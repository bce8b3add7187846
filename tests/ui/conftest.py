"""What the page's tests need: Debian's Chromium driven by Playwright, and a live broker (an
API process and `rollout-broker worker`) on the test's Redis prefix and database."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.processes import ApiProcess, Process, broker_env, worker_process
from tests.services import RedisBackend

if TYPE_CHECKING:
    from playwright.async_api import Browser

CHROMIUM = os.environ.get("BROKER_TEST_CHROMIUM", "/usr/bin/chromium")
"""The browser: Debian's ``chromium`` package (.ci/run installs it), never a downloaded build."""

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """A headless Chromium with a fresh profile of its own, closed after the test."""
    try:  # imported here: a missing dev dependency fails these tests, not the whole run
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]'")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: `apt-get install chromium` (.ci/run does), or point "
            "BROKER_TEST_CHROMIUM at a Chromium binary"
        )
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@dataclass
class LiveBroker:
    url: str
    http: httpx.AsyncClient  # to the API process, with the token (if any) of the test's admin
    api: ApiProcess
    worker: Process


@contextlib.asynccontextmanager
async def live_broker(
    redis_backend: RedisBackend,
    database_url: str,
    prefix: str,
    logs: Path,
    token: str | None = None,
    **settings: str,
) -> AsyncIterator[LiveBroker]:
    """An API process and a worker with brisk sweeps and drain reads, stopped on the way out."""
    env = broker_env(
        **redis_backend.env(),
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_SWEEP_INTERVAL_S="0.2",
        BROKER_DRAIN_BLOCK_MS="50",
        **settings,
    )
    api = ApiProcess(env, logs / "api.log")
    worker = worker_process(env, logs / "worker.log")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        await worker.start()
        await api.start()
        # A connection per request: twice on a loaded machine a request sent on a kept-alive
        # connection met the server closing it (no answer, the API process running and its log
        # empty), as uvicorn does to a connection it holds idle; the pages' figures are the
        # subject here, not connection reuse (tests/test_serve_connections.py has that).
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=api.url, headers=headers, timeout=10.0, limits=fresh
        ) as http:
            yield LiveBroker(api.url, http, api, worker)
    except Exception as err:  # what the broker's processes said goes with the failure
        for process in (api, worker):
            state = "running" if process.exited is None else f"exited {process.exited}"
            err.add_note(f"--- {process.log.name} ({state}), its end:\n{process.tail()}")
        raise
    finally:
        await api.stop()
        await worker.stop()


@pytest.fixture
async def broker(
    redis_backend: RedisBackend, database_url: str, prefix: str, tmp_path: Path
) -> AsyncIterator[LiveBroker]:
    """A live broker with auth off, on the test's Redis prefix and database (the pages' tests
    of figures)."""
    async with live_broker(
        redis_backend, database_url, prefix, tmp_path, BROKER_AUTH="off"
    ) as running:
        yield running
