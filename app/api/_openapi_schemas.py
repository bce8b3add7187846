"""The schemas of the API description: the models routes name (request bodies, msgpack answers)
become components, and the keywords the domains give (bounds that are settings, rules of a whole
body, fields never null) are set on them.

The handlers read their bodies raw (:mod:`app.api._codec`: JSON or msgpack, parsed fast), so
FastAPI sees none. A route names its body model with :func:`request_body`; the body is documented
as ``application/json`` and ``application/msgpack`` with the one schema, the model's schemas in
``components/schemas`` (renamed ``<Name>-Input`` where a response already documents a different
schema under that name).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from rollout_broker_client.protocol import MSGPACK

JSON: Final = "application/json"
COMPONENTS: Final = "#/components/schemas/"

Keywords = dict[str, Any]
"""JSON Schema keywords, set on a schema."""

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


# -- the routes' models as components --------------------------------------------------------


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every object of a JSON document, outermost first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def place_models(doc: dict[str, Any]) -> None:
    """Put the schemas of the models the routes name into the components of ``doc``, and point
    the routes' references at them."""
    schemas: dict[str, Any] = doc["components"]["schemas"]
    refs = _add_models(schemas, _used_models(doc))
    for node in walk(doc):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_PLACEHOLDER):
            node["$ref"] = refs[ref.removeprefix(_PLACEHOLDER)]


def _used_models(doc: dict[str, Any]) -> list[str]:
    keys = []
    for node in walk(doc):
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


def component_of(schemas: Mapping[str, Any], model: type[BaseModel]) -> str | None:
    """The component name a request body model is documented under, if any."""
    for name in (model.__name__ + "-Input", model.__name__):
        if name in schemas:
            return name
    return None


# -- what the domains add to the schemas -----------------------------------------------------


def non_null(prop: dict[str, Any]) -> dict[str, Any]:
    """The branch of an optional field's ``anyOf`` that is not ``null`` (or the field)."""
    branches: list[dict[str, Any]] = prop.get("anyOf", [])
    for branch in branches:
        if branch.get("type") != "null":
            return branch
    return prop


def set_field_keywords(
    schemas: dict[str, Any], keywords: Iterable[tuple[tuple[type[BaseModel], str], Keywords]]
) -> None:
    """Set each (model, field)'s keywords on the field's non-null branch (a ``description`` on
    the field itself); ``"type": "null"`` leaves the field nothing but null."""
    for (model, field), values in keywords:
        name = component_of(schemas, model)
        if name is None:
            continue  # no route takes it
        prop = schemas[name]["properties"][field]
        target = non_null(prop)
        if values.get("type") == "null":  # nothing but null is accepted
            for key in ("anyOf", "items", "additionalProperties"):
                prop.pop(key, None)
            target = prop
        for key, value in values.items():
            (prop if key == "description" else target)[key] = copy.deepcopy(value)


def set_model_rules(
    schemas: dict[str, Any], rules: Iterable[tuple[type[BaseModel], Keywords]]
) -> None:
    """Add each model's rules (keywords of the whole body) to its component."""
    for model, values in rules:
        name = component_of(schemas, model)
        if name is not None:
            schemas[name].update(copy.deepcopy(values))


def drop_nulls(
    schemas: dict[str, Any], fields: Iterable[tuple[type[BaseModel], frozenset[str]]]
) -> None:
    """Each model's ``fields`` as the API takes them: absent or a value, never null."""
    for model, never_null in fields:
        name = component_of(schemas, model)
        if name is None:
            continue
        for field, prop in schemas[name]["properties"].items():
            if field in never_null and "anyOf" in prop:
                value = non_null(prop)
                extra = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
                prop.clear()
                prop.update(value, **extra)
