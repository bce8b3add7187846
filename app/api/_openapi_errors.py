"""The errors of the API description. Every error is ``{"error", "detail"}`` (the ``Error``
component; FastAPI's ``HTTPValidationError`` is gone). An operation lists each error status it
can answer: those its route names with :func:`errors`, and those that follow from what it is
(what the access guard may answer, 408/413/415/422 for a body, 422 for parameters, 404 for a
path parameter, 503 for anything that reaches Redis or Postgres)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Final

from app.api._openapi_schemas import COMPONENTS, JSON

ERROR: Final = "Error"
BEARER: Final = "bearer"

GuardErrors = Callable[[str, str, bool], frozenset[int] | None]
"""For an operation (method, path template) and whether auth is on: the error statuses the access
guard may answer for it, or None when the guard lets every request through (a public one)."""

ERROR_DESCRIPTIONS: Final[Mapping[int, str]] = {
    400: "The request is malformed: a cursor this listing did not hand out",
    401: "No token, or one the broker does not know or has revoked",
    403: "The token lacks the scope or the run (or, with auth off, another web origin asked)",
    404: "No such run, or no such resource of the run",
    408: "The body stalled: no byte for BROKER_BODY_TIMEOUT_S; the connection is closed",
    409: "The request conflicts with the resource's state",
    413: "The body is above BROKER_MAX_BODY_BYTES",
    415: "The body is neither application/json nor application/msgpack",
    422: "The request is malformed, or breaks a rule the description of the operation states",
    429: "The run is at its capacity_rollouts; retry after Retry-After seconds",
    503: "Redis or Postgres is unreachable; retry (after Retry-After seconds when given)",
}


def errors(*statuses: int | tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses`` for the error statuses of its own (``(status, description)``
    to say more than :data:`ERROR_DESCRIPTIONS`); the description adds the body and the
    statuses every operation of its kind can answer."""
    out: dict[int | str, dict[str, Any]] = {}
    for item in statuses:
        status, why = item if isinstance(item, tuple) else (item, ERROR_DESCRIPTIONS[item])
        out[status] = {"description": why}
    return out


ERROR_SCHEMA: Final[Mapping[str, Any]] = {
    "type": "object",
    "title": ERROR,
    "description": "Every error's body",
    "properties": {
        "error": {
            "type": "string",
            "description": "The error's name, e.g. RunNotFound or ValidationFailed",
        },
        "detail": {"type": "string", "description": "What went wrong, for a person"},
    },
    "required": ["error", "detail"],
    "additionalProperties": False,
}

_RETRY_AFTER: Final[Mapping[str, Any]] = {
    "description": "Seconds to wait before retrying",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}
# Headers of error answers: (header, required) by status.
_ERROR_HEADERS: Final[Mapping[int, tuple[tuple[str, Mapping[str, Any], bool], ...]]] = {
    401: (
        (
            "WWW-Authenticate",
            {"description": "Bearer", "schema": {"type": "string"}},
            True,
        ),
    ),
    409: (("Retry-After", _RETRY_AFTER, False),),  # a closed run not yet settled (DELETE)
    429: (("Retry-After", _RETRY_AFTER, True),),
    503: (("Retry-After", _RETRY_AFTER, False),),
}


def error_statuses(
    op: Mapping[str, Any], method: str, path: str, guarded: frozenset[int] | None
) -> set[int]:
    """The error statuses an operation can answer besides those its route names; ``guarded``
    is what the access guard may answer for it (None: the guard lets everything through)."""
    out: set[int] = set()
    if guarded is not None:
        out.add(503)  # it reaches Redis or Postgres (the guard's token look-up, at least)
        out |= guarded
    if "requestBody" in op:
        out |= {408, 413, 415, 422}
    if op.get("parameters") or method in ("post", "put", "patch"):
        out.add(422)  # parameters, or a body (documented or not) that is validated
    if any(p.get("in") == "path" for p in op.get("parameters", ())):
        out.add(404)  # every path parameter names something that may not exist
    return out


def document_errors(
    op: dict[str, Any], method: str, path: str, auth: bool, guard: GuardErrors | None
) -> None:
    """List every error status of ``op`` with the one error body (and the headers its status
    comes with); with auth on, an operation behind the guard requires the ``bearer`` scheme."""
    guarded = guard(method, path, auth) if guard is not None else None
    responses: dict[str, Any] = op.setdefault("responses", {})
    for status in error_statuses(op, method, path, guarded):
        responses.setdefault(str(status), {"description": ERROR_DESCRIPTIONS[status]})
    for key, response in responses.items():
        status = int(key) if key.isdigit() else 0
        if status >= 400:
            if response.get("description") in (None, "", "Validation Error"):
                response["description"] = ERROR_DESCRIPTIONS.get(status, "An error")
            response["content"] = {JSON: {"schema": {"$ref": COMPONENTS + ERROR}}}
            headers = {
                name: {**header, "required": required}
                for name, header, required in _ERROR_HEADERS.get(status, ())
            }
            if headers:
                response["headers"] = copy.deepcopy(headers)
        elif status == 204:
            response.pop("content", None)
    op["responses"] = dict(sorted(responses.items()))
    if auth and guarded is not None:
        op["security"] = [{BEARER: []}]
