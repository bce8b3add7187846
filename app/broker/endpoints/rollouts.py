"""Ingest: generators post rollouts."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import (
    RAW_ARRAYS,
    errors,
    read_items,
    render,
    request_body,
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
    broker = broker_of(request)
    _, packed = await read_items(
        request,
        "rollouts",
        (RolloutJSON, RolloutMsgpack),
        (IngestJSON, IngestMsgpack),
        lambda _doc, rollouts, _count: broker.pack(rollouts),
        broker.check_count,
    )
    result = await broker.ingest_packed(run_id, packed)
    return render(result, status_code=202)
