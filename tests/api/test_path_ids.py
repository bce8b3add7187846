"""Every path id goes through its id rule before any store sees it: an id no run, batch, lease
or token can have is 422 on every route, whichever character makes it so, with auth on and off.
A NUL in a run id reached Postgres on the accounting routes, which answered 500."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from pydantic import SecretStr

from app.main import create_app
from app.settings import Settings
from tests.api.support import assert_error
from tests.helpers import KNOWN_SECRETS

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)

# An id of the right shape for each path parameter, so that only the one under test is wrong.
GOOD = {
    "run_id": "r",
    "batch_id": "b" * 16,
    "lease_id": "l" * 16,
    "token_id": "0" * 16,
    "generator_id": "gen-1",
    "name": "c",
}
BAD = {
    "NUL": "a\x00b",
    "NUL alone": "\x00",
    "U+0085 (NEL)": "a\x85b",
    "U+FEFF (BOM)": "\ufeffa",
    "U+202E (right-to-left override)": "a\u202eb",
    "U+200F (right-to-left mark)": "a\u200fb",
    "U+2066 (left-to-right isolate)": "a\u2066b",
    "U+200B (zero-width space)": "a\u200bb",
    "U+00AD (soft hyphen)": "a\xadb",
    "a lone surrogate's escape": "a%ED%A0%80b",
    "a space": "a b",
    "overlong": "a" * 257,
    "far overlong": "a" * 20_000,
}


def path_routes(app: FastAPI) -> Iterator[tuple[str, str, list[str]]]:
    """(method, path template, path parameters) of every route of ``app`` with a path id."""
    for route in iter_route_contexts(app.router.routes):
        dependant = getattr(route, "dependant", None)
        if dependant is None or not dependant.path_params:
            continue
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                yield method, route.path_format, [p.name for p in dependant.path_params]


def test_every_path_id_is_one_the_test_knows() -> None:
    found = {name for _, _, names in path_routes(create_app()) for name in names}
    assert found and found <= set(GOOD), found - set(GOOD)


def _requests(app: FastAPI) -> Iterator[tuple[str, str, str, str]]:
    """(method, url, parameter, what) for every path id of every route, and every bad value."""
    for method, template, names in path_routes(app):
        for name in names:
            for what, value in BAD.items():
                raw = value if "%" in value else quote(value, safe="")
                url = template.format(**{**GOOD, name: raw})
                yield method, url, name, f"{method} {template} with {name} {what}"


@pytest.fixture(params=[False, True], ids=["auth off", "auth on"])
async def client(
    request: pytest.FixtureRequest, settings: Settings
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    if request.param:
        settings = settings.model_copy(update={"auth": True, "admin_token": SecretStr(ADMIN)})
    app = create_app(settings)
    headers = {"Authorization": f"Bearer {ADMIN}"} if request.param else {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://broker", headers=headers
        ) as c:
            yield app, c


async def test_a_path_id_no_resource_can_have_is_422_on_every_route(client) -> None:
    app, c = client
    assert (await c.post("/v1/runs", json={"run_id": GOOD["run_id"]})).status_code == 201
    wrong: list[str] = []
    requests = list(_requests(app))
    for method, url, name, what in requests:
        # No body: the id is refused before a body is read.
        resp = await c.request(method, url)
        if resp.status_code != 422 or name not in resp.json().get("detail", ""):
            wrong.append(f"{what}: {resp.status_code} {resp.text[:100]}")
            continue
        assert_error(resp, 422, "ValidationFailed")
    assert not wrong, f"{len(wrong)} of {len(requests)}:\n" + "\n".join(wrong)
    assert len(requests) >= 20 * len(BAD)
