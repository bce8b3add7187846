"""The ingest route served by ``DirectRoutes`` (app/main.py) answers exactly as the router and
FastAPI's dependency solving answer it: status, headers and body of every kind of request, the
guard's refusals with auth on and off, the requests it must leave to the router, and the
request metrics' route labels."""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from redis.asyncio import Redis

from app.access.guard import guard
from app.api import DirectRoutes
from app.broker.endpoints import batches, rollouts
from app.main import create_app
from app.settings import Settings
from tests.api.support import asgi_client
from tests.helpers import KNOWN_SECRETS, rollout
from tests.services import delete_prefix, new_prefix

pytestmark = pytest.mark.one_node  # routing inside the app: the same on any Redis

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)

Request = tuple[str, str, bytes, dict[str, str]]  # method, path, body, headers


def _routed(app: FastAPI) -> FastAPI:
    """``app`` with its direct routes taken out: every request goes through the router."""
    direct = app.router.middleware_stack
    assert isinstance(direct, DirectRoutes)
    app.router.middleware_stack = direct.app
    return app


@dataclass
class Pair:
    direct: httpx.AsyncClient  # the app as built
    routed: httpx.AsyncClient  # the same app with every request routed
    served: list[int]  # how many requests the direct path served
    app: FastAPI  # the app of ``direct``


@contextlib.asynccontextmanager
async def _pair(settings: Settings, redis: Redis) -> AsyncIterator[Pair]:
    """Clients of the app as built and of the same app with every request routed, each on a
    Redis prefix of its own."""
    other = new_prefix()
    direct_app = create_app(settings)
    routed_app = _routed(create_app(settings.model_copy(update={"redis_prefix": other})))
    layer = direct_app.router.middleware_stack
    assert isinstance(layer, DirectRoutes)
    served = [0]
    serve = layer._serve

    async def counting(*args: Any) -> None:
        served[0] += 1
        await serve(*args)

    layer._serve = counting  # type: ignore[method-assign]
    try:
        async with asgi_client(direct_app) as direct, asgi_client(routed_app) as routed:
            yield Pair(direct, routed, served, direct_app)
    finally:
        await delete_prefix(redis, other)


def _answer(resp: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    return resp.status_code, sorted(resp.headers.multi_items()), resp.content


async def _same(
    direct: httpx.AsyncClient, routed: httpx.AsyncClient, requests: list[Request]
) -> list[int]:
    statuses = []
    for method, path, body, headers in requests:
        a = await direct.request(method, path, content=body, headers=headers)
        b = await routed.request(method, path, content=body, headers=headers)
        assert _answer(a) == _answer(b), (method, path, body[:200], headers)
        statuses.append(a.status_code)
    return statuses


def _json(*items: dict[str, Any]) -> bytes:
    return orjson.dumps({"rollouts": list(items)})


def _msgpack(*items: dict[str, Any]) -> bytes:
    return msgpack.packb({"rollouts": list(items)}, use_bin_type=True)


def _raw(rid: str, **fields: Any) -> dict[str, Any]:
    ids = np.arange(5, 9, dtype="<i4")
    return {
        "rollout_id": rid,
        "policy_version": 0,
        "response_ids": ids.tobytes(),
        "logprobs": np.full(4, -0.25, dtype="<f4").tobytes(),
        "reward": 0.5,
        **fields,
    }


JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}


def _ingest_requests(run: str) -> list[Request]:
    path = f"/v1/runs/{run}/rollouts"
    big = _json(*(rollout(f"big{i}", tokens=2000) for i in range(60)))
    return [
        ("POST", path, _json(rollout("a")), JSON),
        ("POST", path, _json(rollout("a")), JSON),  # a duplicate
        ("POST", path, _json(rollout("b"), rollout("c", tokens=9)), JSON),
        ("POST", path, _msgpack(_raw("m1")), MSGPACK),
        ("POST", path, _msgpack(_raw("m2", metadata={"k": [1, None]})), MSGPACK),
        ("POST", path, _msgpack(rollout("m3")), {"content-type": "application/x-msgpack"}),
        ("POST", path, _json(rollout("v9", version=9)), JSON),  # rejected: future_version
        ("POST", path, _json(rollout("e1", logprobs=[0.5] * 4)), JSON),
        ("POST", path, _json(rollout("e2", tokens=0, logprobs=[])), JSON),
        ("POST", path, _json({"rollout_id": "x"}), JSON),
        ("POST", path, _json({**rollout("e3"), "reward": "1"}), JSON),
        ("POST", path, _json({**rollout("e4"), "extra": 1}), JSON),
        ("POST", path, b'{"rollouts": [', JSON),
        ("POST", path, b"", JSON),
        ("POST", path, b"\xc1", MSGPACK),
        ("POST", path, _msgpack(_raw("e5", response_ids=b"\x01\x02\x03")), MSGPACK),
        ("POST", path, _json(rollout("t1")), {"content-type": "text/plain"}),
        ("POST", path, _json(rollout("t2")), {}),
        ("POST", path, big, JSON),  # above the test app's 1 MiB body limit: 413
        ("POST", path, _json(rollout("o1")), {**JSON, "origin": "http://evil.example"}),
        ("POST", path, _json(rollout("o2")), {**JSON, "origin": "http://broker"}),
        ("POST", path, _json(rollout("o3")), {**JSON, "origin": "null"}),
        ("GET", path, b"", {}),  # 405, with every method of the path in Allow
        ("PUT", path, _json(rollout("p1")), JSON),
        ("POST", path + "/", _json(rollout("s1")), JSON),  # left to the router (redirect)
        ("POST", f"/v1/runs/{run}/rollouts/x", _json(rollout("s2")), JSON),
        ("POST", f"/v1/runs/{run}//rollouts", _json(rollout("s3")), JSON),
        ("POST", "/v1/runs//rollouts", _json(rollout("s4")), JSON),
        ("POST", "/v1/runs/no-such-run/rollouts", _json(rollout("n1")), JSON),
        ("POST", "/v1/runs/a%20b/rollouts", _json(rollout("n2")), JSON),
        ("POST", "/v1/runs/.x/rollouts", _json(rollout("n3")), JSON),
        # Ids no run can have: refused by the run id's rule on both ways, before any store.
        ("POST", "/v1/runs/a%00b/rollouts", _json(rollout("n4")), JSON),
        ("POST", "/v1/runs/a%E2%80%AEb/rollouts", _json(rollout("n5")), JSON),
        ("POST", "/v1/runs/a%ED%A0%80b/rollouts", _json(rollout("n6")), JSON),
        ("POST", f"/v1/runs/{'a' * 129}/rollouts", _json(rollout("n7")), JSON),
    ]


async def test_direct_ingest_answers_as_the_router_does(settings: Settings, redis: Redis):
    async with _pair(settings, redis) as pair:
        direct, routed, served = pair.direct, pair.routed, pair.served
        for c in (direct, routed):
            resp = await c.post("/v1/runs", json={"run_id": "r1", "config": {}})
            assert resp.status_code == 201, resp.text
        requests = _ingest_requests("r1")
        statuses = await _same(direct, routed, requests)
        assert {202, 307, 403, 404, 405, 413, 415, 422} <= set(statuses), statuses
        # Every POST to a run's rollouts took the direct path; nothing else did.
        assert served[0] == sum(
            m == "POST" and re.fullmatch(r"/v1/runs/[^/]+/rollouts", p) is not None
            for m, p, _, _ in requests
        )
        # A closed run, and a full one (429 with Retry-After).
        for c in (direct, routed):
            assert (await c.post("/v1/runs/r1/close")).status_code == 200
            resp = await c.post(
                "/v1/runs", json={"run_id": "full", "config": {"capacity_rollouts": 1}}
            )
            assert resp.status_code == 201, resp.text
        statuses = await _same(
            direct,
            routed,
            [
                ("POST", "/v1/runs/r1/rollouts", _json(rollout("late")), JSON),
                ("POST", "/v1/runs/full/rollouts", _json(rollout("f1")), JSON),
                ("POST", "/v1/runs/full/rollouts", _json(rollout("f2")), JSON),
            ],
        )
        assert statuses == [202, 202, 429]
        # The request metrics name the route and status class the same way.
        metrics = []
        for c in (direct, routed):
            text = (await c.get("/metrics")).text
            metrics.append(
                sorted(
                    line
                    for line in text.splitlines()
                    if line.startswith("rollout_broker_http_request_duration_seconds_count")
                    and "/metrics" not in line
                )
            )
        assert metrics[0] == metrics[1]
        assert any('route="/v1/runs/{run_id}/rollouts"' in line for line in metrics[0])


async def test_direct_ingest_guards_as_the_router_does(settings: Settings, redis: Redis):
    auth = settings.model_copy(update={"auth": True, "admin_token": SecretStr(ADMIN)})
    async with _pair(auth, redis) as pair:
        direct, routed, served = pair.direct, pair.routed, pair.served
        admin = {"Authorization": f"Bearer {ADMIN}"}
        tokens: dict[str, str] = {}
        for c in (direct, routed):
            resp = await c.post("/v1/runs", json={"run_id": "r1", "config": {}}, headers=admin)
            assert resp.status_code == 201, resp.text
        # The two apps share the database: one set of tokens serves both.
        for name, scopes, runs in (
            ("operator", ["operate"], None),
            ("gen", ["generate"], None),
            ("gen-other", ["generate"], ["other*"]),
            ("trainer", ["train"], None),
        ):
            body: dict[str, Any] = {"name": name, "scopes": scopes, "runs": runs}
            resp = await direct.post("/v1/tokens", json=body, headers=admin)
            assert resp.status_code == 201, resp.text
            tokens[name] = resp.json()["token"]
        path = "/v1/runs/r1/rollouts"
        body = _json(rollout("a"))
        headers: list[dict[str, str]] = [
            {},
            {"Authorization": "Basic abc"},
            {"Authorization": "Bearer "},
            {"Authorization": "Bearer rb_nothing_here"},
            {"Authorization": "Bearer " + "x" * 40},
            admin,
            *({"Authorization": f"Bearer {t}"} for t in tokens.values()),
        ]
        requests = [("POST", path, body, {**JSON, **h}) for h in headers]
        requests.append(
            ("POST", path, _json(rollout("b")), {**JSON, **admin, "origin": "http://x"})
        )
        statuses = await _same(direct, routed, requests)
        assert {202, 401, 403} <= set(statuses), statuses
        assert served[0] == len(requests)


def test_direct_routes_refuse_an_endpoint_they_would_serve_otherwise():
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", auth=False))
    inner = app.router.middleware_stack

    def refused(endpoint: Callable[..., Any]) -> str:
        with pytest.raises(ValueError) as err:
            DirectRoutes(inner, app, [endpoint], guard)
        return str(err.value)

    assert "not the endpoint of one route" in refused(lambda: None)
    # The lease route takes query parameters the direct path would not read.
    assert "besides its path's" in refused(batches.lease_batch)
    DirectRoutes(inner, app, [rollouts.post_rollouts], guard)

    # A route that could take the same requests: the router might pick it instead.
    @app.post("/v1/runs/{run_id}/{what}")
    async def _other(run_id: str, what: str) -> None: ...

    assert "takes its requests too" in refused(rollouts.post_rollouts)


async def test_requests_recorded_by_fastapi_telemetry_take_the_router(
    settings: Settings, redis: Redis
):
    """FastAPI's OpenTelemetry instrumentation marks the requests it records in their scope;
    those go through the router, which names their route in the span."""
    async with _pair(settings, redis) as pair:
        direct, routed, served, app = pair.direct, pair.routed, pair.served, pair.app

        async def recorded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await app({**scope, "fastapi.telemetry": object()}, receive, send)

        traced = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=recorded, raise_app_exceptions=False),
            base_url="http://broker",
        )
        async with traced:
            for c in (direct, routed):
                assert (await c.post("/v1/runs", json={"run_id": "r1"})).status_code == 201
            resp = await traced.post(
                "/v1/runs/r1/rollouts", content=_json(rollout("a")), headers=JSON
            )
            assert resp.status_code == 202, resp.text
            assert served[0] == 0
            await _same(
                direct, routed, [("POST", "/v1/runs/r1/rollouts", _json(rollout("b")), JSON)]
            )
            assert served[0] == 1


@pytest.mark.parametrize(
    ("path", "root_path"),
    [
        ("/v1/runs/a/rollouts", ""),
        ("/api/v1/runs/a/rollouts", "/api"),
        ("/api", "/api"),
        ("/apiv1/runs/a/rollouts", "/api"),
        ("/v1/runs/a/rollouts", "/api"),
        ("/api/", "/api"),
    ],
)
def test_the_matched_path_is_the_one_starlettes_router_matches(path: str, root_path: str) -> None:
    from starlette._utils import get_route_path  # the router's own, as a reference

    from app.api._direct import route_path as _route_path

    scope = {"type": "http", "path": path, "root_path": root_path}
    assert _route_path(scope) == get_route_path(scope)
