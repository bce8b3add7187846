"""A run action's entry reaches the audit log (SPEC "Access control") through the run's outbox,
written with the change: the action's request moves it into Postgres; when that move fails the
action still answers its success and the audit loop moves the entry later. A delete's run leaves
the run index only once its outbox has moved."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.access import audit
from app.access.audit import OutboxLog
from app.db import create_engine, create_sessionmaker
from app.main import create_app
from app.settings import Settings
from tests.processes import free_port
from workers.drain import DrainContext, drain_once


@dataclass
class Served:
    http: httpx.AsyncClient
    app: FastAPI


@pytest.fixture
async def served(settings: Settings) -> AsyncIterator[Served]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as http:
            yield Served(http, app)


async def _actions(http: httpx.AsyncClient) -> list[tuple[str, str]]:
    page = (await http.get("/v1/audit")).json()
    return [(e["action"], e["run_id"]) for e in page["entries"]]


async def test_an_action_that_changes_nothing_is_not_in_the_log(served: Served) -> None:
    http = served.http
    for status in (201, 200):  # the second of each changes nothing, and answers its success
        assert (await http.post("/v1/runs", json={"run_id": "r"})).status_code == status
    for _ in range(2):
        assert (await http.patch("/v1/runs/r/config", json={"max_reuse": 3})).status_code == 200
        assert (await http.post("/v1/runs/r/policy", json={"version": 2})).status_code == 200
        assert (await http.post("/v1/runs/r/close")).status_code == 200
    assert (await http.post("/v1/runs/r/policy", json={"version": 1})).status_code == 409
    assert await _actions(http) == [
        ("run.close", "r"),
        ("run.policy", "r"),
        ("run.config", "r"),
        ("run.create", "r"),
    ]


async def test_a_failed_move_leaves_the_entry_for_the_loop_and_the_action_stands(
    served: Served,
    redis: Redis,
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The requests' moves go to a Postgres that does not answer (a closed port); the actions
    answer their success, their entries wait in the outbox, and the loop moves them."""
    http = served.http
    unreachable = create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none")
    served.app.state.action_log = OutboxLog(redis, prefix, create_sessionmaker(unreachable))
    try:
        assert (await http.post("/v1/runs", json={"run_id": "r"})).status_code == 201
        resp = await http.post("/v1/runs/r/policy", json={"version": 1})
        assert resp.status_code == 200 and resp.json()["policy_version"] == 1
        assert (await http.post("/v1/runs/r/close")).status_code == 200
        await drain_once(DrainContext.create(redis, sessionmaker, prefix, consumer="d"))
        assert (await http.delete("/v1/runs/r")).status_code == 204
    finally:
        await unreachable.dispose()
    assert "moving the audit entries of run 'r' failed" in caplog.text
    assert await redis.xlen(keys.outbox_key(prefix, "r")) == 4
    assert await _actions(http) == []  # not in Postgres yet
    # The deleted run waits in the run index, where the loop finds its outbox; unlisted.
    assert await redis.zscore(keys.runs_key(prefix), "r") is not None
    assert (await http.get("/v1/runs")).json()["runs"] == []

    assert await audit.move_all(redis, prefix, sessionmaker) == 4
    assert await _actions(http) == [
        ("run.delete", "r"),
        ("run.close", "r"),
        ("run.policy", "r"),
        ("run.create", "r"),
    ]
    assert await redis.zscore(keys.runs_key(prefix), "r") is None
    assert not await redis.exists(keys.outbox_key(prefix, "r"))


async def test_large_numbers_in_an_entry_read_back_as_they_were_written(served: Served) -> None:
    """JSONB writes 1e30 out as an integer of 31 digits: the log must still answer it (as the
    double it was), not fail to encode an integer past 64 bits."""
    http = served.http
    assert (await http.post("/v1/runs", json={"run_id": "big"})).status_code == 201
    patch = {"correction": {"high": 1e30, "low": 1e-30}, "generator_window_tokens": 10**12}
    assert (await http.patch("/v1/runs/big/config", json=patch)).status_code == 200
    resp = await http.get("/v1/audit?run_id=big")
    assert resp.status_code == 200, resp.text
    (entry,) = [e for e in resp.json()["entries"] if e["action"] == "run.config"]
    assert entry["detail"]["patch"]["correction"] == {"high": 1e30, "low": 1e-30}
    assert entry["detail"]["patch"]["generator_window_tokens"] == 10**12  # still an integer
