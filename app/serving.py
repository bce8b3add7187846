"""How ``serve`` runs uvicorn: with bounds on the connections each API process holds, which
uvicorn alone leaves open. uvicorn times out only a keep-alive connection between two requests;
one that never sends a request, or sends its head a byte at a time, it holds for good, and it
holds as many as arrive. Its HTTP protocol (httptools, else h11) is given here:

- a request head (request line and headers) must arrive in full within ``header_timeout_s`` of
  the connection's opening, or of its first byte after a keep-alive pause; else the connection
  is closed. A request's body is the app's to time (``body_timeout_s``);
- a request head over ``max_header_bytes`` is answered 400 and its connection closed (h11 has
  this bound of its own; httptools has none);
- beyond ``max_connections`` open connections, a new connection's request is answered 503
  (``Unavailable``, with ``Retry-After``) and the connection closed; requests on the
  connections already open are served as before;
- an idle keep-alive connection is closed after ``keep_alive_timeout_s`` (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from uvicorn.protocols.http.h11_impl import H11Protocol

from app.settings import Settings

log = logging.getLogger("rollout_broker")


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    retry_after_s: int


if TYPE_CHECKING:
    _Protocol = H11Protocol  # what the mixin below builds on: either of uvicorn's protocols
else:
    _Protocol = object


class _Bounded(_Protocol):
    """The bounds above, over either of uvicorn's HTTP/1.1 protocols. Both keep the request in
    progress as ``cycle`` (None before the first head; ``response_complete`` once answered)
    and the ASGI app a request head is handed to as ``app``."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self.app = functools.partial(_refuse, retry_after_s=self.limits.retry_after_s)
            _log_full(True, self.limits.max_connections)
        self._time_the_head()

    def data_received(self, data: bytes) -> None:
        if self.awaiting_head():
            self.head_bytes += len(data)
            if self.head_timer is None:  # the first byte after a keep-alive pause
                self._time_the_head()
        super().data_received(data)
        if not self.awaiting_head():
            self._head_done()
        elif self.head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self.send_400_response("Request head over BROKER_MAX_HEADER_BYTES.")

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        super().connection_lost(exc)
        if len(self.connections) < self.limits.max_connections:
            _log_full(False, self.limits.max_connections)

    def awaiting_head(self) -> bool:
        """Whether the connection is between requests: no request in progress or queued."""
        return self.cycle is None or self.cycle.response_complete

    def _time_the_head(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _head_done(self) -> None:
        self.head_bytes = 0
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        # A head h11 took from its buffer outside data_received (a pipelined request) is not
        # late: only a connection still between requests is closed.
        if self.awaiting_head() and not self.transport.is_closing():
            self.transport.close()


class BoundedH11Protocol(_Bounded, H11Protocol):
    pass


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn itself would take h11
    PROTOCOL: type[_Bounded] = BoundedH11Protocol
else:

    class BoundedHttpToolsProtocol(_Bounded, HttpToolsProtocol):  # type: ignore[misc]
        pass

    PROTOCOL = BoundedHttpToolsProtocol


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What ``uvicorn.run`` takes, besides the app and the address, to bound connections as
    ``settings`` say. The protocol comes as a partial of its class with the limits, which
    pickles (by the class's name) to the processes of ``serve --workers``."""
    limits = Limits(
        header_timeout_s=settings.header_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_connections=settings.max_connections,
        retry_after_s=settings.retry_after_s,
    )
    return {
        "http": functools.partial(PROTOCOL, limits=limits),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
    }


_FULL: Final = "this API process holds its BROKER_MAX_CONNECTIONS connections already"
_full = False


def _log_full(full: bool, cap: int) -> None:
    """Say once when the process reaches its connection cap, and once when it is below again."""
    global _full
    if full != _full:
        _full = full
        if full:
            log.warning("%d connections open: new ones are answered 503", cap)
        else:
            log.info("below %d connections again: new ones are served", cap)


async def _refuse(scope: Any, receive: Any, send: Any, *, retry_after_s: int) -> None:
    """The answer to every request of a connection over the cap: 503, and the connection
    closed."""
    body = json.dumps(
        {"error": "Unavailable", "detail": f"{_FULL}: retry later, or another process"}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after_s).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
