"""An httpx transport for client tests that forwards to the app in-process, records each
exchange, and fails or acts at chosen moments."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

# The error names of the statuses a test can have answered in the broker's stead.
_NAMES = {500: "InternalError", 502: "HTTP502", 503: "Unavailable", 504: "HTTP504"}


class Recorder(httpx.AsyncBaseTransport):
    """Forwards to the app; records each exchange, and can fail or act at chosen moments."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.exchanges: list[tuple[httpx.Request, bytes, httpx.Response]] = []
        self.lose_answer: set[str] = set()  # "METHOD path-suffix": drop the answer once
        self.refuse: set[str] = set()  # "METHOD path-suffix": refuse the connection once
        self.on_429: Callable[[], Awaitable[None]] | None = None
        # "METHOD path-suffix": statuses answered in the broker's stead, one a request, in order
        # (the broker never sees those requests); Retry-After is ``retry_after`` when not None.
        self.answer: dict[str, list[int]] = {}
        self.retry_after: str | None = None
        self.answered: list[tuple[httpx.Request, int]] = []

    def _canned(self, request: httpx.Request) -> httpx.Response | None:
        for key, statuses in self.answer.items():
            method, suffix = key.split(" ", 1)
            if statuses and request.method == method and request.url.path.endswith(suffix):
                status = statuses.pop(0)
                self.answered.append((request, status))
                headers = {} if self.retry_after is None else {"retry-after": self.retry_after}
                body = {"error": _NAMES.get(status, "HTTPError"), "detail": "canned"}
                return httpx.Response(status, headers=headers, json=body, request=request)
        return None

    def _match(self, request: httpx.Request, keys: set[str]) -> bool:
        for key in list(keys):
            method, suffix = key.split(" ", 1)
            if request.method == method and request.url.path.endswith(suffix):
                keys.discard(key)
                return True
        return False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._match(request, self.refuse):
            raise httpx.ConnectError("connection refused", request=request)
        canned = self._canned(request)
        if canned is not None:
            return canned
        body = await request.aread()
        resp = await self.inner.handle_async_request(request)
        await resp.aread()
        self.exchanges.append((request, body, resp))
        if self._match(request, self.lose_answer):
            raise httpx.ReadError("connection reset", request=request)
        if resp.status_code == 429 and self.on_429 is not None:
            hook, self.on_429 = self.on_429, None
            await hook()
        return resp
