"""Runs and policy versions."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.api import (
    SMALL_BODY_BYTES,
    caller_of,
    errors,
    move_actions,
    read_model,
    render,
    request_body,
)
from app.broker import quarantine
from app.broker.config import NULLABLE_CONFIG, RunConfigPatch
from app.broker.endpoints.deps import broker_of
from app.broker.schemas import (
    CreateRun,
    PolicyOut,
    PolicyResult,
    PolicyUpdate,
    ReleaseResult,
    Run,
    RunList,
)
from app.caller import check_run
from app.errors import Forbidden, ValidationFailed
from app.ids import MAX_VERSION, RUN_ID_PATTERN, ItemId, RunId

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.post(
    "",
    response_model=Run,
    status_code=201,
    responses={
        200: {"model": Run, "description": "The run existed with the same config"},
        **errors((409, "The id is taken by a run with another config, or by a deleted run")),
    },
    openapi_extra=request_body(CreateRun, required=False),
)
async def create_run(request: Request) -> Response:
    req = await read_model(request, CreateRun, limit=SMALL_BODY_BYTES)
    caller = caller_of(request)
    if req.run_id is not None:
        check_run(caller, req.run_id)
    elif not caller.every_run:
        raise Forbidden(f"token {caller.name!r} is limited to some runs: name the run to create")
    run, created = await broker_of(request).create_run(req.run_id, req.config, caller)
    await move_actions(request, run.run_id)
    return render(run, status_code=201 if created else 200)


MAX_PAGE = 1000
# A next_cursor: '<creation ms>:<run id>' (app/broker/store.py); any of this shape is read.
RUN_CURSOR_PATTERN = r"^(?:0|[1-9][0-9]{0,14}):" + RUN_ID_PATTERN.removeprefix("^")


@router.get("", response_model=RunList)
async def list_runs(
    request: Request,
    status: Literal["open", "closed"] | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[
        str | None,
        Query(pattern=RUN_CURSOR_PATTERN, description="A previous page's next_cursor"),
    ] = None,
) -> Response:
    """Runs newest first, a page at a time (follow ``next_cursor`` to the end). A token limited
    to some runs sees only those: its pages and cursors name no other run."""
    caller = caller_of(request)
    visible = None if caller.every_run else caller.may_touch
    return render(await broker_of(request).list_runs(status, limit, cursor, visible))


@router.get("/{run_id}", response_model=Run)
async def get_run(run_id: RunId, request: Request) -> Response:
    return render(await broker_of(request).get_run(run_id))


@router.patch(
    "/{run_id}/config",
    response_model=Run,
    openapi_extra=request_body(RunConfigPatch, required=False),
)
async def patch_config(run_id: RunId, request: Request) -> Response:
    patch = await read_model(request, RunConfigPatch, limit=SMALL_BODY_BYTES)
    # null stands for "no value" only where RunConfig has one (step_groups: no staleness
    # budget); any other null was refused only once merged, with pydantic's raw error text.
    nulls = sorted(f for f in patch.model_fields_set - NULLABLE_CONFIG if getattr(patch, f) is None)
    if nulls:
        raise ValidationFailed(
            f"{nulls[0]}: may not be null (only {', '.join(sorted(NULLABLE_CONFIG))} may)"
        )
    run = await broker_of(request).patch_config(run_id, patch, caller_of(request))
    await move_actions(request, run_id)
    return render(run)


@router.delete(
    "/{run_id}",
    status_code=204,
    responses=errors(
        (409, "The run is open, or its live state or accounting has not settled (Retry-After)")
    ),
)
async def delete_run(run_id: RunId, request: Request) -> Response:
    """Delete a closed run's live state once its accounting has caught up."""
    broker = broker_of(request)
    await broker.delete_run(run_id, caller_of(request))
    # The tombstone leaves the run index only once its outbox has moved: the audit loop finds
    # outboxes through that index, and finishes the job when this move fails.
    if await move_actions(request, run_id):
        await broker.unlist(run_id)
    return Response(status_code=204)


@router.post("/{run_id}/close", response_model=Run)
async def close_run(run_id: RunId, request: Request) -> Response:
    run = await broker_of(request).close_run(run_id, caller_of(request))
    await move_actions(request, run_id)
    return render(run)


@router.post(
    "/{run_id}/policy",
    response_model=PolicyResult,
    responses=errors(
        (
            409,
            "The version is below the run's current version (without rewind), or the run is "
            "closed (a rewind)",
        )
    ),
    openapi_extra=request_body(PolicyUpdate),
)
async def set_policy(run_id: RunId, request: Request) -> Response:
    update = await read_model(request, PolicyUpdate, limit=SMALL_BODY_BYTES)
    result = await broker_of(request).set_policy(
        run_id, update.version, caller_of(request), weights=update.weights, rewind=update.rewind
    )
    await move_actions(request, run_id)
    return render(result)


@router.get(
    "/{run_id}/policy",
    response_model=PolicyOut,
    responses={204: {"description": "The version was still `after` when wait_s passed"}},
)
async def get_policy(
    run_id: RunId,
    request: Request,
    after: Annotated[
        int | None,
        Query(
            ge=0,
            le=MAX_VERSION,
            description="The version the caller has: answer once the run's is another (a "
            "higher one, or a lower one after a rewind)",
        ),
    ] = None,
    # At most BROKER_MAX_WAIT_S (Broker.check_wait).
    wait_s: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 0.0,
) -> Response:
    """The run's policy version, where its weights are and when it was set; with ``after``, a
    long poll that generators follow weight updates by."""
    got = await broker_of(request).get_policy(run_id, after, wait_s)
    if got is None:
        return Response(status_code=204)
    return render(got)


@router.post(
    "/{run_id}/generators/{generator_id:path}/release",
    response_model=ReleaseResult,
    responses=errors((422, "The generator id is not a valid id")),
)
async def release_generator(run_id: RunId, generator_id: ItemId, request: Request) -> Response:
    """Lift a generator's quarantine (``generator_kl_max``): it may post rollouts and take work
    again, and its KL window starts afresh. ``released`` is false when it was not quarantined."""
    try:
        # A generator id may hold any printable character, U+FFFD included, so a path that is
        # not UTF-8 once percent-decoded (which decoding turns into U+FFFD) is refused here.
        unquote_to_bytes(request.scope.get("raw_path", b"").decode("latin-1")).decode()
    except UnicodeDecodeError:
        raise ValidationFailed("generator_id: the path is not UTF-8 once percent-decoded") from None
    result = await quarantine.release(
        broker_of(request).store, run_id, generator_id, caller_of(request)
    )
    await move_actions(request, run_id)
    return render(result)
