"""The HTTP transport every domain's endpoints use, and nothing of any domain: reading bodies
(JSON or msgpack, size-limited), rendering answers, the request's caller and settings, and the
API description's helpers (what a domain adds to the description is an :class:`OpenAPIPart`).
Its modules are private; the endpoints import from here."""

from app.api._codec import (
    parse_body,
    read_body,
    read_items,
    read_model,
    render,
    sized_call,
    wants_msgpack,
)
from app.api._direct import DirectRoutes
from app.api._errors import install_error_handlers
from app.api._openapi import OpenAPIPart, install_openapi
from app.api._openapi_errors import errors
from app.api._openapi_schemas import RAW_ARRAYS, Keywords, msgpack_answer, request_body
from app.api._outline import SMALL_BODY_BYTES, widest_list
from app.api._params import query_rules
from app.api._state import Session, caller_of, move_actions, sessionmaker_of, settings_of

__all__ = [
    "RAW_ARRAYS",
    "SMALL_BODY_BYTES",
    "DirectRoutes",
    "Keywords",
    "OpenAPIPart",
    "Session",
    "caller_of",
    "errors",
    "install_error_handlers",
    "install_openapi",
    "move_actions",
    "msgpack_answer",
    "parse_body",
    "query_rules",
    "read_body",
    "read_items",
    "read_model",
    "render",
    "request_body",
    "sessionmaker_of",
    "settings_of",
    "sized_call",
    "wants_msgpack",
    "widest_list",
]
