"""An httpx transport for client tests that forwards to the app in-process, records each
exchange, and fails or acts at chosen moments."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx


class Recorder(httpx.AsyncBaseTransport):
    """Forwards to the app; records each exchange, and can fail or act at chosen moments."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.exchanges: list[tuple[httpx.Request, bytes, httpx.Response]] = []
        self.lose_answer: set[str] = set()  # "METHOD path-suffix": drop the answer once
        self.refuse: set[str] = set()  # "METHOD path-suffix": refuse the connection once
        self.on_429: Callable[[], Awaitable[None]] | None = None

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
