"""Runs and policy versions."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.access.guard import caller_of, check_run
from app.api.codec import parse_body, read_body, render
from app.api.deps import broker_of, record_action, settings_of
from app.broker.config import RunConfigPatch
from app.broker.schemas import CreateRun, PolicyResult, PolicyUpdate, Run, RunList
from app.errors import Forbidden

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.post("", response_model=Run, status_code=201, responses={200: {"model": Run}})
async def create_run(request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    req = parse_body(body, request.headers.get("content-type"), CreateRun, CreateRun)
    caller = caller_of(request)
    if req.run_id is not None:
        check_run(caller, req.run_id)
    elif not caller.every_run:
        raise Forbidden(f"token {caller.name!r} is limited to some runs: name the run to create")
    run, created = await broker_of(request).create_run(req.run_id, req.config)
    if created:
        await record_action(
            request, "run.create", run.run_id, {"config": run.config.model_dump(mode="json")}
        )
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
    """Runs newest first, a page at a time. A token limited to some runs sees only those (its
    pages may hold fewer than ``limit``; follow ``next_cursor`` to the end)."""
    page = await broker_of(request).list_runs(status, limit, cursor)
    caller = caller_of(request)
    if not caller.every_run:
        page.runs = [r for r in page.runs if caller.may_touch(r.run_id)]
    return render(page)


@router.get("/{run_id}", response_model=Run)
async def get_run(run_id: str, request: Request) -> Response:
    return render(await broker_of(request).get_run(run_id))


@router.patch("/{run_id}/config", response_model=Run)
async def patch_config(run_id: str, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    patch = parse_body(body, request.headers.get("content-type"), RunConfigPatch, RunConfigPatch)
    run = await broker_of(request).patch_config(run_id, patch)
    await record_action(
        request, "run.config", run_id, {"patch": patch.model_dump(mode="json", exclude_unset=True)}
    )
    return render(run)


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
    await record_action(request, "run.delete", run_id, {})
    return Response(status_code=204)


@router.post("/{run_id}/close", response_model=Run)
async def close_run(run_id: str, request: Request) -> Response:
    run = await broker_of(request).close_run(run_id)
    await record_action(request, "run.close", run_id, {})
    return render(run)


@router.post("/{run_id}/policy", response_model=PolicyResult)
async def set_policy(run_id: str, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    update = parse_body(body, request.headers.get("content-type"), PolicyUpdate, PolicyUpdate)
    result = await broker_of(request).set_policy(run_id, update.version)
    await record_action(request, "run.policy", run_id, {"version": update.version})
    return render(result)
