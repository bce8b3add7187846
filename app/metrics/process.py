"""This API process's request metrics: the latency histogram, observed by an ASGI middleware,
summed over the processes of one port in prometheus-client's multiprocess mode."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics.catalogue import (
    LATENCY_BUCKETS_S,
    MULTIPROC_DIR,
    REQUEST_SECONDS,
    SPECS,
)

UNMATCHED: Final = "unmatched"
"""The ``route`` of a request no route matched (a 404 or 405): raw paths never become labels."""

_METHODS: Final = {
    m: m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
}  # any other method is labelled "other"
_STATUS_CLASSES: Final = ("1xx", "1xx", "2xx", "3xx", "4xx", "5xx")


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
