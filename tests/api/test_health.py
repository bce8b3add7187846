"""Liveness and readiness: /readyz is false until Postgres is migrated to head."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from app.db import upgrade_to_head
from app.main import create_app
from app.settings import Settings
from tests.services import RedisBackend


async def test_ready_with_redis_and_a_migrated_database(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    resp = await api.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {
        "status": "ready",
        "checks": {"redis": "ok", "postgres": "ok", "migrations": "ok"},
    }


async def test_not_ready_until_the_database_is_at_head(
    database_factory: Callable[[], Awaitable[str]], redis_backend: RedisBackend, prefix: str
) -> None:
    url = await database_factory()  # reachable, but no schema yet
    settings = Settings(
        redis_url=redis_backend.url,
        redis_cluster=redis_backend.cluster,
        database_url=url,
        redis_prefix=prefix,
    )
    app = create_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c,
    ):
        assert (await c.get("/healthz")).status_code == 200  # alive all the same
        resp = await c.get("/readyz")
        assert resp.status_code == 503
        body = resp.json()
        assert set(body) == {"error", "detail"}
        assert body["error"] == "Unavailable"
        assert "migrations not at head" in body["detail"]

        await upgrade_to_head(url)
        assert (await c.get("/readyz")).status_code == 200
