"""Request bodies (JSON or msgpack, size-limited) and responses (orjson or msgpack)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from rollout_broker_client.protocol import MSGPACK, MSGPACK_TYPES

from app.errors import PayloadTooLarge, UnsupportedMediaType, ValidationFailed

M = TypeVar("M", bound=BaseModel)
J = TypeVar("J", bound=BaseModel)


def describe_errors(errors: list[Any], limit: int = 5) -> str:
    """A readable summary of pydantic errors that never echoes the input (which may be NaN)."""
    parts = []
    for e in errors[:limit]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = len(errors) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is above the limit of {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body is above the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def is_msgpack(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() in MSGPACK_TYPES


def parse_body(
    body: bytes, content_type: str | None, json_model: type[J], msgpack_model: type[M]
) -> J | M:
    """Validate a body with the model of its format; malformed input is one 422."""
    kind = (content_type or "application/json").split(";", 1)[0].strip().lower()
    try:
        if kind in MSGPACK_TYPES:
            try:
                doc = msgpack.unpackb(body, raw=False, strict_map_key=True)
            except Exception as exc:
                raise ValidationFailed(
                    f"body is not valid msgpack ({type(exc).__name__}: {exc or 'truncated'})"
                ) from None
            return msgpack_model.model_validate(doc)
        if kind == "application/json" or kind.endswith("+json"):
            return json_model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise ValidationFailed(describe_errors(exc.errors(include_input=False))) from None
    raise UnsupportedMediaType(
        f"content type {kind!r} is not supported; send application/json or application/msgpack"
    )


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
        return Response(
            msgpack.packb(content, use_bin_type=True, default=_msgpack_default),
            status_code=status_code,
            media_type=MSGPACK,
        )
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
