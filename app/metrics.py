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
  ``rollout_broker_metrics_runs_omitted``.

The collectors of prometheus_client are synchronous, so the scrape reads the stores first, in
the async handler, and then renders a registry built for that one response.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.access.policy import Caller
from app.accounting import queries
from app.accounting.schemas import RunAccounting
from app.accounting.stream import EventStream
from app.broker.store import RedisStore, RunState
from app.errors import outage_of

__all__ = [
    "CATALOGUE",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS_S",
    "MULTIPROC_DIR",
    "BrokerFigures",
    "MetricSpec",
    "ProcessMetrics",
    "RequestMetrics",
    "collect_broker",
    "render_metrics",
]

# No ``_created`` series: in the text format they are families of their own, which the
# catalogue does not declare and dashboards do not use.
disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's variable: set (before the process starts), every process writes its
request histogram to files in that folder and reads all of them for ``GET /metrics``."""

NAMESPACE: Final = "rollout_broker"

MetricKind = Literal["counter", "gauge", "histogram"]
Source = Literal["process", "state", "ledger"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exposed metric family: its name as scraped (a counter's ends in ``_total``, a
    histogram's has no suffix), kind, labels, help text, and where its figures come from:
    this API process, the broker's live state in Redis, or the accounting ledger (absent when
    the broker runs without a database)."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    help: str
    source: Source


def _m(
    name: str, kind: MetricKind, labels: tuple[str, ...], help: str, source: Source = "ledger"
) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, labels, help, source)


_RUN = ("run",)
_LEDGER = "from the accounting ledger"

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    _m(
        "http_request_duration_seconds",
        "histogram",
        ("route", "method", "status_class"),
        "Time from the arrival of an HTTP request to the end of its answer, in this API "
        "process, by route template, method and status class",
        "process",
    ),
    _m(
        "state_up",
        "gauge",
        (),
        "1 when this scrape read the broker's state from Redis and Postgres, 0 when one of "
        "them was unreachable (the broker figures are then absent)",
        "state",
    ),
    _m("open_runs", "gauge", (), "Open runs (the token's, when it is limited to some)", "state"),
    _m(
        "metrics_runs_omitted",
        "gauge",
        (),
        "Open runs left out of the per-run figures by BROKER_METRICS_MAX_RUNS",
        "state",
    ),
    _m("run_policy_version", "gauge", _RUN, "The run's current policy version", "state"),
    _m(
        "capacity_rollouts",
        "gauge",
        _RUN,
        "The run's capacity_rollouts: buffered + leased rollouts above which ingest answers 429",
        "state",
    ),
    _m(
        "rollouts_buffered",
        "gauge",
        _RUN,
        "Rollouts stored and not leased, from the live state",
        "state",
    ),
    _m("rollouts_leased", "gauge", _RUN, "Rollouts in live leases, from the live state", "state"),
    _m("rollouts_received_total", "counter", _RUN, f"Rollouts accepted at ingest, {_LEDGER}"),
    _m(
        "rollouts_duplicate_total",
        "counter",
        _RUN,
        f"Rollouts posted again under an id already accepted (not stored twice), {_LEDGER}",
    ),
    _m(
        "rollouts_rejected_total",
        "counter",
        ("run", "reason"),
        f"Rollouts refused at ingest by a policy rule, by reason, {_LEDGER}",
    ),
    _m(
        "lease_rollouts_total",
        "counter",
        ("run", "outcome"),
        "Rollouts handed out in leases (outcome=leased) and how their leases ended (acked, "
        f"nacked, expired), {_LEDGER}",
    ),
    _m(
        "batches_total",
        "counter",
        ("run", "outcome"),
        f"Batches leased, and acked, nacked or expired, {_LEDGER}",
    ),
    _m(
        "samples_consumed_total",
        "counter",
        _RUN,
        f"Samples that reached a gradient (rollouts in acknowledged batches), {_LEDGER}",
    ),
    _m(
        "rollouts_retired_total",
        "counter",
        ("run", "reason"),
        f"Rollouts retired, by reason, {_LEDGER}",
    ),
    _m("tokens_generated_total", "counter", _RUN, f"Tokens of the received rollouts, {_LEDGER}"),
    _m(
        "tokens_consumed_total",
        "counter",
        _RUN,
        f"Tokens of the samples that reached a gradient, {_LEDGER}",
    ),
    _m(
        "tokens_wasted_total",
        "counter",
        _RUN,
        f"Tokens of rollouts that retired with no use, {_LEDGER}",
    ),
    _m(
        "sample_lag_versions",
        "histogram",
        _RUN,
        "Lag of the consumed samples in policy versions (the trainer's version at lease minus "
        f"the version that generated the rollout), {_LEDGER}",
    ),
    _m("kl_mean", "gauge", _RUN, "Token-weighted mean KL of the acknowledged samples measured"),
    _m("kl_max", "gauge", _RUN, "Largest per-rollout KL measured in an acknowledgement"),
    _m(
        "importance_ratio_mean",
        "gauge",
        _RUN,
        "Mean importance ratio pi_theta/pi_old over the tokens acknowledged with logprobs",
    ),
    _m(
        "importance_ratio_clip_fraction",
        "gauge",
        _RUN,
        "Share of those tokens whose importance ratio was outside [1-eps, 1+eps]",
    ),
    _m(
        "prompt_passes",
        "gauge",
        ("run", "state"),
        "Prompt passes by state: queued, in_flight (in a generator's work lease), done, "
        f"failed, {_LEDGER}",
    ),
    _m(
        "prompt_passes_registered_total",
        "counter",
        _RUN,
        f"Prompt passes registered (a prompt counts once per epoch), {_LEDGER}",
    ),
    _m(
        "prompt_retries_total",
        "counter",
        _RUN,
        f"Attempts of prompt passes after their first, {_LEDGER}",
    ),
    _m(
        "generator_wait_seconds_total",
        "counter",
        _RUN,
        f"Time generators' requests waited for prompts or staleness budget, {_LEDGER}",
    ),
    _m(
        "trainer_wait_seconds_total",
        "counter",
        _RUN,
        f"Time trainers' lease requests waited for rollouts, {_LEDGER}",
    ),
    _m(
        "accounting_pending_events",
        "gauge",
        _RUN,
        "Accounting events not yet drained into Postgres (the drain backlog)",
    ),
    _m(
        "accounting_drain_delay_seconds",
        "gauge",
        _RUN,
        "Age of the oldest accounting event not yet drained into Postgres; 0 when none is",
    ),
    _m(
        "accounting_dead_letters",
        "gauge",
        _RUN,
        "Accounting events the ledger could not apply (see /accounting/dead-letters)",
    ),
    _m(
        "ledger_mismatch",
        "gauge",
        _RUN,
        "1 when nothing is pending and the ledger's buffered or leased rollouts differ from "
        "the live state's, else 0",
    ),
)
"""Every metric ``GET /metrics`` exposes: the one list of names, kinds, labels and help."""

SPECS: Final[dict[str, MetricSpec]] = {spec.name: spec for spec in CATALOGUE}
REQUEST_SECONDS: Final = f"{NAMESPACE}_http_request_duration_seconds"

LAG_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64)
"""Upper bounds of ``sample_lag_versions``'s buckets, in policy versions."""

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

# A scrape reads the open runs' accounting this many runs at a time, in one database snapshot
# each, and this many such reads at once (one database session each).
_RUNS_PER_READ: Final = 25
_CONCURRENT_READS: Final = 4


# -- this process's requests ---------------------------------------------------------------


class ProcessMetrics:
    """This process's metrics (one per app): a registry of its own and the request
    histogram. Built by ``create_app``; the middleware and ``GET /metrics`` share it.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus-client keeps the histogram's values in a
    file of that folder per process, and the registry holds instead the histogram summed over
    every file: the requests of all the processes of one port, whichever of them is scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        spec = SPECS[REQUEST_SECONDS]
        folder = os.environ.get(MULTIPROC_DIR)
        self.requests = Histogram(
            spec.name,
            spec.help,
            spec.labels,
            buckets=LATENCY_BUCKETS_S,
            registry=None if folder else self.registry,
        )
        if folder:
            self.registry.register(_AllProcesses(folder))


class _AllProcesses(Collector):
    """The process metrics summed over the files of every process in ``folder``, with the
    catalogue's help texts (prometheus-client's merge calls each one "Multiprocess metric").

    Counts of a process that has exited stay in its file and in the sum, as a counter must;
    ``multiprocess.mark_process_dead`` only concerns live gauges, which there are none of."""

    def __init__(self, folder: str) -> None:
        self._merged = MultiProcessCollector(None, folder)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Metric]:
        for metric in self._merged.collect():  # type: ignore[no-untyped-call]
            spec = SPECS.get(metric.name)
            if spec is not None:
                metric.documentation = spec.help
            yield metric


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
class LedgerFigures:
    """A run's figures read from the accounting: its answer to ``GET .../accounting``, the
    rollouts of each lease outcome, the drain's delay and the ledger check."""

    accounting: RunAccounting
    lease_rollouts: dict[str, int]
    drain_delay_s: float
    mismatch: bool


@dataclass(frozen=True, slots=True)
class RunFigures:
    state: RunState
    ledger: LedgerFigures | None  # None: no accounting database


@dataclass(frozen=True, slots=True)
class BrokerFigures:
    """What one scrape read from the stores; ``up`` is False when they could not be read."""

    up: bool
    ledger: bool = False  # the broker keeps an accounting ledger (a database is configured)
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
        runs: list[RunFigures] = [RunFigures(s, None) for s in shown]
        if sessionmaker is not None:
            ledgers = await _ledgers(stream, sessionmaker, [s.run_id for s in shown])
            # A run deleted since it was listed has no ledger read: left out.
            runs = [RunFigures(s, ledgers[s.run_id]) for s in shown if s.run_id in ledgers]
    except Exception as exc:
        if outage_of(exc) is None:
            raise
        return BrokerFigures(up=False)
    return BrokerFigures(
        up=True,
        ledger=sessionmaker is not None,
        open_runs=len(states),
        omitted=len(states) - len(shown),
        runs=runs,
    )


async def _ledgers(
    stream: EventStream, sessionmaker: async_sessionmaker[AsyncSession], run_ids: list[str]
) -> dict[str, LedgerFigures]:
    """The ledger figures of ``run_ids``, read ``_RUNS_PER_READ`` runs at a time
    (:func:`app.accounting.queries.checked_accounting_of`), ``_CONCURRENT_READS`` reads at once."""
    seconds, micros = await stream.redis.time()  # the clock the stream ids were cut by
    now_ms = seconds * 1000 + micros // 1000
    gate = asyncio.Semaphore(_CONCURRENT_READS)

    async def read(chunk: list[str]) -> dict[str, queries.CheckedAccounting]:
        async with gate, sessionmaker() as session:
            return await queries.checked_accounting_of(session, stream, chunk)

    chunks = [run_ids[i : i + _RUNS_PER_READ] for i in range(0, len(run_ids), _RUNS_PER_READ)]
    out: dict[str, LedgerFigures] = {}
    for got in await asyncio.gather(*(read(chunk) for chunk in chunks)):
        for run_id, checked in got.items():
            acc, totals = checked.accounting, checked.totals
            oldest = await stream.oldest_undrained(run_id) if acc.pending_events else None
            out[run_id] = LedgerFigures(
                accounting=acc,
                lease_rollouts={
                    "leased": totals.rollouts_leased,
                    "acked": totals.rollouts_acked,
                    "nacked": totals.rollouts_nacked,
                    "expired": totals.rollouts_expired,
                },
                drain_delay_s=max(0, now_ms - oldest.ms) / 1000 if oldest is not None else 0.0,
                mismatch=checked.check.mismatch,
            )
    return out


def _family(spec: MetricSpec) -> Any:  # a MetricFamily; their add_metric()s differ
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)


def _lag_buckets(histogram: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``le`` buckets of a lag -> samples histogram, and Σ lag."""
    buckets = [
        (str(float(bound)), float(sum(n for lag, n in histogram.items() if lag <= bound)))
        for bound in LAG_BUCKETS
    ]
    buckets.append(("+Inf", float(sum(histogram.values()))))
    return buckets, float(sum(lag * n for lag, n in histogram.items()))


class _BrokerCollector(Collector):
    """Exposes one scrape's :class:`BrokerFigures` (read beforehand, in the async handler)."""

    def __init__(self, figures: BrokerFigures) -> None:
        self.figures = figures

    def collect(self) -> Iterable[Metric]:
        f = self.figures
        families: dict[str, Any] = {s.name: _family(s) for s in CATALOGUE if s.source != "process"}

        def put(name: str, value: float, *labels: str) -> None:
            families[f"{NAMESPACE}_{name}"].add_metric(list(labels), value)

        put("state_up", 1 if f.up else 0)
        if not f.up:
            return [families[f"{NAMESPACE}_state_up"]]
        put("open_runs", f.open_runs)
        put("metrics_runs_omitted", f.omitted)
        for r in f.runs:
            run, state = r.state.run_id, r.state
            put("run_policy_version", state.policy_version, run)
            put("capacity_rollouts", state.config.capacity_rollouts, run)
            put("rollouts_buffered", state.live - state.leased, run)
            put("rollouts_leased", state.leased, run)
            if r.ledger is not None:
                self._ledger(put, families, run, r.ledger)
        return [
            family
            for name, family in families.items()
            if f.ledger or SPECS[name].source != "ledger"
        ]

    @staticmethod
    def _ledger(put: Any, families: dict[str, Any], run: str, ledger: LedgerFigures) -> None:
        acc = ledger.accounting
        put("rollouts_received_total", acc.rollouts_received, run)
        put("rollouts_duplicate_total", acc.duplicates, run)
        for reason, n in acc.rejected.items():
            put("rollouts_rejected_total", n, run, reason)
        for outcome, n in ledger.lease_rollouts.items():
            put("lease_rollouts_total", n, run, outcome)
        for outcome, n in acc.batches.model_dump().items():
            put("batches_total", n, run, outcome)
        put("samples_consumed_total", acc.samples_consumed, run)
        for reason, n in acc.retired.items():
            put("rollouts_retired_total", n, run, reason)
        put("tokens_generated_total", acc.tokens_generated, run)
        put("tokens_consumed_total", acc.tokens_consumed, run)
        put("tokens_wasted_total", acc.wasted_tokens, run)
        buckets, lag_sum = _lag_buckets(acc.lag.histogram)
        families[f"{NAMESPACE}_sample_lag_versions"].add_metric([run], buckets, lag_sum)
        for name, figure in (
            ("kl_mean", acc.kl.mean),
            ("kl_max", acc.kl.max),
            ("importance_ratio_mean", acc.is_ratio.mean),
            ("importance_ratio_clip_fraction", acc.is_ratio.clip_fraction),
        ):
            if figure is not None:  # not measured yet: no sample rather than a made-up 0
                put(name, figure, run)
        for state in ("queued", "in_flight", "done", "failed"):
            put("prompt_passes", getattr(acc.prompts, state), run, state)
        put("prompt_passes_registered_total", acc.prompts.registered, run)
        put("prompt_retries_total", acc.prompts.retried, run)
        put("generator_wait_seconds_total", acc.wait.generator_s, run)
        put("trainer_wait_seconds_total", acc.wait.trainer_s, run)
        put("accounting_pending_events", acc.pending_events, run)
        put("accounting_drain_delay_seconds", ledger.drain_delay_s, run)
        put("accounting_dead_letters", acc.dead_letters, run)
        put("ledger_mismatch", 1 if ledger.mismatch else 0, run)


def render_metrics(request_registry: CollectorRegistry, figures: BrokerFigures) -> bytes:
    """The text of one scrape: this process's request metrics, then the broker's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_BrokerCollector(figures))
    return generate_latest(request_registry) + generate_latest(registry)
