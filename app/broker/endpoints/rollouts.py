"""Ingest: generators post rollouts."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import (
    RAW_ARRAYS,
    errors,
    pack_items,
    read_body,
    render,
    request_body,
    settings_of,
    sized_call,
    widest_list,
)
from app.broker.endpoints.deps import broker_of
from app.broker.schemas import IngestJSON, IngestMsgpack, IngestResult, RolloutJSON, RolloutMsgpack
from app.ids import RunId

router = APIRouter(prefix="/v1/runs", tags=["rollouts"])


@router.post(
    "/{run_id}/rollouts",
    status_code=202,
    response_model=IngestResult,
    responses=errors(
        (
            422,
            "The body is malformed or breaks a rule of the rollouts (logprobs as many as "
            "response_ids; a group_id when the run's group_size is above 1; no more rollouts "
            "in a group than group_size, nor any to a group already complete): nothing is "
            "stored",
        ),
        429,
    ),
    openapi_extra=request_body(
        IngestJSON, description=RAW_ARRAYS.format("response_ids, prompt_ids and logprobs")
    ),
)
async def post_rollouts(run_id: RunId, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    broker = broker_of(request)
    # A big body is validated and packed in a worker thread, one rollout at a time: the event
    # loop keeps serving, and the body's rollouts never all exist as Python lists at once.
    _, packed = await sized_call(
        len(body),
        pack_items,
        body,
        request.headers.get("content-type"),
        "rollouts",
        (RolloutJSON, RolloutMsgpack),
        (IngestJSON, IngestMsgpack),
        lambda _doc, rollouts, _count: broker.pack(rollouts),
        broker.check_count,
        widest_list(settings_of(request)),
    )
    del body  # the packed rollouts are all that is needed from here
    result = await broker.ingest_packed(run_id, packed)
    return render(result, status_code=202)
