"""Prompts and work leases: operators or generators register prompts, generators take work."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import (
    SMALL_BODY_BYTES,
    errors,
    msgpack_answer,
    read_items,
    read_model,
    render,
    request_body,
    wants_msgpack,
)
from app.broker.endpoints.deps import broker_of
from app.broker.schemas import (
    PromptJSON,
    PromptsBody,
    PromptsResult,
    ReturnBody,
    ReturnMsgpack,
    ReturnResult,
    WorkBody,
    WorkOut,
)
from app.ids import LeaseId, RunId

router = APIRouter(prefix="/v1/runs", tags=["prompts"])


@router.post(
    "/{run_id}/prompts",
    status_code=202,
    response_model=PromptsResult,
    responses=errors(
        (409, "The run is closed"),
        (
            422,
            "The body is malformed, holds more prompt passes (prompts × epochs) than the "
            "broker takes in one request, or a prompt's data is too big",
        ),
    ),
    openapi_extra=request_body(PromptsBody),
)
async def register_prompts(run_id: RunId, request: Request) -> Response:
    broker = broker_of(request)
    limits = broker.prompt_limits
    models = (PromptJSON, PromptJSON), (PromptsBody, PromptsBody)
    doc, packed = await read_items(request, "prompts", *models, limits.pack, limits.check_count)
    return render(await broker.register_prompts(run_id, packed, doc.epochs), status_code=202)


@router.post(
    "/{run_id}/work",
    response_model=WorkOut,
    responses={
        200: msgpack_answer(WorkOut),
        204: {"description": "No prompt could be handed out within wait_s"},
        **errors((409, "The run is closed, or the client-chosen lease_id was returned or expired")),
    },
    openapi_extra=request_body(WorkBody),
)
async def take_work(run_id: RunId, request: Request) -> Response:
    body = await read_model(request, WorkBody, limit=SMALL_BODY_BYTES)
    lease = await broker_of(request).work(run_id, body)
    if lease is None:
        return Response(status_code=204)
    return render(lease.body(), as_msgpack=wants_msgpack(request))


@router.post(
    "/{run_id}/work/{lease_id}/return",
    response_model=ReturnResult,
    responses=errors(
        (404, "No such run, or no such work lease in it"),
        (
            422,
            "The body is malformed, names a prompt the work lease never held, or gives a "
            "partial that is not of a prompt it returns (nothing is returned then)",
        ),
    ),
    openapi_extra=request_body(ReturnBody, required=False),
)
async def return_work(run_id: RunId, lease_id: LeaseId, request: Request) -> Response:
    # The broker answers an empty prompt_ids without a look at the run or the lease: a run
    # that does not exist is 404 whatever the body.
    broker = broker_of(request)
    # With partials, a return is as big as a post of rollouts may be (the broker's size limit).
    body = await read_model(request, ReturnBody, ReturnMsgpack)
    if body.prompt_ids == [] and not body.partials:
        await broker.get_run(run_id)
    return render(await broker.return_work(run_id, lease_id, body.prompt_ids, body.partials or []))
