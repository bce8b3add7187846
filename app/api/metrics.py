"""``GET /metrics``: Prometheus text format (the metrics themselves are in :mod:`app.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.access.guard import caller_of
from app.accounting.stream import EventStream
from app.api.deps import broker_of, settings_of
from app.metrics import CONTENT_TYPE, collect_broker, render_metrics

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
            "description": "This process's request metrics and the broker's figures of the "
            "open runs the token may touch, in the Prometheus text format",
        }
    },
)
async def metrics(request: Request) -> Response:
    settings = settings_of(request)
    figures = await collect_broker(
        broker_of(request).store,
        EventStream(request.app.state.redis, settings.redis_prefix),
        getattr(request.app.state, "db_sessionmaker", None),
        caller_of(request),
        settings.metrics_max_runs,
    )
    body = render_metrics(request.app.state.metrics.registry, figures)
    return Response(body, media_type=CONTENT_TYPE)
