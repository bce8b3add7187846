"""Batches: trainers lease, acknowledge and give back."""

from __future__ import annotations

import sys
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.api import (
    RAW_ARRAYS,
    errors,
    msgpack_answer,
    read_model,
    render,
    request_body,
    wants_msgpack,
)
from app.broker.endpoints.deps import broker_of
from app.broker.endpoints.openapi import BatchOutMsgpack, MeasureResultMsgpack
from app.broker.schemas import (
    AckBody,
    AckMsgpack,
    AckResult,
    BatchOut,
    MeasureBody,
    MeasureMsgpack,
    MeasureResult,
    NackResult,
)
from app.broker.service import LeasedBatch
from app.ids import MAX_VERSION, ItemId, LeaseId, RunId

router = APIRouter(prefix="/v1/runs", tags=["batches"])


@router.get(
    "/{run_id}/batch",
    response_model=BatchOut,
    responses={
        200: msgpack_answer(BatchOutMsgpack),
        204: {"description": "Nothing qualified within wait_s"},
        **errors(
            (
                409,
                "The client-chosen batch_id names a batch already settled, or the lease ran "
                "out before it could be delivered",
            ),
            (
                422,
                "A parameter is malformed, size is not a multiple of the run's group_size, or "
                "policy_version is above the run's current version",
            ),
        ),
    },
)
async def lease_batch(
    run_id: RunId,
    request: Request,
    # At most BROKER_MAX_BATCH_SIZE (the broker refuses more; the description says this
    # app's value).
    size: Annotated[int, Query(ge=1)],
    policy_version: Annotated[int | None, Query(ge=0, le=MAX_VERSION)] = None,
    # At most BROKER_MAX_WAIT_S (Broker.check_wait).
    wait_s: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 0.0,
    partial: bool = False,
    trainer_id: Annotated[
        ItemId | None, Query(description="Recorded with the batch in the ledger")
    ] = None,
    batch_id: Annotated[
        LeaseId | None,
        Query(description="Client-chosen id: retrying the call returns the same live batch"),
    ] = None,
) -> Response:
    batch = await broker_of(request).lease(
        run_id,
        size=size,
        policy_version=policy_version,
        wait_s=wait_s,
        partial=partial,
        trainer_id=trainer_id,
        batch_id=batch_id,
    )
    if batch is None:
        return Response(status_code=204)
    as_msgpack = wants_msgpack(request)
    return render(batch_body(batch, as_msgpack), as_msgpack=as_msgpack)


# Byte orders that are little-endian here ('|': a single byte; '=': this machine's own).
_LITTLE = ("<", "|", "=") if sys.byteorder == "little" else ("<", "|")


def _raw(a: Any) -> Any:
    """An array as msgpack carries it: its little-endian bytes. A little-endian C-contiguous
    array (what the broker reads back) is handed over as a memoryview, packed without a copy
    of its own."""
    if a is None:
        return None
    if a.flags.c_contiguous and a.dtype.byteorder in _LITTLE:
        return memoryview(a)
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _same(a: Any) -> Any:
    return a


def batch_body(batch: LeasedBatch, as_msgpack: bool) -> dict[str, Any]:
    arr = _raw if as_msgpack else _same

    return {
        "batch_id": batch.batch_id,
        "policy_version": batch.policy_version,
        "lease_expires_at": batch.lease_expires_at,
        "kl_coef": batch.kl_coef,
        "rollouts": [
            {
                "rollout_id": r.rollout_id,
                "group_id": r.group_id,
                "policy_version": r.policy_version,
                "prompt_ids": arr(r.prompt_ids),
                "response_ids": arr(r.response_ids),
                "logprobs": arr(r.logprobs),
                "loss_mask": arr(mask),
                "versions": r.versions or [[0, r.policy_version]],
                "reward": r.reward,
                "generator_id": r.generator_id,
                "finish_reason": r.finish_reason,
                "metadata": r.metadata,
                "uses": uses,
                "lag": lag,
                **({} if prompt_id is None else {"prompt_id": prompt_id}),
            }
            for r, uses, lag, mask, prompt_id in batch.rollouts
        ],
    }


@router.post(
    "/{run_id}/batches/{batch_id}/ack",
    response_model=AckResult,
    responses=errors(
        404,
        (409, "The batch was nacked, or its lease expired"),
        (
            422,
            "The body is malformed, names a rollout the batch does not hold, gives both "
            "logprobs and kl for one rollout, or logprobs not one per token",
        ),
    ),
    openapi_extra=request_body(
        AckBody, required=False, description=RAW_ARRAYS.format("each rollout's logprobs")
    ),
)
async def ack_batch(run_id: RunId, batch_id: LeaseId, request: Request) -> Response:
    training = broker_of(request).training
    rule = training.check_count
    ack = await read_model(request, AckBody, AckMsgpack, counts={"logprobs": rule, "kl": rule})
    return render(await training.ack(run_id, batch_id, ack))


@router.post(
    "/{run_id}/batches/{batch_id}/measure",
    response_model=MeasureResult,
    responses={
        200: msgpack_answer(MeasureResultMsgpack),
        **errors(
            404,
            (409, "The batch was acked or nacked, or its lease expired"),
            (
                422,
                "The body is malformed, names a rollout the batch does not hold, leaves one "
                "of its rollouts out, or gives logprobs not one per token",
            ),
        ),
    },
    openapi_extra=request_body(
        MeasureBody, description=RAW_ARRAYS.format("each rollout's logprobs")
    ),
)
async def measure_batch(run_id: RunId, batch_id: LeaseId, request: Request) -> Response:
    training = broker_of(request).training

    def rule(n: int) -> None:
        training.check_count(n, "measure")

    body = await read_model(request, MeasureBody, MeasureMsgpack, counts={"logprobs": rule})
    got = await training.measure(run_id, batch_id, body.logprobs)
    as_msgpack = wants_msgpack(request)
    arr = _raw if as_msgpack else _same
    ids = got.rollout_ids
    answer = {
        "weights": {rid: arr(w) for rid, w in zip(ids, got.weights, strict=True)},
        "sequence_weights": dict(zip(ids, got.sequence_weights, strict=True)),
        "stats": got.stats,
        "kl_coef": got.kl_coef,
    }
    return render(answer, as_msgpack=as_msgpack)


@router.post(
    "/{run_id}/batches/{batch_id}/nack",
    response_model=NackResult,
    responses=errors(404, (409, "The batch was acked, or its lease expired")),
)
async def nack_batch(run_id: RunId, batch_id: LeaseId, request: Request) -> Response:
    return render(await broker_of(request).training.nack(run_id, batch_id))
