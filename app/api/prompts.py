"""Prompts and work leases: operators or generators register prompts, generators take work."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api.codec import parse_body, read_body, render, wants_msgpack
from app.api.deps import broker_of, settings_of
from app.broker.schemas import (
    PromptsBody,
    PromptsResult,
    ReturnBody,
    ReturnResult,
    WorkBody,
    WorkOut,
)

router = APIRouter(prefix="/v1/runs", tags=["prompts"])

Body = TypeVar("Body", PromptsBody, WorkBody, ReturnBody)


def _doc(model: type[Body], required: bool = True) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": required,
            "content": {
                "application/json": {"schema": model.model_json_schema()},
                "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


async def _body(request: Request, model: type[Body]) -> Body:
    raw = await read_body(request, settings_of(request).max_body_bytes)
    return parse_body(raw, request.headers.get("content-type"), model, model)


@router.post(
    "/{run_id}/prompts",
    status_code=202,
    response_model=PromptsResult,
    openapi_extra=_doc(PromptsBody),
)
async def register_prompts(run_id: str, request: Request) -> Response:
    body = await _body(request, PromptsBody)
    return render(await broker_of(request).register_prompts(run_id, body), status_code=202)


@router.post(
    "/{run_id}/work",
    response_model=WorkOut,
    responses={204: {"description": "no prompt could be handed out within wait_s"}},
    openapi_extra=_doc(WorkBody),
)
async def take_work(run_id: str, request: Request) -> Response:
    body = await _body(request, WorkBody)
    lease = await broker_of(request).work(run_id, body)
    if lease is None:
        return Response(status_code=204)
    return render(lease.model_dump(by_alias=True), as_msgpack=wants_msgpack(request))


@router.post(
    "/{run_id}/work/{lease_id}/return",
    response_model=ReturnResult,
    openapi_extra=_doc(ReturnBody, required=False),
)
async def return_work(run_id: str, lease_id: str, request: Request) -> Response:
    body = await _body(request, ReturnBody)
    return render(await broker_of(request).return_work(run_id, lease_id, body.prompt_ids))
