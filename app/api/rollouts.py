"""Ingest: generators post rollouts."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.codec import parse_body, read_body, render
from app.api.deps import broker_of, settings_of
from app.broker.schemas import IngestJSON, IngestMsgpack, IngestResult

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
    req = parse_body(body, request.headers.get("content-type"), IngestJSON, IngestMsgpack)
    result = await broker_of(request).ingest(run_id, req.rollouts)
    return render(result, status_code=202)
