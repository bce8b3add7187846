"""Runs and policy versions."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.api.codec import parse_body, read_body, render
from app.api.deps import broker_of, settings_of
from app.broker.config import RunConfigPatch
from app.broker.schemas import CreateRun, PolicyResult, PolicyUpdate, Run, RunList

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.post("", response_model=Run, status_code=201, responses={200: {"model": Run}})
async def create_run(request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    req = parse_body(body, request.headers.get("content-type"), CreateRun, CreateRun)
    run, created = await broker_of(request).create_run(req.run_id, req.config)
    return render(run, status_code=201 if created else 200)


MAX_PAGE = 1000


@router.get("", response_model=RunList)
async def list_runs(
    request: Request,
    status: Literal["open", "closed"] | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[
        str | None, Query(max_length=300, description="A previous page's next_cursor")
    ] = None,
) -> Response:
    """Runs newest first, a page at a time."""
    return render(await broker_of(request).list_runs(status, limit, cursor))


@router.get("/{run_id}", response_model=Run)
async def get_run(run_id: str, request: Request) -> Response:
    return render(await broker_of(request).get_run(run_id))


@router.patch("/{run_id}/config", response_model=Run)
async def patch_config(run_id: str, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    patch = parse_body(body, request.headers.get("content-type"), RunConfigPatch, RunConfigPatch)
    return render(await broker_of(request).patch_config(run_id, patch))


@router.delete(
    "/{run_id}",
    status_code=204,
    responses={
        409: {"description": "the run is open, or its live state or accounting has not settled"}
    },
)
async def delete_run(run_id: str, request: Request) -> Response:
    """Delete a closed run's live state once its accounting has caught up."""
    await broker_of(request).delete_run(run_id)
    return Response(status_code=204)


@router.post("/{run_id}/close", response_model=Run)
async def close_run(run_id: str, request: Request) -> Response:
    return render(await broker_of(request).close_run(run_id))


@router.post("/{run_id}/policy", response_model=PolicyResult)
async def set_policy(run_id: str, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    update = parse_body(body, request.headers.get("content-type"), PolicyUpdate, PolicyUpdate)
    return render(await broker_of(request).set_policy(run_id, update.version))
