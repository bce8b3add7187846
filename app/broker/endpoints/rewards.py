"""Reward workers: lease rollouts to score, post their rewards, give back what was not scored."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import (
    SMALL_BODY_BYTES,
    errors,
    msgpack_answer,
    read_model,
    render,
    request_body,
    wants_msgpack,
)
from app.broker.endpoints.deps import broker_of
from app.broker.endpoints.openapi import RewardLeaseOutMsgpack
from app.broker.schemas import (
    ReturnResult,
    RewardLeaseBody,
    RewardLeaseOut,
    RewardReturnBody,
    ScoreBody,
    ScoreResult,
)
from app.ids import LeaseId, RunId

router = APIRouter(prefix="/v1/runs", tags=["rewards"])


@router.post(
    "/{run_id}/rewards/lease",
    response_model=RewardLeaseOut,
    responses={
        200: msgpack_answer(RewardLeaseOutMsgpack),
        204: {"description": "No rollout awaited a reward within wait_s"},
        **errors((409, "The run is closed, or the client-chosen lease_id is over")),
    },
    openapi_extra=request_body(RewardLeaseBody),
)
async def lease_rewards(run_id: RunId, request: Request) -> Response:
    body = await read_model(request, RewardLeaseBody, limit=SMALL_BODY_BYTES)
    lease = await broker_of(request).rewards.lease(run_id, body)
    if lease is None:
        return Response(status_code=204)
    return render(lease, as_msgpack=wants_msgpack(request))


@router.post(
    "/{run_id}/rewards",
    response_model=ScoreResult,
    responses=errors(
        (404, "No such run"),
        (409, "A rollout was scored before with another reward (nothing was scored)"),
        (
            422,
            "The body is malformed, a reward is not finite, the named lease does not exist, "
            "or a rollout was never received or is not in the named lease (nothing was scored)",
        ),
    ),
    openapi_extra=request_body(ScoreBody),
)
async def post_rewards(run_id: RunId, request: Request) -> Response:
    body = await read_model(request, ScoreBody)
    return render(await broker_of(request).rewards.score(run_id, body))


@router.post(
    "/{run_id}/rewards/lease/{lease_id}/return",
    response_model=ReturnResult,
    responses=errors((404, "No such run, or no such reward lease in it")),
    openapi_extra=request_body(RewardReturnBody, required=False),
)
async def return_rewards(run_id: RunId, lease_id: LeaseId, request: Request) -> Response:
    body = await read_model(request, RewardReturnBody)
    n = await broker_of(request).rewards.give_back(run_id, lease_id, body.rollout_ids)
    return render(ReturnResult(returned=n))
