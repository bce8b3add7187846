"""The API description (``/openapi.json``) and its pages (``/docs``, ``/redoc``).

The description is built once per app from its routes, the access table and its settings, so
that it says what this broker does; FastAPI's own description is the starting point:

- **Request bodies.** The handlers read their bodies raw (app/api/codec.py: JSON or msgpack,
  parsed fast), so FastAPI sees none. A route names its body model with :func:`request_body`;
  the body is documented as ``application/json`` and ``application/msgpack`` with the one
  schema, the model's schemas in ``components/schemas`` (renamed ``<Name>-Input`` where a
  response already documents a different schema under that name).
- **Errors.** Every error is ``{"error", "detail"}`` (the ``Error`` component; FastAPI's
  ``HTTPValidationError`` is gone). An operation lists each error status it can answer: those
  its route names with :func:`errors`, and those that follow from what it is (401 and 403 from
  the access table, 408/413/415/422 for a body, 422 for parameters, 404 for a path parameter,
  503 for anything that reaches Redis or Postgres).
- **Bounds.** Where a limit is a setting, the schema shows this app's value
  (:func:`_field_bounds`, :data:`QUERY_BOUNDS`): what the handlers and the broker enforce.
- **Access.** With auth on, every operation that :data:`app.access.policy.ROUTES` does not make
  public requires the ``bearer`` scheme; with auth off none does (the Origin rule's 403 stays).
- **Links** from each answer's ids (``run_id``, ``batch_id``, ``lease_id``, ``token_id``,
  ``next_cursor``) to the operations that take them.

The pages load Swagger UI and ReDoc from this server (the ``fastapi-offline`` package's copies),
never from a CDN, so they work offline. Answers ``405`` list every method of their path.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, get_args

import fastapi_offline
import numpy as np
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.routing import iter_route_contexts
from pydantic import BaseModel, Field
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from rollout_broker_client.protocol import MAX_TOKEN_ID, MSGPACK
from starlette.routing import compile_path
from starlette.staticfiles import StaticFiles

from app.access.policy import PUBLIC, need_of
from app.access.policy import Scope as AccessScope
from app.access.schemas import TokenCreate
from app.access.tokens import ID_HEX
from app.broker.config import RunConfig, RunConfigPatch
from app.broker.schemas import (
    AckBody,
    BatchOut,
    IngestJSON,
    LeasedRolloutOut,
    PromptJSON,
    PromptsBody,
    RolloutJSON,
    WorkBody,
)
from app.ids import LEASE_ID_PATTERN, RUN_ID_PATTERN
from app.settings import Settings

JSON: Final = "application/json"
COMPONENTS: Final = "#/components/schemas/"
ERROR: Final = "Error"
BEARER: Final = "bearer"

# -- what routes declare ---------------------------------------------------------------------

# Models named by routes (bodies, msgpack answers), by placeholder: the description replaces
# each "#/x-model/<key>" reference with the model's component.
_PLACEHOLDER: Final = "#/x-model/"
_MODELS: dict[str, tuple[type[BaseModel], JsonSchemaMode]] = {}


def _placeholder(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, str]:
    key = f"{model.__module__}.{model.__qualname__}:{mode}"
    _MODELS[key] = (model, mode)
    return {"$ref": _PLACEHOLDER + key}


def request_body(
    model: type[BaseModel], *, required: bool = True, description: str | None = None
) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body raw: the body is ``model``, as JSON or
    as msgpack with the same schema. An optional body (``required=False``) may be empty: it
    then reads as ``{}``. ``description`` says what JSON Schema cannot."""
    schema = _placeholder(model, "validation")
    body: dict[str, Any] = {
        "required": required,
        "content": {JSON: {"schema": schema}, MSGPACK: {"schema": dict(schema)}},
    }
    if description is not None:
        body["description"] = description
    return {"requestBody": body}


RAW_ARRAYS: Final = (
    "In a msgpack body, {} may also be raw little-endian bytes: int32 token ids, float32 logprobs."
)


def msgpack_answer(model: type[BaseModel]) -> dict[str, Any]:
    """A ``responses`` entry: the answer is also ``application/msgpack`` (when ``Accept`` asks
    for it), shaped as ``model``."""
    return {"content": {MSGPACK: {"schema": _placeholder(model, "serialization")}}}


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


# -- bounds that are settings ----------------------------------------------------------------

TOKEN_ID: Final[Mapping[str, Any]] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
LOGPROB: Final[Mapping[str, Any]] = {
    "type": "number",
    "maximum": 0,
    "minimum": float(np.finfo(np.float32).min),  # logprobs are stored as float32
}

Keywords = dict[str, Any]


def _field_bounds(s: Settings) -> dict[tuple[type[BaseModel], str], Keywords]:
    """JSON Schema keywords of body fields, from the settings the broker enforces them with
    (app/broker/service.py and packing.py); set on the field's non-null branch."""
    tokens = s.max_tokens_per_rollout
    data: Keywords = {
        "description": f"Free-form JSON, at most {s.max_prompt_data_bytes} bytes as compact "
        "JSON: finite numbers, 64-bit integers, nested at most 16 deep"
    }
    if s.max_prompt_data_bytes < 2:  # even {} is 2 bytes: no object fits
        data = {"type": "null", "description": "This broker takes no prompt data"}
    return {
        (IngestJSON, "rollouts"): {"maxItems": s.max_rollouts_per_request},
        (RolloutJSON, "response_ids"): {"minItems": 1, "maxItems": tokens, "items": TOKEN_ID},
        (RolloutJSON, "prompt_ids"): {"maxItems": tokens, "items": TOKEN_ID},
        (RolloutJSON, "logprobs"): {
            "maxItems": tokens,
            "items": LOGPROB,
            "description": "One per response token (as many as response_ids)",
        },
        (RolloutJSON, "metadata"): {
            "description": "Free-form JSON: finite numbers, 64-bit integers, nested at most 16 deep"
        },
        (AckBody, "logprobs"): {
            "additionalProperties": {"type": "array", "maxItems": tokens, "items": LOGPROB},
            "description": "The current policy's logprobs of each rollout of the batch, one "
            "per response token, by rollout id",
        },
        (PromptsBody, "prompts"): {
            "maxItems": s.max_prompts_per_request,
            "description": f"At most {s.max_prompts_per_request} prompt passes (prompts × "
            "epochs) in one request",
        },
        (PromptJSON, "prompt_ids"): {"maxItems": s.max_tokens_per_prompt, "items": TOKEN_ID},
        (PromptJSON, "data"): data,
        (WorkBody, "max_prompts"): {"maximum": s.max_prompts_per_lease},
        (WorkBody, "wait_s"): {"maximum": s.max_wait_s},
        (TokenCreate, "scopes"): {"uniqueItems": True},
    }


# Rules of a whole body that its model checks in code and JSON Schema can state.
_MODEL_RULES: Final[Mapping[type[BaseModel], Keywords]] = {
    TokenCreate: {  # an admin token touches every run: it names none
        "if": {
            "properties": {"scopes": {"contains": {"const": AccessScope.ADMIN.value}}},
            "required": ["scopes"],
        },
        "then": {"properties": {"runs": {"type": "null"}}},
    },
}


NULLABLE_CONFIG: Final = frozenset(
    name
    for name, field in RunConfig.model_fields.items()
    if type(None) in get_args(field.annotation)
)
"""The RunConfig fields whose value may be null (step_groups: no staleness budget): the only
ones a config patch may set to null (app/api/runs.py refuses the others)."""


def _patch_without_nulls(schemas: dict[str, Any]) -> None:
    """RunConfigPatch as the API takes it: a field is absent or a value, null only where
    :data:`NULLABLE_CONFIG` allows it."""
    name = component_of({"components": {"schemas": schemas}}, RunConfigPatch)
    if name is None:
        return
    for field, prop in schemas[name]["properties"].items():
        if field not in NULLABLE_CONFIG and "anyOf" in prop:
            value = _non_null(prop)
            extra = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
            prop.clear()
            prop.update(value, **extra)


QUERY_BOUNDS: Final[Mapping[tuple[str, str, str], tuple[str, str]]] = {
    ("get", "/v1/runs/{run_id}/batch", "size"): ("maximum", "max_batch_size"),
    ("get", "/v1/runs/{run_id}/batch", "wait_s"): ("maximum", "max_wait_s"),
}
"""(method, path, query parameter) → (keyword, setting) of the bounds that are settings."""

# Path ids: an id of another shape names nothing (404), so the description says which ids can
# exist (ids chosen by the broker match too: uuid4().hex, token_hex).
PATH_IDS: Final[Mapping[str, str]] = {
    "run_id": RUN_ID_PATTERN,
    "batch_id": LEASE_ID_PATTERN,
    "lease_id": LEASE_ID_PATTERN,
    "token_id": f"^[0-9a-f]{{{ID_HEX}}}$",
}

# -- documentation-only models ---------------------------------------------------------------


class LeasedRolloutMsgpack(LeasedRolloutOut):
    """A leased rollout in a msgpack answer: its arrays are raw little-endian bytes."""

    prompt_ids: bytes | None = Field(description="int32 token ids")  # type: ignore[assignment]
    response_ids: bytes = Field(description="int32 token ids")  # type: ignore[assignment]
    logprobs: bytes | None = Field(description="float32 logprobs")  # type: ignore[assignment]


class BatchOutMsgpack(BatchOut):
    """A leased batch as a msgpack answer."""

    rollouts: list[LeasedRolloutMsgpack]  # type: ignore[assignment]


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

_STATE_CHANGING: Final = frozenset({"post", "put", "patch", "delete"})
_METHODS: Final = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


# -- building the description ----------------------------------------------------------------


def describe(base: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The API description of an app with ``settings``, from FastAPI's (``base``, unchanged)."""
    doc = copy.deepcopy(base)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas[ERROR] = dict(ERROR_SCHEMA)
    refs = _add_models(schemas, _used_models(doc))
    _replace_placeholders(doc, refs)
    _bound_fields(schemas, settings)
    _patch_without_nulls(schemas)
    auth = bool(settings.auth)
    for path, method, op in _operations(doc):
        _bound_query(op, method, path, settings)
        _describe_path_ids(op)
        _describe_errors(op, method, path, auth)
    if auth:
        doc["components"]["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
    _add_links(doc)
    return doc


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if method in _METHODS:
                yield path, method, op


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every object of a JSON document, outermost first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _used_models(doc: dict[str, Any]) -> list[str]:
    keys = []
    for node in _walk(doc):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_PLACEHOLDER):
            keys.append(ref.removeprefix(_PLACEHOLDER))
    return list(dict.fromkeys(keys))


def _add_models(schemas: dict[str, Any], keys: list[str]) -> dict[str, str]:
    """Put the schemas of the routes' models (and the models they hold) into ``schemas``;
    returns each placeholder key's reference. A model whose name a response already uses for
    another schema is named ``<Name>-Input`` (validation) or ``<Name>-Output``."""
    if not keys:
        return {}
    inputs = [_MODELS[k] for k in keys]
    top, defs = models_json_schema(inputs, ref_template="#/$defs/{model}")
    found: dict[str, Any] = defs.get("$defs", {})
    modes = {m.__name__: mode for m, mode in inputs}
    names = {name: name for name in found}
    while True:  # a rename changes the schemas that refer to it: until nothing changes
        changed = False
        for name, schema in found.items():
            final = names[name]
            taken = schemas.get(final)
            if final == name and taken is not None and taken != _rewrite(schema, names):
                suffix = "-Output" if modes.get(name) == "serialization" else "-Input"
                names[name] = name + suffix
                changed = True
        if not changed:
            break
    for name, schema in found.items():
        schemas[names[name]] = _rewrite(schema, names)
    return {
        key: _rewrite(top[_MODELS[key]], names)["$ref"]
        for key in keys  # each is a plain reference: the model is among the definitions
    }


def _rewrite(schema: Any, names: Mapping[str, str]) -> Any:
    """``schema`` with its ``#/$defs/<name>`` references pointing into the components."""
    if isinstance(schema, dict):
        out = {k: _rewrite(v, names) for k, v in schema.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            out["$ref"] = COMPONENTS + names[ref.removeprefix("#/$defs/")]
        return out
    if isinstance(schema, list):
        return [_rewrite(v, names) for v in schema]
    return schema


def _replace_placeholders(doc: dict[str, Any], refs: Mapping[str, str]) -> None:
    for node in _walk(doc):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_PLACEHOLDER):
            node["$ref"] = refs[ref.removeprefix(_PLACEHOLDER)]


def component_of(doc: Mapping[str, Any], model: type[BaseModel]) -> str | None:
    """The component name a request body model is documented under, if any."""
    schemas = doc.get("components", {}).get("schemas", {})
    for name in (model.__name__ + "-Input", model.__name__):
        if name in schemas:
            return name
    return None


def _bound_fields(schemas: dict[str, Any], settings: Settings) -> None:
    for (model, field), keywords in _field_bounds(settings).items():
        name = component_of({"components": {"schemas": schemas}}, model)
        if name is None:
            continue  # no route takes it
        prop = schemas[name]["properties"][field]
        target = _non_null(prop)
        if keywords.get("type") == "null":  # nothing but null is accepted
            for key in ("anyOf", "items", "additionalProperties"):
                prop.pop(key, None)
            target = prop
        for key, value in keywords.items():
            (prop if key == "description" else target)[key] = copy.deepcopy(value)
    for model, rules in _MODEL_RULES.items():
        name = component_of({"components": {"schemas": schemas}}, model)
        if name is not None:
            schemas[name].update(copy.deepcopy(rules))


def _non_null(prop: dict[str, Any]) -> dict[str, Any]:
    """The branch of an optional field's ``anyOf`` that is not ``null`` (or the field)."""
    branches: list[dict[str, Any]] = prop.get("anyOf", [])
    for branch in branches:
        if branch.get("type") != "null":
            return branch
    return prop


def _bound_query(op: dict[str, Any], method: str, path: str, settings: Settings) -> None:
    for param in op.get("parameters", ()):
        bound = QUERY_BOUNDS.get((method, path, param["name"]))
        if bound is not None and param.get("in") == "query":
            keyword, setting = bound
            _non_null(param["schema"])[keyword] = getattr(settings, setting)


def _describe_path_ids(op: dict[str, Any]) -> None:
    for param in op.get("parameters", ()):
        pattern = PATH_IDS.get(param["name"])
        if pattern is not None and param.get("in") == "path":
            param["schema"]["pattern"] = pattern


def error_statuses(op: Mapping[str, Any], method: str, path: str, auth: bool) -> set[int]:
    """The error statuses an operation can answer besides those its route names."""
    need = need_of(method.upper(), path)
    out: set[int] = set()
    if need != PUBLIC:
        out.add(503)  # it reaches Redis or Postgres (the guard's token look-up, at least)
        if auth:
            out |= {401, 403}
        elif method in _STATE_CHANGING:
            out.add(403)  # the Origin rule
    if "requestBody" in op:
        out |= {408, 413, 415, 422}
    if op.get("parameters") or method in ("post", "put", "patch"):
        out.add(422)  # parameters, or a body (documented or not) that is validated
    if any(p.get("in") == "path" for p in op.get("parameters", ())):
        out.add(404)  # every path parameter names something that may not exist
    return out


def _describe_errors(op: dict[str, Any], method: str, path: str, auth: bool) -> None:
    responses: dict[str, Any] = op.setdefault("responses", {})
    for status in error_statuses(op, method, path, auth):
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
    if auth and need_of(method.upper(), path) != PUBLIC:
        op["security"] = [{BEARER: []}]


# -- links -----------------------------------------------------------------------------------

_LINKED: Final = ("run_id", "batch_id", "lease_id", "token_id")


def _add_links(doc: dict[str, Any]) -> None:
    """Links from each success answer's ids to the operations that take them in their path
    (the answer's id plus the ids of the request's own path), and from a page's
    ``next_cursor`` to the same listing's next page."""
    schemas = doc["components"]["schemas"]
    ops = list(_operations(doc))
    for _, _, op in ops:
        mine = _path_params(op)
        for key, response in op.get("responses", {}).items():
            if not (key.isdigit() and 200 <= int(key) < 300):
                continue
            fields = _answer_fields(response, schemas)
            links: dict[str, Any] = {}
            for other_path, other_method, other in ops:
                wanted = _path_params(other)
                given = [p for p in wanted if p in fields and p in _LINKED]
                if not given or other is op:
                    continue
                params = {}
                for p in wanted:
                    if p in given:
                        params[p] = f"$response.body#/{p}"
                    elif p in mine:
                        params[p] = f"$request.path.{p}"
                if len(params) == len(wanted):
                    links[_link_name(other, other_method, other_path)] = {
                        "operationId": other["operationId"],
                        "parameters": params,
                    }
            if "next_cursor" in fields and _query_params(op) >= {"cursor"}:
                links["NextPage"] = {
                    "operationId": op["operationId"],
                    "parameters": {
                        **{p: f"$request.path.{p}" for p in mine},
                        "cursor": "$response.body#/next_cursor",
                    },
                }
            if links:
                response["links"] = links


def _path_params(op: Mapping[str, Any]) -> list[str]:
    return [p["name"] for p in op.get("parameters", ()) if p.get("in") == "path"]


def _query_params(op: Mapping[str, Any]) -> set[str]:
    return {p["name"] for p in op.get("parameters", ()) if p.get("in") == "query"}


def _answer_fields(response: Mapping[str, Any], schemas: Mapping[str, Any]) -> set[str]:
    schema = response.get("content", {}).get(JSON, {}).get("schema", {})
    ref = schema.get("$ref", "")
    if ref.startswith(COMPONENTS):
        schema = schemas.get(ref.removeprefix(COMPONENTS), {})
    return set(schema.get("properties", {}))


def _link_name(op: Mapping[str, Any], method: str, path: str) -> str:
    summary = str(op.get("summary") or f"{method} {path}")
    return "".join(word.capitalize() for word in summary.replace("-", " ").split())


# -- 405 answers -----------------------------------------------------------------------------


class PathMethods:
    """Every method a path is served with, over all of an app's routes: what a ``405`` answer's
    ``Allow`` lists. Starlette names only the methods of the first route whose path matched
    (``OPTIONS /v1/runs`` was answered ``Allow: POST``, without ``GET``)."""

    def __init__(self, routes: list[Any]) -> None:
        self.routes = routes  # the app's list: routes included later are in it too
        self._regexes: dict[str, re.Pattern[str]] = {}

    def of(self, path: str) -> list[str]:
        found: set[str] = set()
        for route in iter_route_contexts(self.routes):  # included routers' routes too
            template, methods = route.path, route.methods
            if template is None or not methods:
                continue
            regex = self._regexes.get(template)
            if regex is None:
                regex = self._regexes[template] = compile_path(template)[0]
            if regex.match(path):
                found |= methods
        return sorted(found)


# -- the pages -------------------------------------------------------------------------------

ASSETS_URL: Final = "/docs/assets"
ASSETS_DIR: Final = Path(fastapi_offline.__file__).parent / "static"
"""Swagger UI 5 (which renders OpenAPI 3.1) and ReDoc 2, as the fastapi-offline package ships
them: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png."""


def install_openapi(app: FastAPI) -> None:
    """Describe ``app`` (created with ``docs_url=None, redoc_url=None``) by :func:`describe`
    from its settings (``app.state.settings``) and serve /docs and /redoc with local assets."""
    fastapi_description: Callable[[], dict[str, Any]] = app.openapi
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        base = fastapi_description()  # cached by FastAPI, rebuilt when the routes change
        if built.get("base") is not base:
            built["doc"] = describe(base, app.state.settings)
            built["base"] = base
        doc: dict[str, Any] = built["doc"]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def _docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - docs",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=None,
            # No call to the online validator (swagger.io) for a badge.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def _redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
