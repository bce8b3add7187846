"""One rule for integers and one for cursors on every route, found from the app's own routes:
an integer query parameter written ``2.0`` (or ``+2``, `` 2``) is 422 as it is in a body, an
empty ``cursor`` is 422, and the API description says both."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from app.main import create_app
from app.settings import Settings
from tests.api.support import assert_error
from tests.services import REDIS_URL

pytestmark = pytest.mark.one_node

PATH_VALUES = {
    "run_id": "r",
    "batch_id": "b-1",
    "lease_id": "wl-00000000",
    "token_id": "0123456789abcdef",
    "generator_id": "gen-1",
    "name": "c",
}


def _is_int(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return int in get_args(annotation)
    return annotation is int


def _query_params(dependant: Any) -> list[Any]:
    return [*dependant.query_params, *(p for d in dependant.dependencies for p in _query_params(d))]


def _routes() -> list[tuple[str, str, list[str], bool]]:
    """(method, path, integer query parameters, takes a cursor) of every API route."""
    app = create_app(Settings(redis_url=REDIS_URL, database_url="postgresql://x/y"))
    out = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if not isinstance(route, APIRoute):
            continue
        params = _query_params(route.dependant)
        ints = [p.alias for p in params if _is_int(p.field_info.annotation)]
        cursor = any(p.alias == "cursor" for p in params)
        path = route.path_format.format(**PATH_VALUES)
        for method in sorted(route.methods - {"HEAD"}):
            out.append((method, path, ints, cursor))
    return out


ROUTES = _routes()
INTEGER_PARAMS = [(m, p, name) for m, p, ints, _ in ROUTES for name in ints]
CURSOR_ROUTES = [(m, p) for m, p, _, cursor in ROUTES if cursor]


def test_the_routes_found_are_the_ones_that_take_integers_and_cursors():
    assert {
        ("GET", "/v1/runs", "limit"),
        ("GET", "/v1/runs/r/batch", "size"),
        ("GET", "/v1/runs/r/batch", "policy_version"),
        ("GET", "/v1/runs/r/batches", "limit"),
        ("GET", "/v1/audit", "limit"),
    } <= set(INTEGER_PARAMS)
    assert {
        ("GET", "/v1/runs"),
        ("GET", "/v1/runs/r/batches"),
        ("GET", "/v1/runs/r/prompts"),
        ("GET", "/v1/runs/r/accounting/dead-letters"),
        ("GET", "/v1/audit"),
    } <= set(CURSOR_ROUTES)


@pytest.mark.parametrize(("method", "path", "name"), INTEGER_PARAMS)
async def test_an_integer_query_parameter_is_digits_only(
    api: httpx.AsyncClient, method: str, path: str, name: str
):
    for value in ("2.0", "2e0", "+2", " 2", "2.5", "two"):
        resp = await api.request(method, path, params={name: value})
        detail = assert_error(resp, 422, "ValidationFailed")
        assert f"query.{name}: not an integer" in detail, (value, detail)
        assert "two" not in detail and "2.5" not in detail  # the input is not echoed
    resp = await api.request(method, path, params={name: "2"})
    assert f"query.{name}" not in resp.text, resp.text


@pytest.mark.parametrize(("method", "path"), CURSOR_ROUTES)
async def test_an_empty_cursor_is_refused(api: httpx.AsyncClient, method: str, path: str):
    resp = await api.request(method, path, params={"cursor": ""})
    assert "query.cursor: empty" in assert_error(resp, 422, "ValidationFailed")


async def test_a_whole_float_in_a_body_is_not_an_integer(api: httpx.AsyncClient):
    """Bodies hold the same rule (their models are strict), in JSON and msgpack."""
    assert (await api.post("/v1/runs", json={"run_id": "r"})).status_code == 201
    resp = await api.post("/v1/runs/r/policy", json={"version": 2.0})
    assert_error(resp, 422, "ValidationFailed")
    resp = await api.patch("/v1/runs/r/config", json={"max_staleness": 2.0})
    assert_error(resp, 422, "ValidationFailed")
    body = {"rollout_id": "a", "policy_version": 0.0, "response_ids": [1], "reward": 0.0}
    resp = await api.post("/v1/runs/r/rollouts", json={"rollouts": [body]})
    assert_error(resp, 422, "ValidationFailed")


async def test_the_api_description_says_both_rules(api: httpx.AsyncClient):
    doc = (await api.get("/openapi.json")).json()
    assert "Integers:" in doc["info"]["description"] and "Cursors:" in doc["info"]["description"]
    for method, path, name in INTEGER_PARAMS:
        template = _template(doc, path)
        [param] = [p for p in doc["paths"][template][method.lower()]["parameters"]
                   if p["name"] == name]  # fmt: skip
        assert "not 2.0" in param["description"], (method, path, name)
    for method, path in CURSOR_ROUTES:
        template = _template(doc, path)
        [param] = [p for p in doc["paths"][template][method.lower()]["parameters"]
                   if p["name"] == "cursor"]  # fmt: skip
        assert "never empty" in param["description"]
        branches = param["schema"].get("anyOf", [param["schema"]])
        assert [b["minLength"] for b in branches if b.get("type") == "string"] == [1]


def _template(doc: dict[str, Any], path: str) -> str:
    for template in doc["paths"]:
        if template.format(**PATH_VALUES) == path:
            return str(template)
    raise AssertionError(f"{path} is not described")
