"""Every error is `{"error": Name, "detail": text}`; the service describes itself."""

from __future__ import annotations

import pytest

from tests.api.support import assert_error, strict_json


async def test_healthz(api):
    resp = await api.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


async def test_openapi_lists_the_contract_paths(api):
    resp = await api.get("/openapi.json")
    assert resp.status_code == 200
    paths = strict_json(resp)["paths"]
    for path, method in [
        ("/v1/runs", "post"),
        ("/v1/runs", "get"),
        ("/v1/runs/{run_id}", "get"),
        ("/v1/runs/{run_id}/config", "patch"),
        ("/v1/runs/{run_id}/close", "post"),
        ("/v1/runs/{run_id}/policy", "post"),
        ("/v1/runs/{run_id}/rollouts", "post"),
        ("/v1/runs/{run_id}/batch", "get"),
        ("/v1/runs/{run_id}/batches/{batch_id}/ack", "post"),
        ("/v1/runs/{run_id}/batches/{batch_id}/nack", "post"),
    ]:
        assert method in paths.get(path, {}), (path, method)


async def test_unknown_route_is_404_with_the_error_body(api):
    assert_error(await api.get("/v1/nothing-here"), 404, "NotFound")


@pytest.mark.parametrize(
    ("method", "path"),
    [("DELETE", "/v1/runs"), ("PUT", "/v1/runs/r1/policy"), ("GET", "/v1/runs/r1/close")],
)
async def test_wrong_method_is_405_with_the_error_body(api, method, path):
    resp = await api.request(method, path)
    assert_error(resp, 405, "MethodNotAllowed")
    assert resp.headers.get("allow")


async def test_query_validation_error_has_the_error_body(api):
    await api.post("/v1/runs", json={"run_id": "r1"})
    detail = assert_error(
        await api.get("/v1/runs/r1/batch", params={"size": "many"}), 422, "ValidationFailed"
    )
    assert "size" in detail
    assert "many" not in detail  # the input is not echoed
