"""Ingest: generators post rollouts."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.codec import pack_items, read_body, render, sized_call
from app.api.deps import broker_of, settings_of
from app.broker.schemas import IngestJSON, IngestMsgpack, IngestResult, RolloutJSON, RolloutMsgpack

router = APIRouter(prefix="/v1/runs", tags=["rollouts"])

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": IngestJSON.model_json_schema()},
            "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post(
    "/{run_id}/rollouts",
    status_code=202,
    response_model=IngestResult,
    openapi_extra=_BODY_DOC,
)
async def post_rollouts(run_id: str, request: Request) -> Response:
    body = await read_body(request, settings_of(request).max_body_bytes)
    broker = broker_of(request)
    # A big body is validated and packed in a worker thread, one rollout at a time: the event
    # loop keeps serving, and the body's rollouts never all exist as Python lists at once.
    packed = await sized_call(
        len(body),
        pack_items,
        body,
        request.headers.get("content-type"),
        "rollouts",
        (RolloutJSON, RolloutMsgpack),
        (IngestJSON, IngestMsgpack),
        broker.pack,
    )
    del body  # the packed rollouts are all that is needed from here
    result = await broker.ingest_packed(run_id, packed)
    return render(result, status_code=202)
