"""Prometheus metrics (``GET /metrics``): the one owner of every metric name.

Two kinds of figures, rendered together in the Prometheus text format:

- **This process's requests**: :class:`RequestMetrics`, an ASGI middleware, observes every HTTP
  request's latency in ``rollout_broker_http_request_duration_seconds`` by route template
  (``/v1/runs/{run_id}/batch``, never the raw path), method and status class. Each API process
  counts its own requests: scrape every process. The processes of one port
  (``rollout-broker serve --workers N``) count theirs in the files of ``PROMETHEUS_MULTIPROC_DIR``
  (prometheus-client's multiprocess mode), and any of them answers with the sum over all.
- **The broker's figures**, read at scrape time from Redis and Postgres by
  :func:`collect_broker`: the open runs' buffered and leased rollouts (their live state) and
  their ledger figures (:func:`app.accounting.queries.run_accounting`, what
  ``GET /v1/runs/{run_id}/accounting`` answers). They are the same from every process. Only
  open runs carry a ``run`` label, and at most ``BROKER_METRICS_MAX_RUNS`` of them (the newest,
  in the order of ``GET /v1/runs?status=open``); the others are left out and counted in
  ``rollout_broker_metrics_runs_omitted``. Per run, the ``BROKER_METRICS_GENERATORS``
  generators with the most rollouts, and every quarantined one, carry a ``generator`` label;
  the others are summed under ``generator="other"`` (app/metrics/generators.py); likewise the
  ``BROKER_METRICS_CONSUMERS`` consumers delivered the most items carry a ``consumer`` label and
  the others are summed under ``consumer="(other)"`` (app/metrics/consumers.py).

The collectors of prometheus_client are synchronous, so the scrape reads the stores first, in
the async handler, and then renders a registry built for that one response.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.accounting.stream import EventStream
from app.api import caller_of, settings_of
from app.metrics.broker import BrokerFigures, collect_broker, render_metrics
from app.metrics.catalogue import (
    CATALOGUE,
    CONTENT_TYPE,
    LATENCY_BUCKETS_S,
    MULTIPROC_DIR,
    SPECS,
    MetricSpec,
)
from app.metrics.process import ProcessMetrics, RequestMetrics

__all__ = [
    "CATALOGUE",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "MULTIPROC_DIR",
    "SPECS",
    "BrokerFigures",
    "MetricSpec",
    "ProcessMetrics",
    "RequestMetrics",
    "collect_broker",
    "render_metrics",
    "router",
]

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
        request.app.state.broker.store,
        EventStream(request.app.state.redis, settings.redis_prefix),
        getattr(request.app.state, "db_sessionmaker", None),
        caller_of(request),
        settings.metrics_max_runs,
        settings.metrics_generators,
        settings.metrics_consumers,
    )
    body = render_metrics(request.app.state.metrics.registry, figures)
    return Response(body, media_type=CONTENT_TYPE)
