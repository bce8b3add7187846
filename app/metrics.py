"""Prometheus metrics (``GET /metrics``): the one owner of every metric name.

Two kinds of figures, rendered together in the Prometheus text format:

- **This process's requests**: :class:`RequestMetrics`, an ASGI middleware, observes every HTTP
  request's latency in ``rollout_broker_http_request_duration_seconds`` by route template
  (``/v1/runs/{run_id}/batch``, never the raw path), method and status class. Each API process
  counts its own requests: scrape every process.
- **The broker's figures**, read at scrape time from Redis and Postgres by
  :func:`collect_broker`: the open runs' buffered and leased rollouts (their live state) and
  their ledger figures (:func:`app.accounting.queries.run_accounting`, what
  ``GET /v1/runs/{run_id}/accounting`` answers). They are the same from every process. Only
  open runs carry a ``run`` label, and at most ``BROKER_METRICS_MAX_RUNS`` of them (the newest,
  in the order of ``GET /v1/runs?status=open``); the others are left out and counted in
  ``rollout_broker_metrics_runs_omitted``.

The collectors of prometheus_client are synchronous, so the scrape reads the stores first, in
the async handler, and then renders a registry built for that one response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.access.policy import Caller
from app.accounting import queries
from app.accounting.stream import EventStream
from app.broker.store import RedisStore, RunState
from app.errors import RunNotFound, outage_of

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "BrokerFigures",
    "ProcessMetrics",
    "RequestMetrics",
    "collect_broker",
    "render_metrics",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

NAMESPACE: Final = "rollout_broker"
REQUEST_SECONDS: Final = f"{NAMESPACE}_http_request_duration_seconds"
OPEN_RUNS: Final = f"{NAMESPACE}_open_runs"
RUNS_OMITTED: Final = f"{NAMESPACE}_metrics_runs_omitted"
STATE_UP: Final = f"{NAMESPACE}_state_up"
BUFFERED: Final = f"{NAMESPACE}_rollouts_buffered"
LEASED: Final = f"{NAMESPACE}_rollouts_leased"
RECEIVED: Final = f"{NAMESPACE}_rollouts_received"  # a counter: exposed with _total
CONSUMED: Final = f"{NAMESPACE}_samples_consumed"
RETIRED: Final = f"{NAMESPACE}_rollouts_retired"
PENDING: Final = f"{NAMESPACE}_accounting_pending_events"
DEAD_LETTERS: Final = f"{NAMESPACE}_accounting_dead_letters"

LATENCY_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Request latency buckets; up to 60 s, the default longest long poll (BROKER_MAX_WAIT_S)."""

UNMATCHED: Final = "unmatched"
"""The ``route`` of a request no route matched (a 404 or 405): raw paths never become labels."""

_METHODS: Final = {
    m: m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
}  # any other method is labelled "other"
_STATUS_CLASSES: Final = ("1xx", "1xx", "2xx", "3xx", "4xx", "5xx")

# Runs whose accounting is read at once during a scrape (one database session each).
_CONCURRENT_RUNS: Final = 4


# -- this process's requests ---------------------------------------------------------------


class ProcessMetrics:
    """This process's metrics (one per app): a registry of its own and the request
    histogram. Built by ``create_app``; the middleware and ``GET /metrics`` share it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Histogram(
            REQUEST_SECONDS,
            "Time from the arrival of an HTTP request to the end of its answer, in this API "
            "process, by route template, method and status class",
            ("route", "method", "status_class"),
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )


class RequestMetrics:
    """ASGI middleware: observes each HTTP request's duration, from its arrival to the end of
    its answer, by route template, method and status class.

    The template is read from the route object the router put in the scope, once per route: the
    histogram's child for each (route, method, status class) is cached, so a request costs a
    clock read, a few dict look-ups and the observation itself. A request that raises before its
    answer starts (answered 500 by the outermost error handler) is observed as ``5xx``."""

    def __init__(self, app: ASGIApp, metrics: ProcessMetrics) -> None:
        self.app = app
        self.histogram = metrics.requests
        self._children: dict[tuple[int, str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # until the answer starts: a request that raises before it is a 5xx

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            elapsed = time.perf_counter() - start
            method = _METHODS.get(scope["method"], "other")
            route = scope.get("route")
            # Routes live as long as the app: their ids are stable keys (routes are unhashable).
            key = (id(route), method, status // 100)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._child(route, method, status // 100)
            child.observe(elapsed)

    def _child(self, route: Any, method: str, status_class: int) -> Any:
        template = getattr(route, "path", None) if route is not None else None
        label = _STATUS_CLASSES[status_class] if 0 < status_class < 6 else "other"
        return self.histogram.labels(template or UNMATCHED, method, label)


# -- the broker's figures ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunFigures:
    run_id: str
    buffered: int
    leased: int
    received: int | None = None  # None: no accounting database
    consumed: int = 0
    retired: dict[str, int] = field(default_factory=dict)
    pending_events: int = 0
    dead_letters: int = 0


@dataclass(frozen=True, slots=True)
class BrokerFigures:
    """What one scrape read from the stores; ``up`` is False when they could not be read."""

    up: bool
    open_runs: int = 0
    omitted: int = 0
    runs: Sequence[RunFigures] = ()


async def collect_broker(
    store: RedisStore,
    stream: EventStream,
    sessionmaker: async_sessionmaker[AsyncSession] | None,
    caller: Caller,
    max_runs: int,
) -> BrokerFigures:
    """The figures of the open runs ``caller`` may touch, the first ``max_runs`` of them with a
    ``run`` label. An unreachable Redis or Postgres gives ``up=False`` instead of an error, so
    the process's own request metrics are still served."""
    try:
        page = await store.list_runs("open", limit=1 << 30)
        states = [s for s in page.runs if caller.may_touch(s.run_id)]
        shown = states[:max_runs]
        gate = asyncio.Semaphore(_CONCURRENT_RUNS)

        async def one(state: RunState) -> RunFigures | None:
            async with gate:
                return await _run_figures(state, stream, sessionmaker)

        got = await asyncio.gather(*(one(s) for s in shown))
    except Exception as exc:
        if outage_of(exc) is None:
            raise
        return BrokerFigures(up=False)
    runs = [f for f in got if f is not None]
    return BrokerFigures(
        up=True, open_runs=len(states), omitted=len(states) - len(shown), runs=runs
    )


async def _run_figures(
    state: RunState, stream: EventStream, sessionmaker: async_sessionmaker[AsyncSession] | None
) -> RunFigures | None:
    buffered, leased = state.live - state.leased, state.leased
    if sessionmaker is None:
        return RunFigures(state.run_id, buffered, leased)
    try:
        async with sessionmaker() as session:
            acc = await queries.run_accounting(session, stream, state.run_id)
    except RunNotFound:  # deleted since it was listed
        return None
    return RunFigures(
        state.run_id,
        buffered,
        leased,
        received=acc.rollouts_received,
        consumed=acc.samples_consumed,
        retired=acc.retired,
        pending_events=acc.pending_events,
        dead_letters=acc.dead_letters,
    )


class _BrokerCollector(Collector):
    """Exposes one scrape's :class:`BrokerFigures` (read beforehand, in the async handler)."""

    def __init__(self, figures: BrokerFigures) -> None:
        self.figures = figures

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics())

    def _metrics(self) -> Iterator[Metric]:
        f = self.figures
        yield GaugeMetricFamily(
            STATE_UP,
            "1 when this scrape read the broker's state from Redis and Postgres, 0 when one of "
            "them was unreachable (the broker figures are then absent)",
            value=1 if f.up else 0,
        )
        if not f.up:
            return
        yield GaugeMetricFamily(
            OPEN_RUNS, "Open runs (the token's, when it is limited to some)", value=f.open_runs
        )
        yield GaugeMetricFamily(
            RUNS_OMITTED,
            "Open runs left out of the per-run figures by BROKER_METRICS_MAX_RUNS",
            value=f.omitted,
        )
        buffered = GaugeMetricFamily(
            BUFFERED, "Rollouts stored and not leased, from the run's live state", labels=["run"]
        )
        leased = GaugeMetricFamily(
            LEASED, "Rollouts in live leases, from the run's live state", labels=["run"]
        )
        received = CounterMetricFamily(
            RECEIVED, "Rollouts accepted at ingest, from the accounting ledger", labels=["run"]
        )
        consumed = CounterMetricFamily(
            CONSUMED,
            "Samples consumed (rollouts in acknowledged batches), from the accounting ledger",
            labels=["run"],
        )
        retired = CounterMetricFamily(
            RETIRED,
            "Rollouts retired, by reason, from the accounting ledger",
            labels=["run", "reason"],
        )
        pending = GaugeMetricFamily(
            PENDING,
            "Accounting events not yet drained into Postgres (the drain backlog)",
            labels=["run"],
        )
        dead = GaugeMetricFamily(
            DEAD_LETTERS,
            "Accounting events the ledger could not apply (see /accounting/dead-letters)",
            labels=["run"],
        )
        ledger = False
        for r in f.runs:
            buffered.add_metric([r.run_id], r.buffered)
            leased.add_metric([r.run_id], r.leased)
            if r.received is None:
                continue
            ledger = True
            received.add_metric([r.run_id], r.received)
            consumed.add_metric([r.run_id], r.consumed)
            for reason, n in r.retired.items():
                retired.add_metric([r.run_id, reason], n)
            pending.add_metric([r.run_id], r.pending_events)
            dead.add_metric([r.run_id], r.dead_letters)
        yield buffered
        yield leased
        if ledger or not f.runs:
            yield from (received, consumed, retired, pending, dead)


def render_metrics(request_registry: CollectorRegistry, figures: BrokerFigures) -> bytes:
    """The text of one scrape: this process's request metrics, then the broker's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_BrokerCollector(figures))
    return generate_latest(request_registry) + generate_latest(registry)
