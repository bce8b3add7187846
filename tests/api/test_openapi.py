"""``/openapi.json`` tells the truth: every request body (JSON and msgpack), every error status
with the one error body, the bounds this app's settings enforce, the access table's scheme;
405 answers list every method of their path; /docs and /redoc load nothing from elsewhere."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import unicodedata
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any
from urllib.parse import urljoin, urlsplit

import httpx
import msgpack
import pytest
from pydantic import StringConstraints, TypeAdapter, ValidationError

from app.access.policy import PUBLIC, need_of
from app.ids import ITEM_ID_PATTERN, PROMPT_ID_PATTERN
from app.main import create_app
from app.settings import Settings
from tests.api.support import strict_json
from tests.helpers import rollout

MSGPACK = "application/msgpack"
METHODS = ("get", "put", "post", "delete", "patch")

# Every bound that is a setting, away from its default.
CUSTOM = {
    "max_batch_size": 6,
    "max_wait_s": 0.3,
    "max_rollouts_per_request": 3,
    "max_tokens_per_rollout": 5,
    "max_prompts_per_request": 4,
    "max_tokens_per_prompt": 7,
    "max_prompt_data_bytes": 40,
    "max_prompts_per_lease": 2,
}


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield path, method, op


def params(doc: dict[str, Any], method: str, path: str) -> dict[str, dict[str, Any]]:
    return {p["name"]: p["schema"] for p in doc["paths"][path][method].get("parameters", [])}


def value(schema: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an optional field's schema."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") != "null":
            return dict(branch)
    raise AssertionError(schema)


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


# -- the description -----------------------------------------------------------------------------


async def test_every_reference_resolves_and_fastapis_error_schema_is_gone(api):
    doc = strict_json(await api.get("/openapi.json"))
    schemas = doc["components"]["schemas"]
    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["Error"]["required"] == ["error", "detail"]


async def test_every_body_a_handler_reads_is_documented_as_json_and_msgpack(api):
    doc = strict_json(await api.get("/openapi.json"))
    documented = {
        (method, path)
        for path, method, op in operations(doc)
        if set(op.get("requestBody", {}).get("content", {})) == {"application/json", MSGPACK}
    }
    # Every endpoint that reads a body (the domains' endpoints) but /v1/tokens
    # (app/access/endpoints.py, to come: it does not name its model yet).
    assert documented >= {
        ("post", "/v1/runs"),
        ("patch", "/v1/runs/{run_id}/config"),
        ("post", "/v1/runs/{run_id}/policy"),
        ("post", "/v1/runs/{run_id}/rollouts"),
        ("post", "/v1/runs/{run_id}/batches/{batch_id}/ack"),
        ("post", "/v1/runs/{run_id}/prompts"),
        ("post", "/v1/runs/{run_id}/work"),
        ("post", "/v1/runs/{run_id}/work/{lease_id}/return"),
    }
    for path, method, op in operations(doc):
        content = op.get("requestBody", {}).get("content", {})
        if content:
            assert content["application/json"] == content[MSGPACK], (method, path)
    ingest = doc["paths"]["/v1/runs/{run_id}/rollouts"]["post"]["requestBody"]
    assert ingest["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/IngestJSON"
    }
    assert doc["components"]["schemas"]["IngestJSON"]["properties"]["rollouts"]["items"] == {
        "$ref": "#/components/schemas/RolloutJSON"
    }


async def test_every_error_status_is_documented_with_the_error_body(api):
    doc = strict_json(await api.get("/openapi.json"))
    for path, method, op in operations(doc):
        responses = op["responses"]
        for status, response in responses.items():
            if int(status) >= 400:
                assert response["content"] == {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                }, (method, path, status)
        codes = {int(s) for s in responses}
        if "requestBody" in op:
            assert codes >= {413, 415, 422}, (method, path)
        if "{" in path:
            assert 404 in codes, (method, path)
        if need_of(method.upper(), path) != PUBLIC:
            assert 503 in codes, (method, path)
    runs = doc["paths"]["/v1/runs"]
    assert {"409", "422"} <= set(runs["post"]["responses"])
    assert "429" in doc["paths"]["/v1/runs/{run_id}/rollouts"]["post"]["responses"]
    assert "400" in doc["paths"]["/v1/runs/{run_id}/batches"]["get"]["responses"]
    assert (
        "Retry-After"
        in doc["paths"]["/v1/runs/{run_id}/rollouts"]["post"]["responses"]["429"]["headers"]
    )


async def test_answers_that_can_be_msgpack_say_so(api):
    doc = strict_json(await api.get("/openapi.json"))
    lease = doc["paths"]["/v1/runs/{run_id}/batch"]["get"]["responses"]["200"]["content"]
    assert set(lease) == {"application/json", MSGPACK}
    rollout_ref = doc["components"]["schemas"][lease[MSGPACK]["schema"]["$ref"].split("/")[-1]]
    leased = rollout_ref["properties"]["rollouts"]["items"]["$ref"].split("/")[-1]
    ids = doc["components"]["schemas"][leased]["properties"]["response_ids"]
    assert ids["format"] == "binary"  # raw little-endian int32
    work = doc["paths"]["/v1/runs/{run_id}/work"]["post"]["responses"]["200"]["content"]
    assert set(work) == {"application/json", MSGPACK}


@pytest.mark.parametrize("auth", [True, False])
def test_the_access_table_gives_the_security_of_every_operation(settings, auth):
    doc = create_app(settings.model_copy(update={"auth": auth})).openapi()
    assert ("securitySchemes" in doc["components"]) is auth
    for path, method, op in operations(doc):
        need = need_of(method.upper(), path)
        codes = set(op["responses"])
        if need == PUBLIC:
            assert "security" not in op and "401" not in codes, (method, path)
        elif auth:
            assert op["security"] == [{"bearer": []}], (method, path)
            assert {"401", "403"} <= codes, (method, path)
        else:
            assert "security" not in op and "401" not in codes, (method, path)
            # With auth off, a Host the broker does not serve is refused everywhere.
            assert "403" in codes, (method, path)
    if auth:
        assert doc["components"]["securitySchemes"] == {
            "bearer": {"type": "http", "scheme": "bearer"}
        }


# -- bounds --------------------------------------------------------------------------------------


def documented_bounds(doc: dict[str, Any]) -> dict[str, Any]:
    schemas = doc["components"]["schemas"]
    lease = params(doc, "get", "/v1/runs/{run_id}/batch")
    rollout = schemas["RolloutJSON"]["properties"]
    prompt = schemas["PromptJSON"]["properties"]
    work = schemas["WorkBody"]["properties"]
    data = prompt["data"]
    return {
        "max_batch_size": value(lease["size"])["maximum"],
        "max_wait_s": (value(lease["wait_s"])["maximum"], work["wait_s"]["maximum"]),
        "max_rollouts_per_request": schemas["IngestJSON"]["properties"]["rollouts"]["maxItems"],
        "max_tokens_per_rollout": (
            rollout["response_ids"]["maxItems"],
            value(rollout["prompt_ids"])["maxItems"],
            value(rollout["logprobs"])["maxItems"],
        ),
        "max_prompts_per_request": schemas["PromptsBody"]["properties"]["prompts"]["maxItems"],
        "max_tokens_per_prompt": value(prompt["prompt_ids"])["maxItems"],
        "max_prompt_data_bytes": re.search(r"at most (\d+) bytes", data["description"]),
        "max_prompts_per_lease": work["max_prompts"]["maximum"],
    }


@pytest.mark.parametrize("custom", [False, True], ids=["defaults", "custom"])
def test_documented_bounds_are_the_settings(settings, custom):
    s = settings.model_copy(update=CUSTOM if custom else {})
    bounds = documented_bounds(create_app(s).openapi())
    assert bounds.pop("max_wait_s") == (s.max_wait_s, s.max_wait_s)
    assert bounds.pop("max_tokens_per_rollout") == (s.max_tokens_per_rollout,) * 3
    data = bounds.pop("max_prompt_data_bytes")
    assert data is not None and int(data[1]) == s.max_prompt_data_bytes
    assert bounds == {name: getattr(s, name) for name in bounds}


def test_no_prompt_data_is_documented_when_none_fits(settings):
    s = settings.model_copy(update={"max_prompt_data_bytes": 1})  # even {} is 2 bytes
    doc = create_app(s).openapi()
    assert doc["components"]["schemas"]["PromptJSON"]["properties"]["data"]["type"] == "null"


def test_token_ids_and_logprobs_are_bounded_as_the_broker_checks_them(settings):
    doc = create_app(settings).openapi()
    rollout = doc["components"]["schemas"]["RolloutJSON"]["properties"]
    token_id = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
    assert rollout["response_ids"]["items"] == token_id
    assert rollout["response_ids"]["minItems"] == 1
    logprob = value(rollout["logprobs"])["items"]
    assert logprob["maximum"] == 0 and logprob["minimum"] == -3.4028234663852886e38


async def test_the_broker_enforces_the_documented_bounds(settings):
    """Each documented bound, with non-default settings: the bound itself is accepted (or is
    refused for another reason than the bound), one past it is 422."""
    s = settings.model_copy(update=CUSTOM)
    async with serving(s) as c:
        bounds = documented_bounds(strict_json(await c.get("/openapi.json")))
        assert (await c.post("/v1/runs", json={"run_id": "r"})).status_code == 201

        async def lease(**query: Any) -> int:
            return (await c.get("/v1/runs/r/batch", params=query)).status_code

        n = bounds["max_batch_size"]
        assert await lease(size=n) == 204 and await lease(size=n + 1) == 422
        wait = bounds["max_wait_s"][0]
        assert await lease(size=1, wait_s=wait) == 204
        assert await lease(size=1, wait_s=wait + 0.01) == 422

        async def ingest(rollouts: list[dict[str, Any]]) -> int:
            return (await c.post("/v1/runs/r/rollouts", json={"rollouts": rollouts})).status_code

        n = bounds["max_rollouts_per_request"]
        assert await ingest([rollout(f"a{i}") for i in range(n)]) == 202
        assert await ingest([rollout(f"b{i}") for i in range(n + 1)]) == 422
        n = bounds["max_tokens_per_rollout"][0]
        assert await ingest([rollout("c", tokens=n)]) == 202
        assert await ingest([rollout("d", tokens=n + 1)]) == 422

        async def prompts(items: list[dict[str, Any]]) -> int:
            return (await c.post("/v1/runs/r/prompts", json={"prompts": items})).status_code

        n = bounds["max_prompts_per_request"]
        assert await prompts([{"prompt_id": f"p{i}"} for i in range(n)]) == 202
        assert await prompts([{"prompt_id": f"q{i}"} for i in range(n + 1)]) == 422
        n = bounds["max_tokens_per_prompt"]
        assert await prompts([{"prompt_id": "t1", "prompt_ids": [1] * n}]) == 202
        assert await prompts([{"prompt_id": "t2", "prompt_ids": [1] * (n + 1)}]) == 422
        n = int(bounds["max_prompt_data_bytes"][1])
        fits = {"k": "x" * (n - len('{"k":""}'))}  # exactly n bytes as compact JSON
        assert await prompts([{"prompt_id": "d1", "data": fits}]) == 202
        assert await prompts([{"prompt_id": "d2", "data": {"k": fits["k"] + "x"}}]) == 422

        async def work(**body: Any) -> int:
            return (await c.post("/v1/runs/r/work", json=body)).status_code

        n = bounds["max_prompts_per_lease"]
        assert await work(max_prompts=n) == 200 and await work(max_prompts=n + 1) == 422
        assert await work(max_prompts=1, wait_s=wait + 0.01) == 422


# -- bodies the description says are valid -------------------------------------------------------


async def test_a_config_patch_takes_null_only_where_the_description_does(api):
    doc = strict_json(await api.get("/openapi.json"))
    patch = doc["components"]["schemas"]["RunConfigPatch"]["properties"]
    nullable = {name for name, prop in patch.items() if "anyOf" in prop}
    assert nullable == {"difficulty", "generator_kl_max", "kl_coef", "step_groups"}
    assert (await api.post("/v1/runs", json={"run_id": "r"})).status_code == 201
    ok = await api.patch("/v1/runs/r/config", json={"step_groups": None, "max_reuse": 2})
    assert ok.status_code == 200, ok.text
    refused = await api.patch("/v1/runs/r/config", json={"max_reuse": None})
    assert refused.status_code == 422
    assert (
        refused.json()["detail"] == "max_reuse: may not be null "
        "(only difficulty, generator_kl_max, kl_coef, step_groups may)"
    )


async def test_a_msgpack_body_is_read_as_documented(api):
    body = msgpack.packb({"run_id": "m", "config": {"group_size": 2}})
    resp = await api.post("/v1/runs", content=body, headers={"content-type": MSGPACK})
    assert resp.status_code == 201 and resp.json()["config"]["group_size"] == 2


# -- id patterns -------------------------------------------------------------------------------

# ECMA-262's WhiteSpace and LineTerminator: what \s means to a client that reads the patterns as
# JSON Schema says (Python's and Rust's \s differ from it on U+0085 and U+FEFF).
ECMA_SPACE = set("\t\n\v\f\r \xa0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff") | {
    chr(c) for c in range(0x2000, 0x200B)
}


def _refused_in_an_id(c: str) -> bool:
    """No whitespace to any reader, no control or format character (Unicode Cc, Cf: bidi
    controls, zero-width characters, the soft hyphen, tags), no brace."""
    return c.isspace() or c in ECMA_SPACE or unicodedata.category(c) in ("Cc", "Cf") or c in "{}"


@pytest.mark.parametrize("pattern", [ITEM_ID_PATTERN, PROMPT_ID_PATTERN])
def test_an_id_pattern_admits_the_same_characters_for_every_reader(pattern: str) -> None:
    """The published pattern, read by ECMA-262 (OpenAPI clients), Python's re and pydantic's
    Rust regex, admits exactly the characters that are no whitespace to any of them, no control
    or format character and no brace. An id one reader admits and another refuses was a
    schema-valid request answered 422 (U+0085 in a trainer id); bidi controls and zero-width
    characters were admitted, and made an id look like another where it is shown."""
    # Shorthand classes mean different things to different engines; explicit ones do not.
    assert not re.search(r"\\[sSwWdDbBpP]", pattern), pattern
    server = TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)])
    for code in range(0x110000):
        if 0xD800 <= code < 0xE000:
            continue  # surrogates: no UTF-8 form, refused on the way in
        c = chr(code)
        expected = not _refused_in_an_id(c)
        assert (re.fullmatch(pattern, f"a{c}b") is not None) == expected, hex(code)
        try:
            server.validate_python(f"a{c}b")
        except ValidationError:
            assert not expected, hex(code)
        else:
            assert expected, hex(code)


_ECMA_CHECK = """
const [pattern, flags] = JSON.parse(require("fs").readFileSync(0, "utf8"));
const re = new RegExp(pattern, flags);
const refused = [];
for (let c = 0; c < 0x110000; c++) {
  if ((c < 0xd800 || c >= 0xe000) && !re.test("a" + String.fromCodePoint(c) + "b")) refused.push(c);
}
console.log(JSON.stringify(refused));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no ECMA-262 engine (node) here")
@pytest.mark.parametrize("pattern", [ITEM_ID_PATTERN, PROMPT_ID_PATTERN])
def test_an_ecma_262_engine_reads_an_id_pattern_as_the_server_does(pattern: str) -> None:
    """In Unicode mode (as JSON Schema reads patterns) it refuses exactly what the server
    refuses; without it (a reader of older habits) the pattern compiles, and refuses the same
    characters up to U+FFFF (beyond, it reads UTF-16 units and refuses more)."""
    expected = {
        code
        for code in range(0x110000)
        if not 0xD800 <= code < 0xE000 and _refused_in_an_id(chr(code))
    }
    for flags in ("u", ""):
        out = subprocess.run(
            ["node", "-e", _ECMA_CHECK],
            input=json.dumps([pattern, flags]),
            capture_output=True,
            text=True,
            check=True,
        )
        refused = set(json.loads(out.stdout))
        if flags:
            assert refused == expected
        else:
            assert {c for c in refused if c < 0x10000} == {c for c in expected if c < 0x10000}
            assert refused >= expected


# -- 405 -----------------------------------------------------------------------------------------


async def test_a_405_lists_every_method_of_its_path(api):
    doc = strict_json(await api.get("/openapi.json"))
    for path, item in doc["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "x1234567890abcdef", path)
        resp = await api.request("OPTIONS", concrete)
        assert resp.status_code == 405, path
        allowed = {m.strip().lower() for m in resp.headers["allow"].split(",")}
        assert allowed - {"head"} == {m for m in item if m in METHODS}, path
    resp = await api.request("OPTIONS", "/v1/runs")
    assert resp.headers["allow"] == "GET, POST"


# -- the pages -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_docs_pages_load_only_same_origin_assets(api, page):
    resp = await api.get(page)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    html = resp.text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    urls += re.findall(r"""(?:url|spec-url)\s*[:=]\s*["']([^"']+)["']""", html)
    assert urls
    for url in urls:
        absolute = urljoin(f"http://broker{page}", url)
        assert urlsplit(absolute).netloc == "broker", url  # same origin
    assert "://" not in html  # nothing fetched from anywhere else
    scripts = re.findall(r"""<script[^>]*src=["']([^"']+)["']""", html)
    assert scripts
    for url in urls:
        asset = await api.get(url)
        assert asset.status_code == 200, url
        if url in scripts:
            assert "javascript" in asset.headers["content-type"], url
            assert len(asset.content) > 100_000, url  # the real bundle
        elif url.endswith(".json"):
            assert asset.json()["openapi"].startswith("3.")
