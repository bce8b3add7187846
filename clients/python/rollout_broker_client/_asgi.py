"""A blocking httpx transport that drives an ASGI app in this process, for :class:`BrokerClient`
in tests and notebooks (``httpx.ASGITransport`` is async-only)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import httpx

__all__ = ["SyncASGITransport"]


class SyncASGITransport(httpx.BaseTransport):
    """Runs the app on an event loop in a background thread, its lifespan included::

        with SyncASGITransport(create_app(settings)) as transport:
            http = httpx.Client(transport=transport, base_url="http://localhost")
            broker = BrokerClient(http=http)

    ``lifespan=False`` skips start-up and shut-down (for an app whose lifespan already runs).
    The lifespan is the app router's ``lifespan_context`` (Starlette and FastAPI apps).
    """

    def __init__(self, app: Any, *, lifespan: bool = True) -> None:
        self._app = app
        self._inner = httpx.ASGITransport(app=app)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="asgi-transport", daemon=True
        )
        self._lifespan: AbstractAsyncContextManager[Any] | None = None
        self._use_lifespan = lifespan
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._thread.start()
        self._started = True
        if self._use_lifespan:
            self._lifespan = self._app.router.lifespan_context(self._app)
            self._run(self._lifespan.__aenter__())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SyncASGITransport:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self.close()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.start()
        inner = httpx.Request(
            request.method, request.url, headers=request.headers, content=request.read()
        )
        status, headers, body = self._run(self._send(inner))
        return httpx.Response(status, headers=headers, content=body, request=request)

    async def _send(self, request: httpx.Request) -> tuple[int, httpx.Headers, bytes]:
        resp = await self._inner.handle_async_request(request)
        body = await resp.aread()
        return resp.status_code, resp.headers, body

    def close(self) -> None:
        if not self._started or self._loop.is_closed():
            return
        try:
            if self._lifespan is not None:
                lifespan, self._lifespan = self._lifespan, None
                self._run(lifespan.__aexit__(None, None, None))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
