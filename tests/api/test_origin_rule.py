"""The Origin rule with auth off (SPEC "Access control"), against what a web page can send: a
state-changing GET from an ``<img>`` (no ``Origin``, but ``Sec-Fetch-Site``), and a page of a
name of its own that DNS rebinding points at the broker (its ``Host``). With auth on, neither
header matters: the token decides."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import SecretStr

from app.access import policy
from app.access.guard import served_host
from app.access.startup import served_on
from app.main import create_app
from app.settings import Settings
from tests.api.support import asgi_client, assert_error, events, ids
from tests.helpers import KNOWN_SECRETS, make_run, post, rollout

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)

FROM_ANOTHER_PAGE = (
    {"sec-fetch-site": "cross-site"},  # an <img> or a form of another site: no Origin on a GET
    {"sec-fetch-site": "same-site"},  # another port or subdomain of the broker's site
    {"origin": "https://evil.example"},  # a browser without Sec-Fetch-Site
    {"origin": "https://evil.example", "sec-fetch-site": "cross-site"},
    {"origin": "http://broker", "sec-fetch-site": "Cross-Site"},
)


@pytest.fixture
async def named(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """Auth off, with a name of BROKER_ALLOWED_HOSTS besides the tests' own."""
    app = create_app(settings.model_copy(update={"allowed_hosts": ("broker", "rb.lan")}))
    async with asgi_client(app) as c:
        yield c


@pytest.fixture
async def with_auth(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    auth = {"auth": True, "admin_token": SecretStr(ADMIN)}
    async with asgi_client(create_app(settings.model_copy(update=auth))) as c:
        c.headers["authorization"] = f"Bearer {ADMIN}"
        yield c


def _batch(size: int) -> str:
    return f"/v1/runs/laptop/batch?size={size}&partial=true"


async def test_every_route_but_a_get_changes_state_and_a_lease_does_too():
    for (method, path), rule in policy.ROUTES.items():
        assert rule.changes_state or method == "GET", (method, path)
    assert policy.rule_of("GET", "/v1/runs/{run_id}/batch") == policy.changing(policy.Scope.TRAIN)
    assert policy.rule_of("HEAD", "/v1/runs/{run_id}/batch") == policy.changing(policy.Scope.TRAIN)


async def test_with_auth_off_a_page_of_another_origin_cannot_lease(api, redis, prefix):
    await make_run(api, "laptop")
    assert (await post(api, "laptop", rollout("a"), rollout("b"))).status_code == 202
    for headers in FROM_ANOTHER_PAGE:
        resp = await api.get(_batch(8), headers=headers)
        assert "origin" in assert_error(resp, 403, "Forbidden"), headers
        resp = await api.post("/v1/runs/laptop/close", headers=headers)
        assert "origin" in assert_error(resp, 403, "Forbidden"), headers
    assert [e for e, _ in await events(redis, prefix, "laptop") if e == "leased"] == []
    # Reading is not refused (the page cannot read the answer: no CORS header allows it).
    run = await api.get("/v1/runs/laptop", headers={"sec-fetch-site": "cross-site"})
    assert run.status_code == 200 and run.json()["status"] == "open"
    # The broker's own pages, the user's own navigation, and clients outside browsers may.
    leased = []
    for headers in (
        {"sec-fetch-site": "same-origin", "origin": "http://broker"},
        {"sec-fetch-site": "none"},
        {},
    ):
        resp = await api.get(_batch(1), headers=headers)
        assert resp.status_code in (200, 204), (headers, resp.text)
        leased += ids(resp.json()) if resp.status_code == 200 else []
    assert sorted(leased) == ["a", "b"]  # nothing was leased before


async def test_with_auth_off_a_name_the_broker_does_not_serve_is_refused(api):
    """DNS rebinding: a page of evil.example, its name now resolving to the broker, sends its
    own Origin and Host, which match each other."""
    await make_run(api, "laptop")
    for host in (
        "evil.example:8000",
        "evil.example",
        "localhost.evil.example",
        "127.0.0.1.nip.io:8000",
        "broker.evil.example",
        "evil.example@localhost",
        "localhost:port",
    ):
        page = {"host": host, "origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        resp = await api.post("/v1/runs", json={"run_id": "rebound"}, headers=page)
        assert "Host" in assert_error(resp, 403, "Forbidden"), host
        resp = await api.get(_batch(1), headers=page)
        assert_error(resp, 403, "Forbidden")
        assert_error(await api.get("/v1/runs", headers={"host": host}), 403, "Forbidden")
        assert (await api.get("/healthz", headers={"host": host})).status_code == 200
    assert_error(await api.get("/v1/runs/rebound"), 404, "RunNotFound")


async def test_with_auth_off_the_names_and_addresses_it_serves_are_accepted(named):
    for n, host in enumerate(
        (
            "localhost",
            "localhost:8000",
            "LocalHost.:8000",
            "127.0.0.1:8000",
            "10.1.2.3",
            "[::1]:8000",
            "broker",
            "rb.lan:8000",
            "RB.LAN.",
        )
    ):
        page = {"host": host, "origin": f"http://{host}"}
        resp = await named.post("/v1/runs", json={"run_id": f"r{n}"}, headers=page)
        assert resp.status_code == 201, (host, resp.text)
        assert (await named.get(f"/v1/runs/r{n}", headers={"host": host})).status_code == 200


async def test_with_auth_on_the_token_decides_whatever_the_page(with_auth):
    page = {"host": "evil.example:8000", "origin": "http://evil.example:8000"}
    resp = await with_auth.post("/v1/runs", json={"run_id": "laptop"}, headers=page)
    assert resp.status_code == 201, resp.text
    assert (await post(with_auth, "laptop", rollout("a"))).status_code == 202
    resp = await with_auth.get(_batch(1), headers={**page, "sec-fetch-site": "cross-site"})
    assert resp.status_code == 200 and ids(resp.json()) == ["a"]
    del with_auth.headers["authorization"]
    assert_error(await with_auth.get(_batch(1)), 401, "Unauthorized")


def test_serve_adds_the_name_it_binds_to_the_served_names(settings: Settings):
    listed = settings.model_copy(update={"allowed_hosts": ("rb.lan",)})
    for host in ("127.0.0.1", "0.0.0.0", "::", "[::1]", "localhost", "rb.lan", "RB.LAN."):
        assert served_on(listed, host).allowed_hosts == ("rb.lan",), host
    assert served_on(listed, "Broker.Internal").allowed_hosts == ("rb.lan", "broker.internal")


def test_the_allowed_hosts_are_names(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BROKER_ALLOWED_HOSTS", " rb.lan, Broker_1.Internal. ,")
    assert Settings().allowed_hosts == ("rb.lan", "broker_1.internal")
    for wrong in ("rb.lan:8000", "http://rb.lan", "rb.lan/x", "-rb", "a b"):
        with pytest.raises(ValueError, match="not a host name"):
            Settings(allowed_hosts=wrong)


def test_a_host_is_judged_against_the_names_it_is_asked_with():
    """served_host keeps its answers: one kept for a host under some names is not the answer
    for it under others."""
    for _ in range(2):
        assert not served_host("rb.lan:8000", ())
        assert served_host("rb.lan:8000", ("rb.lan",))
        assert served_host("10.1.2.3:8000", ())
        assert not served_host("10.1.2.3@evil.example", ("evil.example",))
