"""A body's cost is bounded before it is parsed: its lists are counted and refused by their
count alone, and its parse stops at the first invalid item. The work done is counted here (the
models' parses started, the validation errors built), not timed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import example, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from pydantic import BaseModel

from app.api import _codec as codec
from app.api import _outline as outline
from app.errors import ValidationFailed
from app.main import create_app
from app.settings import Settings
from tests.api.support import JSON, MSGPACK, asgi_client, assert_error
from tests.helpers import make_run, rollout

N = 100_000  # items: far beyond every count rule, a few hundred kilobytes of body


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The test client, with room for bodies of some megabytes."""
    async with asgi_client(
        create_app(settings.model_copy(update={"max_body_bytes": 8 << 20}))
    ) as c:
        yield c


class Work:
    """The parses started and the validation errors described while a request was answered."""

    def __init__(self) -> None:
        self.parses: list[str] = []
        self.errors: list[int] = []


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Work]:
    seen = Work()
    validate, validate_json = (
        BaseModel.model_validate.__func__,
        BaseModel.model_validate_json.__func__,
    )  # type: ignore[attr-defined]

    def counted(cls: type[BaseModel], *args: Any, **kwargs: Any) -> Any:
        seen.parses.append(cls.__name__)
        return validate(cls, *args, **kwargs)

    def counted_json(cls: type[BaseModel], *args: Any, **kwargs: Any) -> Any:
        seen.parses.append(cls.__name__)
        return validate_json(cls, *args, **kwargs)

    describe = codec.describe_errors

    def described(errors: list[Any], *args: Any, **kwargs: Any) -> str:
        seen.errors.append(len(errors))
        return describe(errors, *args, **kwargs)

    monkeypatch.setattr(BaseModel, "model_validate", classmethod(counted))
    monkeypatch.setattr(BaseModel, "model_validate_json", classmethod(counted_json))
    monkeypatch.setattr(codec, "describe_errors", described)
    yield seen


def _body(doc: Any, fmt: str) -> tuple[bytes, dict[str, str]]:
    if fmt == "json":
        return json.dumps(doc, separators=(",", ":")).encode(), JSON
    return msgpack.packb(doc, use_bin_type=True), MSGPACK


FORMATS = ["json", "msgpack"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "item by item"])
async def test_a_list_of_millions_of_rollouts_is_refused_by_its_count_alone(
    api, work, fmt, streamed, monkeypatch
):
    await make_run(api, "r1")
    work.parses.clear()
    if streamed:
        monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    body, headers = _body({"rollouts": [0] * N}, fmt)
    resp = await api.post("/v1/runs/r1/rollouts", content=body, headers=headers)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert detail == f"{N} rollouts in one request, at most 4096"
    assert work.parses == [] and work.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "item by item"])
async def test_invalid_rollouts_stop_the_parse_at_the_first(api, work, fmt, streamed, monkeypatch):
    await make_run(api, "r1")
    work.parses.clear()
    if streamed:
        monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    body, headers = _body({"rollouts": [0] * 4096}, fmt)
    resp = await api.post("/v1/runs/r1/rollouts", content=body, headers=headers)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert detail.startswith("rollouts.0: ") and "rollouts.1" not in detail, detail
    assert work.errors == [1]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_rollout_of_millions_of_invalid_tokens_is_one_error(api, work, fmt):
    await make_run(api, "r1")
    work.parses.clear()
    r = {"rollout_id": "a", "policy_version": 0, "reward": 0.0, "response_ids": [None] * 4096}
    body, headers = _body({"rollouts": [r]}, fmt)
    resp = await api.post("/v1/runs/r1/rollouts", content=body, headers=headers)
    assert "rollouts.0.response_ids" in assert_error(resp, 422, "ValidationFailed")
    assert work.errors == [2 if fmt == "msgpack" else 1]  # msgpack: the list, or raw bytes


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_registration_of_too_many_prompts_is_refused_by_its_count(api, work, fmt):
    await make_run(api, "r")
    work.parses.clear()
    for doc in ({"prompts": [0] * N}, {"prompts": [{"prompt_id": f"p{i}"} for i in range(N)]}):
        body, headers = _body(doc, fmt)
        resp = await api.post("/v1/runs/r/prompts", content=body, headers=headers)
        detail = assert_error(resp, 422, "ValidationFailed")
        assert detail == f"{N} prompts in one request, at most 4096 prompt passes"
    assert work.parses == [] and work.errors == []


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "item by item"])
async def test_invalid_prompts_stop_the_parse_at_the_first(api, work, fmt, streamed, monkeypatch):
    await make_run(api, "r")
    work.parses.clear()
    if streamed:
        monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    body, headers = _body({"prompts": [{"prompt_id": "a", "p": 1}] * 4096, "epochs": 2}, fmt)
    resp = await api.post("/v1/runs/r/prompts", content=body, headers=headers)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert detail == "prompts.0.p: Extra inputs are not permitted", detail
    assert work.errors == [1]
    # item by item: the other fields, then the first prompt; the others are only read
    assert work.parses == (["PromptsBody", "PromptJSON"] if streamed else ["PromptsBody"])


@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_ack_is_bounded_by_the_largest_batch_and_the_longest_list(api, work, fmt):
    path = "/v1/runs/r/batches/no-such-batch/ack"  # neither exists: the body is refused first
    many = {"logprobs": {f"r{i}": [-1.0] for i in range(10_000)}}
    body, headers = _body(many, fmt)
    detail = assert_error(
        await api.post(path, content=body, headers=headers), 422, "ValidationFailed"
    )
    assert detail == "10000 rollouts named in one ack, at most 8192 (the largest batch)"
    long = {"logprobs": {"a": [None] * 600_000}}
    body, headers = _body(long, fmt)
    detail = assert_error(
        await api.post(path, content=body, headers=headers), 422, "ValidationFailed"
    )
    assert "a list or object in the body holds " in detail and "at most 524288" in detail
    assert work.parses == [] and work.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_body_of_countless_empty_lists_is_refused_before_its_parse(api, work, fmt):
    await make_run(api, "r1")
    work.parses.clear()
    r = {"rollout_id": "a", "policy_version": 0, "reward": 0.0, "response_ids": [1]}
    r["metadata"] = {f"k{i}": [[]] * 4000 for i in range(20)}
    body, headers = _body({"rollouts": [r]}, fmt)
    resp = await api.post("/v1/runs/r1/rollouts", content=body, headers=headers)
    assert "lists and objects" in assert_error(resp, 422, "ValidationFailed")
    assert work.errors == []
    if fmt == "json":
        assert work.parses == []


async def test_small_bodies_have_a_small_limit(api, work):
    body = json.dumps({"max_prompts": 1, "generator_id": "x" * 70_000}).encode()
    resp = await api.post("/v1/runs/r/work", content=body, headers=JSON)
    assert "above the limit of 65536 bytes" in assert_error(resp, 413, "PayloadTooLarge")
    assert work.parses == []


# -- the counting itself ----------------------------------------------------------------------


TRICKY = [
    {"rollouts": [{"a": [1, 2, 3], "m": {"s": 'a]},{"x\\"', "t": "\\\\", "u": "\\"}}, {"a": []}]},
    {"logprobs": {"a": [None] * 10, "b": [1]}, "kl": {}, "step": 3},
    {"prompts": [{"prompt_id": '"[', "data": {"k": [[], [[1, 2]], {}]}}], "epochs": 2},
]


@pytest.mark.parametrize("doc", TRICKY)
@pytest.mark.parametrize("window", [1, 2, 3, 7, 1 << 20])
def test_the_counts_of_a_body_are_those_of_its_parse(doc, window, monkeypatch):
    """Strings holding brackets, quotes and backslashes, counted in windows of any size (a
    backslash run or a string may straddle two)."""
    monkeypatch.setattr(outline, "_WINDOW", window)
    got = outline.json_outline(json.dumps(doc).encode())

    def walk(v: Any, depth: int) -> Iterator[tuple[int, int]]:
        if isinstance(v, (list, dict)):
            yield depth, len(v)
            for item in v.values() if isinstance(v, dict) else v:
                yield from walk(item, depth + 1)

    found = list(walk(doc, 1))
    fields = {k: len(v) for k, v in doc.items() if isinstance(v, (list, dict)) and v}
    assert {k: n for k, n in got.fields.items() if doc[k]} == fields
    assert got.containers == len(found)
    assert got.deepest == max(d for d, _ in found)
    assert got.widest == max(max(n for d, n in found if d != 2), 1)


def _counted_byte_by_byte(body: bytes) -> tuple[int, int, int]:
    """The outline's containers, deepest level and most items of any list or object (named
    fields or not), by a walk over the body a byte at a time: a quote opens or closes a string
    unless an odd run of backslashes is just before it; outside strings a bracket or brace
    opens or closes a level, and a comma parts the items of the one open; the count stops at a
    close with nothing open, a comma outside every list or object, or nesting deeper than
    MAX_DEPTH + 1 (that level counted as the deepest). A list or object counts its commas plus
    one, so far, wherever the count stops."""
    in_string, backslashes, containers, deepest = False, 0, 0, 0
    open_items: list[int] = []
    counts: list[int] = []
    for byte in body:
        if byte == 0x5C:
            backslashes += 1
            continue
        escaped, backslashes = backslashes % 2 == 1, 0
        if byte == 0x22 and not escaped:
            in_string = not in_string
        elif in_string:
            continue
        elif byte in b"[{":
            if len(open_items) + 1 > outline.MAX_DEPTH + 1:
                deepest = max(deepest, len(open_items) + 1)
                break
            open_items.append(0)
            containers += 1
            deepest = max(deepest, len(open_items))
        elif byte in b"]}":
            if not open_items:
                break
            counts.append(open_items.pop() + 1)
        elif byte == ord(","):
            if not open_items:
                break
            open_items[-1] += 1
    counts += [n + 1 for n in open_items]
    return containers, deepest, max(counts, default=0)


@examples(max_examples=400, deadline=None)
@given(
    body=st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b",", b'"', b"\\", b"\\", b"a"])).map(
        b"".join
    ),
    window=st.integers(1, 9),
)
@example(body=b'["a\\\\",1]', window=4)  # two backslashes across windows: the quote ends it
def test_any_bytes_are_counted_as_a_walk_over_them_counts_them(body, window):
    """Whatever the syntax, and in windows of any size (a string, a backslash run or a level
    may straddle several): the outline's counts are those of a walk a byte at a time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outline, "_WINDOW", window)
        got = outline.json_outline(body)
    most = max([got.widest, *got.fields.values()])
    assert (got.containers, got.deepest, most) == _counted_byte_by_byte(body)


def test_a_msgpack_body_holds_its_container_budget_and_not_one_more():
    """``budget`` lists and maps, the top-level list among them, parse; one more is refused."""
    budget = outline.container_budget(0)  # the least budget: that of a body of this size
    within = msgpack.packb([[]] * (budget - 1))
    assert outline.container_budget(len(within) + 1) == budget
    assert len(outline.unpack(within, budget)) == budget - 1
    with pytest.raises(ValidationFailed, match="lists and objects"):
        outline.unpack(msgpack.packb([[]] * budget), budget)


# -- bounds that make the outline needless ---------------------------------------------------


def _at_most(limit: int) -> Any:
    def rule(n: int) -> None:
        if n > limit:
            raise ValidationFailed(f"at most {limit} rollouts a request, not {n}")

    return rule


def _verdict(body: bytes, limit: int, widest: int, *, bounds: bool, monkeypatch: Any) -> str:
    """What check_counts says of ``body`` ('' when it passes), with or without the bounds."""
    with monkeypatch.context() as m:
        if not bounds:
            m.setattr(outline, "within_bounds", lambda *_: False)
        try:
            outline.check_counts(body, "json", {"rollouts": _at_most(limit)}, widest)
        except ValidationFailed as exc:
            return str(exc)
    return ""


def _nested(depth: int) -> Any:
    doc: Any = []
    for _ in range(depth - 2):
        doc = [doc]
    return {"rollouts": [], "m": doc}


BOUNDS_CASES = [
    ({"rollouts": [{"a": 1}] * 5}, 5, 64),  # the rule's own limit: just met
    ({"rollouts": [{"a": 1}] * 6}, 5, 64),  # one beyond it
    ({"rollouts": [], "x": list(range(64))}, 100, 64),  # the widest list: just met
    ({"rollouts": [], "x": list(range(65))}, 100, 64),  # one beyond it
    (_nested(outline.MAX_DEPTH), 100, 64),  # the deepest nesting: just met
    (_nested(outline.MAX_DEPTH + 1), 100, 64),  # one deeper
    ({"rollouts": [{"m": "[[[[{{{{,,,,"}] * 3}, 3, 64),  # brackets and commas in strings
    ({"rollouts": [{"s": "]" * 70}]}, 3, 64),
]


@pytest.mark.parametrize(("doc", "limit", "widest"), BOUNDS_CASES)
def test_the_bounds_never_change_a_verdict(doc, limit, widest, monkeypatch):
    """With or without the byte counts that can make the outline needless, every body gets the
    same answer: each rule met or broken alike, at its limit and one beyond."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    with_bounds = _verdict(body, limit, widest, bounds=True, monkeypatch=monkeypatch)
    without = _verdict(body, limit, widest, bounds=False, monkeypatch=monkeypatch)
    assert with_bounds == without


def test_the_bounds_hold_only_where_no_rule_can_break(monkeypatch):
    small = json.dumps({"rollouts": [{"a": [1, 2]}]}).encode()
    assert outline.within_bounds(small, {"rollouts": _at_most(2)}, 64)
    assert not outline.within_bounds(small, {"rollouts": _at_most(1)}, 64)  # 1 comma: 2 items
    assert not outline.within_bounds(small, {}, 1)  # the widest list
    deep = json.dumps(_nested(outline.MAX_DEPTH + 1)).encode()
    assert not outline.within_bounds(deep, {}, 64)


@pytest.mark.one_node
async def test_a_one_rollout_ingest_is_not_outlined_and_a_deep_one_still_is(api, monkeypatch):
    """The bounds spare a one-rollout body (1,024 tokens) its outline; one whose metadata nests
    deeper than the limit is outlined and refused as before."""
    counted = []
    real = outline.json_outline
    monkeypatch.setattr(outline, "json_outline", lambda body: counted.append(1) or real(body))
    await make_run(api, "r")
    resp = await api.post("/v1/runs/r/rollouts", json={"rollouts": [rollout("a", tokens=1024)]})
    assert resp.status_code == 202, resp.text
    assert counted == []
    deep = rollout("b") | {"metadata": _nested(outline.MAX_DEPTH + 1)["m"]}
    resp = await api.post("/v1/runs/r/rollouts", json={"rollouts": [deep]})
    assert "deeper than 64" in assert_error(resp, 422, "ValidationFailed")
    assert counted == [1]
