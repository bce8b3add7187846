"""The links of the API description: from each answer's ids (those the domains declare as path
ids: ``run_id``, ``batch_id``, ...) to the operations that take them, and from a page's
``next_cursor`` to the same listing's next page."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from app.api._openapi_schemas import COMPONENTS, JSON

Operation = tuple[str, str, dict[str, Any]]
"""(path, method, operation) of the description."""


def add_links(doc: dict[str, Any], ops: Sequence[Operation], linked: Collection[str]) -> None:
    """Links from each success answer's ids (of ``linked``) to the operations that take them in
    their path (the answer's id plus the ids of the request's own path), and from a page's
    ``next_cursor`` to the same listing's next page."""
    schemas = doc["components"]["schemas"]
    for _, _, op in ops:
        mine = _path_params(op)
        for key, response in op.get("responses", {}).items():
            if not (key.isdigit() and 200 <= int(key) < 300):
                continue
            fields = _answer_fields(response, schemas)
            links: dict[str, Any] = {}
            for other_path, other_method, other in ops:
                wanted = _path_params(other)
                given = [p for p in wanted if p in fields and p in linked]
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
