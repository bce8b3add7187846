"""Request bodies (JSON or msgpack, size-limited, read under a timeout) and responses (orjson or
msgpack).

A big body is parsed in a worker thread (:func:`sized_call`), so the event loop keeps serving
other requests meanwhile, and it is never held as Python objects all at once: a document of one
list field (``{"rollouts": [...]}``) of :data:`STREAM_BYTES` or more is validated and packed one
item at a time (:func:`pack_items`), with exactly the answers the whole-document parse gives.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import msgpack
import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from rollout_broker_client.protocol import MSGPACK, MSGPACK_TYPES

from app import allocator
from app.api._outline import WIDEST, Counts, check_counts, msgpack_limits, unpack, widest_list
from app.errors import BrokerError, PayloadTooLarge, UnsupportedMediaType, ValidationFailed

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("rollout_broker")

M = TypeVar("M", bound=BaseModel)
J = TypeVar("J", bound=BaseModel)
T = TypeVar("T")
P = ParamSpec("P")

Body = bytes | bytearray

STREAM_BYTES = 4 << 20
"""Bodies of at least this size are parsed in a worker thread, one item at a time: the event loop
then waits at most for one item's parse (pydantic holds the GIL through it), and the memory is
that of one item's Python objects. A smaller body is parsed whole on the event loop, in a few
tens of milliseconds at most: in a thread it would cost more than it saves, as the thread and
the loop take turns with the GIL and each turn can keep the loop waiting 5 ms (the interpreter's
switch interval); with several such bodies in flight, a JSON ingest of 64 rollouts a request
from four generators ran at half the rate."""

_DEFAULT_BODY_TIMEOUT_S = 30.0  # the setting's default, for an app without settings


class RequestTimeout(BrokerError):
    """The client stopped sending its body: no byte for ``BROKER_BODY_TIMEOUT_S``. The answer
    closes the connection, whose request stream is no longer in step."""

    status = 408


class ClientClosedRequest(BrokerError):
    """The client went away before its body was complete (nginx's 499). Nobody reads this
    answer; it ends the request without a traceback."""

    status = 499


def describe_errors(errors: list[Any], limit: int = 5, *, total: int | None = None) -> str:
    """A readable summary of pydantic errors that never echoes the input (which may be NaN);
    ``total`` counts errors beyond those passed in."""
    parts = []
    for e in errors[:limit]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = (len(errors) if total is None else total) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


# -- reading a body ------------------------------------------------------------------------------


def _body_timeout_s(request: Request) -> float:
    settings: Settings | None = getattr(request.app.state, "settings", None)
    return _DEFAULT_BODY_TIMEOUT_S if settings is None else settings.body_timeout_s


async def read_body(request: Request, limit: int, *, timeout_s: float | None = None) -> Body:
    """The request's body, at most ``limit`` bytes (413 beyond), gathered in one buffer (no
    second copy to join chunks; a body that comes in one message is that message's bytes).

    A client that sends no byte for ``timeout_s`` (default: the app's ``body_timeout_s``) is
    answered 408 and its connection closed; one that disconnects mid-body ends the request with
    one log line.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is above the limit of {limit} bytes")
    wait_s = _body_timeout_s(request) if timeout_s is None else timeout_s
    body: bytearray | None = None
    while True:
        try:
            async with asyncio.timeout(wait_s):
                message = await request.receive()
        except TimeoutError:
            got, of = len(body or b""), _of(declared)
            log.warning(
                "%s: no body byte for %g s after %d%s bytes; answered 408, connection closed",
                _where(request),
                wait_s,
                got,
                of,
            )
            raise RequestTimeout(
                f"the body stalled: no byte for {wait_s:g} s after {got}{of} bytes",
                headers={"Connection": "close"},
            ) from None
        if message["type"] == "http.disconnect":
            got, of = len(body or b""), _of(declared)
            log.warning("%s: the client went away after %d%s body bytes", _where(request), got, of)
            raise ClientClosedRequest(f"the client went away after {got}{of} body bytes")
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if body is None and not more and len(chunk) <= limit:
            return chunk  # the whole body in one message: no copy
        if body is None:
            body = bytearray()
        if len(body) + len(chunk) > limit:
            raise PayloadTooLarge(f"body is above the limit of {limit} bytes")
        body += chunk
        if not more:
            return body


def _where(request: Request) -> str:
    return f"{request.method} {request.url.path}"


def _of(declared: str | None) -> str:
    return f" of {declared}" if declared is not None else ""


async def sized_call(size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` for a body of ``size`` bytes: here when it is small, in a worker
    thread from :data:`STREAM_BYTES` on, so that parsing it does not stall the event loop.

    After a big body, the freed pages go back to the OS (glibc's ``malloc_trim``): the worker
    thread's heap is left full of holes between the results it keeps (an item's lists freed
    around its packed bytes), tens of megabytes that no other thread's allocation would reuse.
    """
    if size < STREAM_BYTES:
        return fn(*args, **kwargs)

    def work() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            allocator.release()

    return await asyncio.to_thread(work)


# -- parsing a body ------------------------------------------------------------------------------


def _kind(content_type: str | None) -> str:
    return (content_type or "application/json").split(";", 1)[0].strip().lower()


def _is_json(kind: str) -> bool:
    return kind == "application/json" or kind.endswith("+json")


def _format(content_type: str | None) -> str | None:
    kind = _kind(content_type)
    return "msgpack" if kind in MSGPACK_TYPES else "json" if _is_json(kind) else None


def parse_body(
    body: Body,
    content_type: str | None,
    json_model: type[J],
    msgpack_model: type[M],
    counts: Counts | None = None,
    widest: int = WIDEST,
) -> J | M:
    """Validate a body with the model of its format, after :func:`check_counts`; malformed
    input is one 422."""
    check_counts(body, _format(content_type), counts, widest)
    kind = _kind(content_type)
    try:
        if kind in MSGPACK_TYPES:
            return msgpack_model.model_validate(unpack(body, widest))
        if _is_json(kind):
            return json_model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise ValidationFailed(describe_errors(exc.errors(include_input=False))) from None
    raise UnsupportedMediaType(
        f"content type {kind!r} is not supported; send application/json or application/msgpack"
    )


async def read_model(
    request: Request,
    model: type[J],
    msgpack_model: type[M] | None = None,
    *,
    counts: Counts | None = None,
    limit: int | None = None,
) -> J | M:
    """The request's body, read within ``limit`` bytes (default: the broker's size limit),
    its lists counted (:func:`check_counts`, ``counts`` the rules on its top-level lists) and
    validated with ``model`` (or ``msgpack_model`` for a msgpack body, when it reads
    differently): what every endpoint that takes a body calls. A big body is parsed off the
    event loop (:func:`sized_call`)."""
    settings: Settings = request.app.state.settings
    most = settings.max_body_bytes if limit is None else min(limit, settings.max_body_bytes)
    raw = await read_body(request, most)
    content_type = request.headers.get("content-type")
    return await sized_call(
        len(raw),
        parse_body,
        raw,
        content_type,
        model,
        model if msgpack_model is None else msgpack_model,
        counts,
        widest_list(settings),
    )


class _Malformed(Exception):
    """An item is not well-formed JSON or msgpack: the whole-document parse names the error."""


class _Invalid:
    """The validation errors of one item, located in the whole document."""

    __slots__ = ("errors",)

    def __init__(self, exc: ValidationError, field: str, index: int) -> None:
        errors = exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise _Malformed
        self.errors = [{**e, "loc": (field, index, *e["loc"])} for e in errors]


def pack_items(
    body: Body,
    content_type: str | None,
    field: str,
    items: tuple[type[J], type[M]],
    whole: tuple[type[BaseModel], type[BaseModel]],
    pack: Callable[[Sequence[Any]], list[T]],
    check_count: Callable[[int], None],
    widest: int = WIDEST,
) -> list[T]:
    """``pack(parse_body(body, content_type, *whole).<field>)``, with the same answer and the
    same errors, holding the Python objects of one item at a time. ``check_count`` is the rule
    ``pack`` applies to the number of items, which this checks before any item is parsed.

    ``items`` are the models of one item of the list ``field`` (JSON, msgpack), ``whole`` those
    of the document. A body below :data:`STREAM_BYTES`, or one that is not exactly
    ``{"<field>": [...]}``, takes the whole-document parse. Otherwise the items are validated
    and packed one by one, and the order of the whole parse's answers is kept: the rules on
    the counts first (:func:`check_counts`), then the errors of the first invalid item (the
    parse stops there), then the first item ``pack`` refuses. A body found malformed on the
    way goes to the whole parse, which names the error as it always has.
    """
    counts: Counts = {field: check_count}
    listing = (
        _listing(body, content_type, field, items, widest) if len(body) >= STREAM_BYTES else None
    )
    if listing is None:
        return pack(getattr(parse_body(body, content_type, *whole, counts, widest), field))
    check_counts(body, _format(content_type), counts, widest)
    count, validated = listing
    check_count(count)
    out: list[T] = []
    refused: BrokerError | None = None
    try:
        for item in validated:
            if isinstance(item, _Invalid):
                raise ValidationFailed(describe_errors(item.errors))
            if refused is None:
                try:
                    out.extend(pack([item]))
                except BrokerError as exc:
                    refused = exc  # unless a later item is invalid, which the parse says first
                    out.clear()
    except _Malformed:
        return pack(getattr(parse_body(body, content_type, *whole, counts, widest), field))
    if refused is not None:
        raise refused
    return out


def _listing(
    body: Body, content_type: str | None, field: str, items: tuple[type[J], type[M]], widest: int
) -> tuple[int, Iterator[J | M | _Invalid]] | None:
    """The number of items and an iterator validating them one by one, or None when the body is
    not exactly ``{"<field>": [...]}`` in a format this reads."""
    kind = _kind(content_type)
    if kind in MSGPACK_TYPES:
        found = _msgpack_listing(body, field, widest)
        if found is None:
            return None
        count, unpacker = found
        return count, _msgpack_items(unpacker, count, len(body), field, items[1])
    if _is_json(kind):
        spans = _json_spans(body, field)
        if spans is None:
            return None
        return len(spans), _json_items(body, spans, field, items[0])
    return None


# JSON: where each item of the list lies, found from the positions of the characters that
# shape a document (quotes, backslashes, brackets, braces): numpy finds them a window at a
# time, and Python walks those few (some tens an item) rather than every byte. Each item is
# then parsed by pydantic exactly as within the whole document.
_JSON_HEAD = re.compile(rb'[ \t\n\r]*\{[ \t\n\r]*"([A-Za-z_]+)"[ \t\n\r]*:[ \t\n\r]*\[')
_JSON_BLANK = re.compile(rb"[ \t\n\r]*")
_JSON_COMMA = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_JSON_TAIL = re.compile(rb"[ \t\n\r]*\}[ \t\n\r]*")
_QUOTE, _BACKSLASH, _OPEN_ITEM, _CLOSE_LIST = (ord(c) for c in '"\\{]')
_WINDOW = 1 << 20
# Shaping characters per MiB of body beyond which walking them would cost more than it saves
# (metadata of many small strings or lists): such a body takes the whole-document parse.
_MAX_SHAPING = 1 << 16


def _shaping(body: Body, start: int) -> list[int] | None:
    """The positions of every quote, backslash, bracket and brace from ``start`` on, or None
    when there are too many to walk."""
    found: list[int] = []
    limit = _MAX_SHAPING * (1 + len(body) // _WINDOW)
    for at in range(start, len(body), _WINDOW):
        a = np.frombuffer(body, np.uint8, min(_WINDOW, len(body) - at), at)
        folded = a | 0x20  # '[' and '{', ']' and '}' differ only in that bit
        hits = np.flatnonzero((folded == 0x7B) | (folded == 0x7D) | (a == 0x22) | (a == 0x5C))
        if len(found) + hits.size > limit:
            return None
        found.extend((hits + at).tolist())
    return found


def _json_spans(body: Body, field: str) -> list[tuple[int, int]] | None:
    """The (start, end) of each item of the document's list ``field``; None unless the body is
    ``{"<field>": [...]}`` whose items are objects, with its strings terminated and its
    brackets balanced: any other body takes the whole-document parse."""
    head = _JSON_HEAD.match(body)
    if head is None or head[1] != field.encode():
        return None
    shaping = _shaping(body, head.end())
    if shaping is None:
        return None
    spans: list[tuple[int, int]] = []
    last = head.end()  # where the text between items starts
    depth = 0
    in_string = False
    escaped = -1  # the position a backslash escapes
    for at in shaping:
        c = body[at]
        if in_string:
            if at == escaped:
                continue
            if c == _BACKSLASH:
                escaped = at + 1
            elif c == _QUOTE:
                in_string = False
            continue
        if c == _QUOTE:
            in_string = True
        elif c == _BACKSLASH:  # outside a string: not JSON
            return None
        elif c in b"{[":
            if depth == 0:  # an item starts: after '[' or a comma, and it is an object
                between = _JSON_COMMA if spans else _JSON_BLANK
                if c != _OPEN_ITEM or not between.fullmatch(body, last, at):
                    return None
                start = at
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                spans.append((start, at + 1))
                last = at + 1
        else:  # the list closes
            if c != _CLOSE_LIST or not _JSON_BLANK.fullmatch(body, last, at):
                return None
            return spans if _JSON_TAIL.fullmatch(body, at + 1) else None
    return None  # the list never closes


def _json_items(
    body: Body, spans: list[tuple[int, int]], field: str, model: type[J]
) -> Iterator[J | _Invalid]:
    for i, (start, end) in enumerate(spans):
        try:
            yield model.model_validate_json(body[start:end])
        except ValidationError as exc:
            yield _Invalid(exc, field, i)


# msgpack: a streaming unpacker reads the document's map and list headers, then one item at a
# time, through a reader that copies one slice of the body at a time.
_READ_SIZE = 1 << 20


class _Reader:
    def __init__(self, data: Body) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int) -> bytes:
        chunk = self._view[self._pos : self._pos + n].tobytes()
        self._pos += len(chunk)
        return chunk


def _msgpack_listing(body: Body, field: str, widest: int) -> tuple[int, msgpack.Unpacker] | None:
    unpacker = msgpack.Unpacker(
        _Reader(body),
        **msgpack_limits(len(body), widest),
        read_size=_READ_SIZE,
        max_buffer_size=max(len(body), 2 * _READ_SIZE),
    )
    try:
        if unpacker.read_map_header() != 1 or unpacker.unpack() != field:
            return None
        count: int = unpacker.read_array_header()
    except Exception:  # not a map of one list: the whole parse says what it is
        return None
    return count, unpacker


def _msgpack_items(
    unpacker: msgpack.Unpacker, count: int, size: int, field: str, model: type[M]
) -> Iterator[M | _Invalid]:
    for i in range(count):
        try:
            doc = unpacker.unpack()
        except BrokerError:
            raise
        except Exception:
            raise _Malformed from None
        try:
            yield model.model_validate(doc)
        except ValidationError as exc:
            yield _Invalid(exc, field, i)
    if unpacker.tell() != size:  # bytes after the document
        raise _Malformed


# -- responses -----------------------------------------------------------------------------------


def wants_msgpack(request: Request) -> bool:
    return any(t in request.headers.get("accept", "") for t in MSGPACK_TYPES)


def _default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    raise TypeError


def render(content: Any, *, status_code: int = 200, as_msgpack: bool = False) -> Response:
    if isinstance(content, BaseModel):
        content = content.model_dump()
    if as_msgpack:
        # The packer's own buffer is the body, not a copy of it in a bytes object: a lease of
        # long rollouts answers megabytes.
        packer = msgpack.Packer(use_bin_type=True, default=_msgpack_default, autoreset=False)
        packer.pack(content)
        return Response(packer.getbuffer(), status_code=status_code, media_type=MSGPACK)
    return Response(
        orjson.dumps(content, default=_default, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status_code,
        media_type="application/json",
    )


def _msgpack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    raise TypeError(f"cannot encode {type(obj).__name__}")
