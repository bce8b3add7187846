"""The API description (``/openapi.json``) and its pages (``/docs``, ``/redoc``).

The description is built once per app from its routes, its settings and what each domain adds
(an :class:`OpenAPIPart`, handed in by the composition root, app/main.py), so that it says what
this broker does; FastAPI's own description is the starting point:

- **Request bodies and msgpack answers** (:mod:`app.api._openapi_schemas`): the models routes
  name with :func:`request_body` and :func:`msgpack_answer` become components.
- **Errors** (:mod:`app.api._openapi_errors`): every error status an operation can answer, with
  the one error body.
- **Bounds.** Where a limit is a setting, the schema shows this app's value (the parts'
  ``field_keywords`` and ``query_keywords``): what the handlers and the domains enforce.
- **Access.** With auth on, every operation the access guard stands before (the ``guard`` of a
  part) requires the ``bearer`` scheme; with auth off none does.
- **Query rules** (:mod:`app.api._params`): integers in digits, cursors never empty.
- **Links** (:mod:`app.api._openapi_links`) from each answer's ids (the parts' ``path_ids``)
  and ``next_cursor`` to the operations that take them.

The pages load Swagger UI and ReDoc from this server (the ``fastapi-offline`` package's copies),
never from a CDN, so they work offline.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from pydantic import BaseModel
from starlette.staticfiles import StaticFiles

from app.api._openapi_errors import BEARER, ERROR, ERROR_SCHEMA, GuardErrors, document_errors
from app.api._openapi_links import Operation, add_links
from app.api._openapi_schemas import (
    Keywords,
    drop_nulls,
    non_null,
    place_models,
    set_field_keywords,
    set_model_rules,
)
from app.api._params import describe as describe_query_rules
from app.settings import Settings

FieldKeywords = Mapping[tuple[type[BaseModel], str], Keywords]
"""JSON Schema keywords of body fields, by (model, field name)."""
QueryKeywords = Mapping[tuple[str, str, str], Keywords]
"""JSON Schema keywords of query parameters, by (method, path template, parameter name)."""


def _none(_: Settings) -> Mapping[Any, Keywords]:
    return {}


@dataclass(frozen=True)
class OpenAPIPart:
    """What one domain adds to the API description: what FastAPI cannot see in its routes and
    models. The composition root hands every domain's part to :func:`install_openapi`."""

    field_keywords: Callable[[Settings], FieldKeywords] = _none
    """Keywords of body fields, most from the settings the domain enforces them with; set on the
    field's non-null branch (a ``description`` on the field itself); ``"type": "null"`` leaves
    the field nothing but null."""
    query_keywords: Callable[[Settings], QueryKeywords] = _none
    """Keywords of query parameters (bounds that are settings), set on their non-null branch."""
    model_rules: Mapping[type[BaseModel], Keywords] = field(default_factory=dict)
    """Rules of a whole body that its model checks in code and JSON Schema can state."""
    never_null: Mapping[type[BaseModel], frozenset[str]] = field(default_factory=dict)
    """Body fields optional in their model that the API takes absent or as a value, never null."""
    path_ids: Mapping[str, str] = field(default_factory=dict)
    """The pattern of the ids a path parameter of that name takes; an answer's field of that
    name links to the operations that take it. Every route checks it by the parameter's type (an
    id of another shape is 422 before any store sees it): a route that would take any string
    there fails the description."""
    guard: GuardErrors | None = None
    """What the access guard may answer for each operation (at most one part says it)."""


@dataclass(frozen=True)
class _Parts:
    """All the parts, merged."""

    field_keywords: list[tuple[tuple[type[BaseModel], str], Keywords]]
    query_keywords: dict[tuple[str, str, str], Keywords]
    model_rules: list[tuple[type[BaseModel], Keywords]]
    never_null: list[tuple[type[BaseModel], frozenset[str]]]
    path_ids: dict[str, str]
    guard: GuardErrors | None


def _merge(parts: Sequence[OpenAPIPart], settings: Settings) -> _Parts:
    path_ids: dict[str, str] = {}
    for part in parts:
        for name, pattern in part.path_ids.items():
            if path_ids.setdefault(name, pattern) != pattern:
                raise ValueError(f"two patterns for the path id {name}")
    guards = [part.guard for part in parts if part.guard is not None]
    if len(guards) > 1:
        raise ValueError("more than one part says what the access guard answers")
    return _Parts(
        field_keywords=[kw for p in parts for kw in p.field_keywords(settings).items()],
        query_keywords={k: v for p in parts for k, v in p.query_keywords(settings).items()},
        model_rules=[rule for p in parts for rule in p.model_rules.items()],
        never_null=[fields for p in parts for fields in p.never_null.items()],
        path_ids=path_ids,
        guard=guards[0] if guards else None,
    )


_METHODS: Final = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


# -- building the description ----------------------------------------------------------------


def describe(
    base: dict[str, Any], settings: Settings, parts: Sequence[OpenAPIPart] = ()
) -> dict[str, Any]:
    """The API description of an app with ``settings`` and the domains' ``parts``, from
    FastAPI's (``base``, unchanged)."""
    merged = _merge(parts, settings)
    doc = copy.deepcopy(base)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas[ERROR] = dict(ERROR_SCHEMA)
    place_models(doc)
    set_field_keywords(schemas, merged.field_keywords)
    set_model_rules(schemas, merged.model_rules)
    drop_nulls(schemas, merged.never_null)
    auth = bool(settings.auth)
    ops = list(_operations(doc))
    for path, method, op in ops:
        _set_query_keywords(op, method, path, merged.query_keywords)
        _check_path_ids(op, merged.path_ids)
        document_errors(op, method, path, auth, merged.guard)
    describe_query_rules(doc, ops)
    if auth:
        doc["components"]["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
    add_links(doc, ops, merged.path_ids)
    return doc


def _operations(doc: dict[str, Any]) -> Iterator[Operation]:
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if method in _METHODS:
                yield path, method, op


def _set_query_keywords(
    op: dict[str, Any], method: str, path: str, keywords: Mapping[tuple[str, str, str], Keywords]
) -> None:
    for param in op.get("parameters", ()):
        values = keywords.get((method, path, param["name"]))
        if values is not None and param.get("in") == "query":
            non_null(param["schema"]).update(copy.deepcopy(values))


def _check_path_ids(op: dict[str, Any], path_ids: Mapping[str, str]) -> None:
    for param in op.get("parameters", ()):
        pattern = path_ids.get(param["name"])
        if (
            pattern is not None
            and param.get("in") == "path"
            and param["schema"].get("pattern") != pattern
        ):
            raise ValueError(
                f"{op.get('operationId')}: its path parameter {param['name']} is not of "
                f"the id type that checks {pattern}"
            )


# -- the pages -------------------------------------------------------------------------------

ASSETS_URL: Final = "/docs/assets"
ASSETS_DIR: Final = Path(fastapi_offline.__file__).parent / "static"
"""Swagger UI 5 (which renders OpenAPI 3.1) and ReDoc 2, as the fastapi-offline package ships
them: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png."""


def install_openapi(app: FastAPI, parts: Sequence[OpenAPIPart] = ()) -> None:
    """Describe ``app`` (created with ``docs_url=None, redoc_url=None``) by :func:`describe`
    from its settings (``app.state.settings``) and the domains' ``parts``, and serve /docs and
    /redoc with local assets."""
    parts = tuple(parts)
    fastapi_description: Callable[[], dict[str, Any]] = app.openapi
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        base = fastapi_description()  # cached by FastAPI, rebuilt when the routes change
        if built.get("base") is not base:
            built["doc"] = describe(base, app.state.settings, parts)
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
