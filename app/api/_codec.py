"""Request bodies (JSON or msgpack, size-limited, read under a timeout) and responses (orjson or
msgpack).

A big body is parsed in a worker thread (:func:`sized_call`), so the event loop keeps serving
other requests meanwhile, and it is never held as Python objects all at once: a document of one
big list (``{"rollouts": [...]}``, ``{"prompts": [...], "epochs": 2}``) of :data:`STREAM_BYTES`
or more is validated and packed one item at a time (:func:`pack_items`), with exactly the
answers the whole-document parse gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
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
from app.api._listing import Invalid, Listing, Whole, listing
from app.api._outline import WIDEST, Counts, check_counts, unpack, widest_list
from app.errors import BrokerError, PayloadTooLarge, UnsupportedMediaType, ValidationFailed

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("rollout_broker")

M = TypeVar("M", bound=BaseModel)
J = TypeVar("J", bound=BaseModel)
I = TypeVar("I", bound=BaseModel)  # noqa: E741
W = TypeVar("W", bound=BaseModel)
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
    return _validate(body, content_type, json_model, msgpack_model, widest)


def _validate(
    body: Body, content_type: str | None, json_model: type[J], msgpack_model: type[M], widest: int
) -> J | M:
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


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a body is parsed and packed: a body makes
    thousands of small lists (a rollout's ``versions`` pairs), none in a cycle and each freed by
    its count, and a collection every 700 of them would cost more than the parse itself. A
    parse in another thread may turn it back on early; that costs time, never memory."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def pack_items(
    body: Body,
    content_type: str | None,
    field: str,
    items: tuple[type[I], type[I]],
    whole: tuple[type[W], type[W]],
    pack: Callable[[W, Sequence[I], int], list[T]],
    check_count: Callable[[int], None],
    widest: int = WIDEST,
) -> tuple[W, list[T]]:
    """The document ``parse_body(body, content_type, *whole)`` with its list ``field`` emptied,
    and ``pack(document, list, len(list))``, with the same answers and the same errors, holding
    the Python objects of one item at a time. ``check_count`` is the rule on the number of
    items, checked before any item is parsed.

    ``items`` are the models of one item of the list (JSON, msgpack), ``whole`` those of the
    document. A body below :data:`STREAM_BYTES`, or one that is not an object holding the list
    ``field`` beside other fields (app/api/_listing.py), takes the whole-document parse.
    Otherwise the other fields are validated first, then the items one by one, each packed
    alone (``pack(document, [item], count)``), and the order of the whole parse's answers is
    kept: the rules on the counts first (:func:`check_counts`), then the validation errors (of
    the first invalid item, where the parse stops, and of the other fields), then the first
    refusal of ``pack``. A body found malformed on the way goes to the whole parse, which
    names the error as it always has.
    """
    fmt = _format(content_type)
    check_counts(body, fmt, {field: check_count}, widest)
    listed = listing(body, fmt, field, items, whole, widest) if len(body) >= STREAM_BYTES else None
    if listed is not None:
        check_count(listed.count)
        try:
            return _pack_listed(listed, field, pack)
        except Whole:
            pass
    doc = _validate(body, content_type, *whole, widest)
    held: list[I] = getattr(doc, field)
    setattr(doc, field, [])
    return doc, pack(doc, held, len(held))


async def read_items(
    request: Request,
    field: str,
    items: tuple[type[I], type[I]],
    whole: tuple[type[W], type[W]],
    pack: Callable[[W, Sequence[I], int], list[T]],
    check_count: Callable[[int], None],
) -> tuple[W, list[T]]:
    """The request's body, read within the broker's size limit, and :func:`pack_items` of it:
    what an endpoint whose body is one big list (an ingest, a prompt registration) calls. A big
    body is validated and packed in a worker thread, one item at a time (:func:`sized_call`):
    the event loop keeps serving, and the body's items never all exist as Python objects."""
    settings: Settings = request.app.state.settings
    body = await read_body(request, settings.max_body_bytes)
    content_type = request.headers.get("content-type")
    widest = widest_list(settings)
    return await sized_call(
        len(body), pack_items, body, content_type, field, items, whole, pack, check_count, widest
    )


def _pack_listed(
    listed: Listing[I, W], field: str, pack: Callable[[W, Sequence[I], int], list[T]]
) -> tuple[W, list[T]]:
    try:
        doc, others = listed.rest([]), []
    except ValidationError as exc:
        doc, others = None, exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" or e["loc"][:1] == (field,) for e in others):
            raise Whole from None
    out: list[T] = []
    refused: BrokerError | None = None
    for item in listed.items:
        if isinstance(item, Invalid):
            errors = _placed(item.errors, listed, field) if others else item.errors
            raise ValidationFailed(describe_errors(errors))
        if doc is not None and refused is None:
            try:
                out.extend(pack(doc, [item], listed.count))
            except BrokerError as exc:
                refused = exc  # unless an item is invalid, which the parse says first
                out.clear()
    if doc is None:
        raise ValidationFailed(describe_errors(others))
    if refused is not None:
        raise refused
    return doc, out


def _placed(item_errors: list[Any], listed: Listing[I, W], field: str) -> list[Any]:
    """An invalid item's errors among those of the document's other fields, where the whole
    parse puts them: where it puts those of a list of one invalid item (``null``)."""
    try:
        listed.rest([None])
        return item_errors  # unreachable: null is no item
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
    at = next(i for i, e in enumerate(errors) if e["loc"][:1] == (field,))
    return [*errors[:at], *item_errors, *(e for e in errors[at:] if e["loc"][:1] != (field,))]


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
