"""Consumers: reward-model and preference trainers reading a run beside the policy trainer."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.api import (
    SMALL_BODY_BYTES,
    caller_of,
    errors,
    move_actions,
    msgpack_answer,
    read_model,
    render,
    request_body,
    wants_msgpack,
)
from app.broker.consumer_schemas import (
    ConsumerAckResult,
    ConsumerBatchOut,
    ConsumerBody,
    ConsumerNackResult,
    ConsumerOut,
)
from app.broker.endpoints.deps import broker_of
from app.broker.endpoints.openapi import ConsumerBatchOutMsgpack
from app.ids import ConsumerName, LeaseId, RunId

router = APIRouter(prefix="/v1/runs", tags=["consumers"])


@router.post(
    "/{run_id}/consumers",
    response_model=ConsumerOut,
    status_code=201,
    responses={
        200: {"model": ConsumerOut, "description": "The consumer existed with the same config"},
        **errors(
            (404, "No such run"),
            (409, "The name is taken by a consumer with another config, or the run is closed"),
            (422, "The body is malformed, or kind preferences on a run without groups"),
        ),
    },
    openapi_extra=request_body(ConsumerBody),
)
async def create_consumer(run_id: RunId, request: Request) -> Response:
    body = await read_model(request, ConsumerBody, limit=SMALL_BODY_BYTES)
    consumers = broker_of(request).consumers
    out, created = await consumers.create(run_id, body, caller_of(request))
    if created:
        await move_actions(request, run_id)
    return render(out, status_code=201 if created else 200)


@router.get(
    "/{run_id}/consumers/{name}",
    response_model=ConsumerOut,
    responses=errors((404, "No such run, or no such consumer in it")),
)
async def get_consumer(run_id: RunId, name: ConsumerName, request: Request) -> Response:
    return render(await broker_of(request).consumers.get(run_id, name))


@router.delete(
    "/{run_id}/consumers/{name}",
    status_code=204,
    responses=errors((404, "No such run, or no such consumer in it")),
)
async def delete_consumer(run_id: RunId, name: ConsumerName, request: Request) -> Response:
    """Delete the consumer: its pending and leased items are counted dropped, and the rollouts
    only it still held are freed."""
    await broker_of(request).consumers.delete(run_id, name, caller_of(request))
    await move_actions(request, run_id)
    return Response(status_code=204)


@router.get(
    "/{run_id}/consumers/{name}/batch",
    response_model=ConsumerBatchOut,
    responses={
        200: msgpack_answer(ConsumerBatchOutMsgpack),
        204: {"description": "Nothing was pending within wait_s"},
        **errors(
            (404, "No such run, or no such consumer in it"),
            (
                409,
                "The client-chosen batch_id names a batch already settled, or the lease ran "
                "out before it could be delivered",
            ),
        ),
    },
)
async def lease_consumer_batch(
    run_id: RunId,
    name: ConsumerName,
    request: Request,
    # At most BROKER_MAX_BATCH_SIZE items: rollouts, or pairs for kind preferences.
    size: Annotated[int, Query(ge=1)],
    # At most BROKER_MAX_WAIT_S (Broker.check_wait).
    wait_s: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 0.0,
    batch_id: Annotated[
        LeaseId | None,
        Query(description="Client-chosen id: retrying the call returns the same live batch"),
    ] = None,
) -> Response:
    answer = await broker_of(request).consumers.lease(
        run_id, name, size=size, wait_s=wait_s, batch_id=batch_id
    )
    if answer is None:
        return Response(status_code=204)
    # Arrays go as numpy: raw bytes in msgpack, lists in JSON (app/api/_codec.py).
    return render(answer, as_msgpack=wants_msgpack(request))


@router.post(
    "/{run_id}/consumers/{name}/batches/{batch_id}/ack",
    response_model=ConsumerAckResult,
    responses=errors(404, (409, "The batch was nacked, or its lease expired")),
)
async def ack_consumer_batch(
    run_id: RunId, name: ConsumerName, batch_id: LeaseId, request: Request
) -> Response:
    return render(await broker_of(request).consumers.ack(run_id, name, batch_id))


@router.post(
    "/{run_id}/consumers/{name}/batches/{batch_id}/nack",
    response_model=ConsumerNackResult,
    responses=errors(404, (409, "The batch was acked, or its lease expired")),
)
async def nack_consumer_batch(
    run_id: RunId, name: ConsumerName, batch_id: LeaseId, request: Request
) -> Response:
    return render(await broker_of(request).consumers.nack(run_id, name, batch_id))
