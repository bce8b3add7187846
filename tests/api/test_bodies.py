"""Request bodies on the wire: a body that stalls is answered 408 and its connection closed, a
client that goes away mid-body costs one log line, a big ingest is parsed off the event loop one
rollout at a time (other requests are served meanwhile, and the process holds a few times the
body, not the body's rollouts as Python lists), with the answers of the whole-document parse."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from app.api import _codec as codec
from app.api import _listing as listing
from app.api._codec import pack_items, parse_body
from app.broker import service
from app.broker.packing import PackedRollout
from app.broker.prompt_limits import PromptLimits
from app.broker.schemas import (
    IngestJSON,
    IngestMsgpack,
    PromptJSON,
    PromptsBody,
    RolloutJSON,
    RolloutMsgpack,
)
from app.errors import BrokerError
from app.main import create_app
from app.settings import Settings
from app.wiring import broker_for
from tests.api.support import JSON, asgi_client
from tests.helpers import make_run, rollout
from tests.services import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


# -- item by item, the same answers as the whole document -----------------------------------------

BROKER = broker_for(
    Redis.from_url("redis://127.0.0.1:1/0"),  # never connected: packing needs no Redis
    Settings(redis_url="redis://127.0.0.1:1/0", max_rollouts_per_request=4),
)
PACK = BROKER.pack


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _mp(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _rollouts(*ids: str, **fields: Any) -> list[dict[str, Any]]:
    return [{**rollout(rid), **fields} for rid in ids]


GOOD = _rollouts("a", "b", "c")
TRICKY_META = {
    "s": 'a]},{"x": [1, {"y": "}"}]',
    "q": '\\"\\\\',  # a backslash before a quote, and two backslashes
    "u": "\u00e9\u2603",
    "n": [[], {}],
}
J, MP = "json", "msgpack"
VALID = _json({"rollouts": GOOD})
ITEM = _json(GOOD[0])
HEAD = b'{"rollouts": ['

# (name, format, body, parsed item by item: no whole-document parse is needed)
CASES: list[tuple[str, str, bytes, bool]] = [
    ("valid", J, VALID, True),
    ("valid, spaced", J, json.dumps({"rollouts": GOOD}, indent=2).encode(), True),
    ("empty list", J, b' { "rollouts" : [ ] } ', True),
    ("strings with brackets", J, _json({"rollouts": _rollouts("a", metadata=TRICKY_META)}), True),
    ("one invalid item", J, _json({"rollouts": [*GOOD, {"rollout_id": "x"}]}), True),
    ("many invalid items", J, _json({"rollouts": [{"reward": "1"}] * 4}), True),
    ("a non-object item", J, _json({"rollouts": [GOOD[0], 7, None]}), False),
    ("refused by pack", J, _json({"rollouts": _rollouts("a", logprobs=[-1.0])}), True),
    (
        "refused by pack, then invalid",
        J,
        _json({"rollouts": [*_rollouts("a", response_ids=[-1]), {"reward": 1.0}]}),
        True,
    ),
    ("refused by pack twice", J, _json({"rollouts": _rollouts("a", "b", response_ids=[])}), True),
    ("too many", J, _json({"rollouts": _rollouts(*"abcde")}), True),
    ("too many, one invalid", J, _json({"rollouts": [*_rollouts(*"abcd"), {}]}), True),
    (
        "a backslash ending a string",
        J,
        _json({"rollouts": _rollouts("a", metadata={"p": "c:\\"})}),
        True,
    ),
    ("missing comma", J, HEAD + ITEM + ITEM + b"]}", False),
    ("an item closed by a bracket", J, HEAD + ITEM[:-1] + b"]]}", False),
    ("a list item", J, _json({"rollouts": [[GOOD[0]]]}), False),
    ("a backslash outside strings", J, HEAD + ITEM + b"\\]}", False),
    ("trailing comma", J, VALID[:-2] + b",]}", False),
    ("leading comma", J, HEAD + b"," + ITEM + b"]}", False),
    ("double comma", J, HEAD + ITEM + b",," + ITEM + b"]}", False),
    ("bad number inside", J, VALID.replace(b"[1, 2, 3]", b"[1,, 3]"), False),
    ("unclosed list", J, VALID[:-2], False),
    ("unterminated string", J, HEAD + b'{"rollout_id": "a]}', False),
    ("garbage after", J, VALID + b" x", False),
    ("closed by a brace", J, VALID[:-2] + b"}}", False),
    ("another key", J, _json({"rollouts": GOOD, "x": 1}), True),
    ("key first elsewhere", J, _json({"x": 1, "rollouts": GOOD}), True),
    ("escaped key", J, VALID.replace(b'"rollouts"', b'"rollout\\u0073"'), True),
    ("not a list", J, _json({"rollouts": {"a": 1}}), False),
    ("a list at the top", J, _json([GOOD]), False),
    ("bad utf-8 in a string", J, VALID.replace(b'"a"', b'"\xff"'), False),
    ("the key twice", J, VALID[:-1] + b', "rollouts": []}', False),
    ("another key, invalid items", J, _json({"x": 1, "rollouts": [{}, {}], "y": 2}), True),
    ("the key within another field", J, _json({"x": {"rollouts": 1}, "rollouts": GOOD}), True),
    ("a list in another field", J, _json({"x": [[1], {"a": "]"}], "rollouts": GOOD}), True),
    ("malformed another field", J, b'{"x": [1,,2], "rollouts": []}', False),
    (
        "an invalid item, then a malformed one",
        J,
        HEAD + b'{"reward": 1},' + ITEM.replace(b"[1, 2, 3]", b"[1,, 3]") + b"]}",
        False,
    ),
    ("valid", MP, _mp({"rollouts": GOOD}), True),
    (
        "raw arrays",
        MP,
        _mp({"rollouts": _rollouts("a", response_ids=b"\x01\x00\x00\x00", logprobs=None)}),
        True,
    ),
    ("invalid items", MP, _mp({"rollouts": [*GOOD, {"reward": "x"}, 3]}), True),
    ("too many", MP, _mp({"rollouts": _rollouts(*"abcde")}), True),
    ("truncated", MP, _mp({"rollouts": GOOD})[:-3], False),
    ("extra data", MP, _mp({"rollouts": GOOD}) + b"\x00", False),
    ("two keys", MP, _mp({"rollouts": GOOD, "x": 1}), True),
    ("not a map", MP, _mp([GOOD]), False),
    ("a count beyond the items", MP, b"\x81\xa8rollouts\xdd\xff\xff\xff\xff" + _mp(GOOD[0]), True),
    ("an int key in an item", MP, _mp({"rollouts": [{1: 2}]}), False),
    ("another key, invalid items", MP, _mp({"x": 1, "rollouts": [{}, {}], "y": 2}), True),
    ("the key twice", MP, b"\x82" + _mp("rollouts") + _mp(GOOD) + _mp("rollouts") + _mp([]), False),
    (
        "an invalid item, then a string of bad utf-8",
        MP,
        _mp({"rollouts": [{}, {"rollout_id": "Z"}]}).replace(b"\xa1Z", b"\xa1\xff"),
        False,
    ),
]


def _outcome(run: Callable[[], list[PackedRollout]]) -> tuple[str, Any]:
    try:
        return "ok", [(p.rollout_id, p.blob) for p in run()]
    except BrokerError as exc:
        return exc.name, exc.detail


def _whole_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every body takes the item-by-item path from here; the whole-document parses it falls
    back to are counted in the list returned."""
    monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    calls: list[int] = []
    validate = codec._validate

    def counted(*args: Any) -> Any:
        calls.append(1)
        return validate(*args)

    monkeypatch.setattr(codec, "_validate", counted)
    return calls


@pytest.mark.parametrize(
    ("fmt", "body", "itemwise"),
    [pytest.param(fmt, body, itemwise, id=f"{fmt}: {name}") for name, fmt, body, itemwise in CASES],
)
def test_item_by_item_parse_answers_as_the_whole_document(
    fmt: str, body: bytes, itemwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctype = {"json": "application/json", "msgpack": "application/msgpack"}[fmt]
    counts = {"rollouts": BROKER.check_count}
    whole = _outcome(
        lambda: PACK(parse_body(body, ctype, IngestJSON, IngestMsgpack, counts).rollouts)
    )

    calls = _whole_parses(monkeypatch)
    streamed = _outcome(
        lambda: pack_items(
            bytearray(body),
            ctype,
            "rollouts",
            (RolloutJSON, RolloutMsgpack),
            (IngestJSON, IngestMsgpack),
            lambda _doc, rollouts, _count: PACK(rollouts),
            BROKER.check_count,
        )[1]
    )
    assert streamed == whole
    assert not calls if itemwise else calls == [1]


LIMITS = PromptLimits(per_request=4, tokens=8, data_bytes=64)
P = [{"prompt_id": "a", "prompt_ids": [1, 2]}, {"prompt_id": "b", "data": {"k": "]}"}}]

# (name, format, body, parsed item by item)
PROMPT_CASES: list[tuple[str, str, bytes, bool]] = [
    ("valid", J, _json({"prompts": P, "epochs": 2}), True),
    ("epochs first", J, _json({"epochs": 2, "prompts": P}), True),
    ("no epochs", J, _json({"prompts": P}), True),
    ("epochs invalid", J, _json({"prompts": P, "epochs": 0}), True),
    ("epochs a whole float", J, _json({"epochs": 2.0, "prompts": P}), True),
    ("epochs and a prompt invalid", J, _json({"epochs": "2", "prompts": [*P, {}]}), True),
    (
        "other keys, epochs and a prompt invalid",
        J,
        _json({"x": 1, "epochs": 0, "prompts": [{"p": 1}, {}], "y": [2]}),
        True,
    ),
    ("too many passes", J, _json({"prompts": P, "epochs": 3}), True),
    ("too many passes, then invalid", J, _json({"prompts": [*P, {}], "epochs": 2}), True),
    (
        "too many prompt_ids",
        J,
        _json({"prompts": [{"prompt_id": "a", "prompt_ids": [1] * 9}]}),
        True,
    ),
    ("data too big", J, _json({"prompts": [{"prompt_id": "a", "data": {"k": "x" * 64}}]}), True),
    ("too many prompts", J, _json({"prompts": [{}] * 5}), True),
    ("a number in the list", J, _json({"prompts": [P[0], 0]}), False),
    ("epochs twice", J, _json({"prompts": P, "epochs": 0})[:-1] + b', "epochs": 1}', True),
    ("valid", MP, _mp({"prompts": P, "epochs": 2}), True),
    ("epochs first", MP, _mp({"epochs": 2, "prompts": P}), True),
    ("epochs and a prompt invalid", MP, _mp({"epochs": "2", "x": 1, "prompts": [*P, {}]}), True),
    ("too many passes", MP, _mp({"prompts": P, "epochs": 3}), True),
    ("not a list", MP, _mp({"prompts": 1, "epochs": 3}), False),
]


@pytest.mark.parametrize(
    ("fmt", "body", "itemwise"),
    [pytest.param(f, b, i, id=f"{f}: {name}") for name, f, b, i in PROMPT_CASES],
)
def test_prompts_item_by_item_answer_as_the_whole_document(
    fmt: str, body: bytes, itemwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctype = {"json": "application/json", "msgpack": "application/msgpack"}[fmt]

    def outcome(run: Callable[[], tuple[int, list[tuple[str, bytes]]]]) -> tuple[str, Any]:
        try:
            return "ok", run()
        except BrokerError as exc:
            return exc.name, exc.detail

    def whole() -> tuple[int, list[tuple[str, bytes]]]:
        doc = parse_body(body, ctype, PromptsBody, PromptsBody, {"prompts": LIMITS.check_count})
        return doc.epochs, LIMITS.pack(doc, doc.prompts, len(doc.prompts))

    expected = outcome(whole)
    calls = _whole_parses(monkeypatch)

    def streamed() -> tuple[int, list[tuple[str, bytes]]]:
        doc, packed = pack_items(
            bytearray(body), ctype, "prompts", (PromptJSON, PromptJSON),
            (PromptsBody, PromptsBody), LIMITS.pack, LIMITS.check_count,
        )  # fmt: skip
        assert doc.prompts == []
        return doc.epochs, packed

    assert outcome(streamed) == expected
    assert not calls if itemwise else calls == [1]


def test_a_body_of_too_many_strings_and_brackets_takes_the_whole_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = _json({"rollouts": _rollouts("a", "b", metadata=TRICKY_META)})
    monkeypatch.setattr(codec, "STREAM_BYTES", 0)
    assert listing.json_spans(body, "rollouts") is not None
    monkeypatch.setattr(listing, "_MAX_SHAPING", 10)
    assert listing.json_spans(body, "rollouts") is None
    _, packed = pack_items(
        body, "application/json", "rollouts", (RolloutJSON, RolloutMsgpack),
        (IngestJSON, IngestMsgpack), lambda _doc, rs, _n: PACK(rs), BROKER.check_count,
    )  # fmt: skip
    assert [p.rollout_id for p in packed] == ["a", "b"]


# -- a big ingest does not hold up other requests --------------------------------------------------


def _big_json(n: int, tokens: int) -> bytes:
    ids = ",".join(["7"] * tokens)
    lps = ",".join(["-0.5"] * tokens)
    items = [
        f'{{"rollout_id":"big-{i}","policy_version":0,"reward":1.0,'
        f'"response_ids":[{ids}],"logprobs":[{lps}]}}'
        for i in range(n)
    ]
    return ('{"rollouts":[' + ",".join(items) + "]}").encode()


async def test_healthz_is_answered_while_a_maximal_ingest_is_parsed(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first rollout's packing waits until /healthz has been answered: with the parse on
    the event loop, /healthz could only be answered once that wait had timed out."""
    limit = 8 << 20
    body = _big_json(11, 99_000)  # parsed one rollout at a time (from 4 MiB on)
    assert len(body) <= limit
    packing, answered = threading.Event(), threading.Event()
    pack_rollouts = service.pack_rollouts

    released: list[bool] = []

    def held(rollouts: Sequence[Any], max_tokens: int) -> list[PackedRollout]:
        items = list(rollouts)  # a count alone (the rules on it) holds nothing
        if items and not packing.is_set():
            packing.set()
            # On the event loop this holds the loop, and /healthz with it, until the timeout.
            released.append(answered.wait(10))
        return pack_rollouts(items, max_tokens)

    monkeypatch.setattr(service, "pack_rollouts", held)
    order: list[str] = []
    app = create_app(settings.model_copy(update={"max_body_bytes": limit}))
    async with asgi_client(app) as api:
        await make_run(api, "big")

        async def ingest() -> httpx.Response:
            resp = await api.post("/v1/runs/big/rollouts", content=body, headers=JSON)
            order.append("ingest")
            return resp

        posted = asyncio.create_task(ingest())
        assert await asyncio.to_thread(packing.wait, 10)
        health = await api.get("/healthz")
        order.append("healthz")
        answered.set()
        resp = await posted
    assert health.status_code == 200
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 11, "duplicates": 0, "rejected": []}
    assert released == [True]  # /healthz was answered while the parse was held
    assert order == ["healthz", "ingest"]


# -- stalled and abandoned bodies, in-process ----------------------------------------------------


def _scope(path: str, length: int) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % length)],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }


async def _call(app: FastAPI, scope: dict[str, Any], messages: list[dict[str, Any]]) -> list[Any]:
    """Run one request through the app: ``messages`` are received in turn, then nothing ever
    comes (a client that stopped sending). Returns what the app sent."""
    queue = list(messages)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()  # never set
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=20)
    return sent


async def test_a_stalled_body_is_answered_408_and_its_connection_closed(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(settings.model_copy(update={"body_timeout_s": 0.2}))
    async with app.router.lifespan_context(app):
        caplog.set_level(logging.WARNING)
        start = time.monotonic()
        sent = await _call(
            app,
            _scope("/v1/runs/r1/rollouts", 1000),
            [{"type": "http.request", "body": b"{" * 16, "more_body": True}],
        )
        waited = time.monotonic() - start
    head, body = sent[0], sent[1]
    assert head["status"] == 408
    assert (b"connection", b"close") in head["headers"]
    doc = json.loads(body["body"])
    assert doc["error"] == "RequestTimeout"
    assert "no byte for 0.2 s after 16 of 1000 bytes" in doc["detail"]
    assert 0.2 <= waited < 10
    lines = [r for r in caplog.records if r.name == "rollout_broker"]
    assert [r.exc_info for r in lines] == [None]
    assert "no body byte for 0.2 s after 16 of 1000 bytes" in lines[0].getMessage()


async def test_a_client_gone_mid_body_is_one_log_line(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        caplog.set_level(logging.DEBUG)
        caplog.clear()
        await _call(
            app,
            _scope("/v1/runs/r1/rollouts", 1000),
            [
                {"type": "http.request", "body": b"{" * 16, "more_body": True},
                {"type": "http.disconnect"},
            ],
        )  # an exception escaping the app is what a server logs as a traceback
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].exc_info is None
    assert records[0].getMessage() == (
        "POST /v1/runs/r1/rollouts: the client went away after 16 of 1000 body bytes"
    )


# -- against a real server ------------------------------------------------------------------------

_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@contextlib.contextmanager
def _uvicorn(prefix: str, log: Path, **settings: str) -> Iterator[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update(BROKER_REDIS_URL=REDIS_URL, BROKER_REDIS_PREFIX=prefix, PYTHONPATH=str(ROOT))
    env.update(settings)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--port", "0"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not (m := _LISTENING.search(log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield int(m[1])
    finally:
        proc.terminate()
        proc.wait(10)


def _partial_post(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(
        b"POST /v1/runs/r1/rollouts HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b"{" * 16
    )
    return sock


@pytest.mark.slow
@pytest.mark.one_node
def test_a_server_closes_stalled_bodies_and_logs_abandoned_ones_once(
    prefix: str, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    with _uvicorn(prefix, log, BROKER_BODY_TIMEOUT_S="0.5") as port:
        # Content-Length 1000, 16 bytes sent, then nothing: 408, then the connection closes.
        with _partial_post(port) as sock:
            answer = b""
            while chunk := sock.recv(65536):  # b"" once the server has closed it
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"connection: close" in answer.lower()

        # The same body abandoned: one line in the log, no traceback.
        _partial_post(port).close()
        deadline = time.monotonic() + 20
        while "the client went away" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    text = log.read_text()
    assert "Traceback" not in text, text
    assert len(re.findall("the client went away after 16 of 1000 body bytes", text)) == 1
    assert len(re.findall("no body byte for 0.5 s after 16 of 1000 bytes", text)) == 1


# -- peak memory for a maximal body ----------------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import asyncio, gc, json, sys

    import httpx

    from app.main import create_app
    from app.settings import Settings
    from benchmarks.payloads import big_json_body

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    async def main():
        app = create_app(Settings(redis_url=sys.argv[1], redis_prefix=sys.argv[2]))
        body = big_json_body(28)  # 262,144-token rollouts, as many as fit in 64 MiB
        path = "/v1/runs/big/rollouts"
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }
        step = 1 << 16  # the body arrives as a server hands it over, a chunk at a time
        chunks = iter(range(0, len(body), step))
        sent = []

        async def receive():
            i = next(chunks)
            return {"type": "http.request", "body": body[i : i + step],
                    "more_body": i + step < len(body)}

        async def send(message):
            sent.append(message)

        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                resp = await c.post("/v1/runs", json={"run_id": "big"})
                assert resp.status_code == 201, resp.text
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM starts over from here
            before = status("VmRSS")
            await app(scope, receive, send)
            peak = status("VmHWM") - before
        answer = json.loads(sent[1]["body"])
        print(json.dumps({"status": sent[0]["status"], "answer": answer, "peak": peak,
                          "body": len(body)}))

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.one_node
async def test_a_maximal_body_peaks_at_a_few_times_its_size(prefix: str) -> None:
    """A 64 MiB JSON ingest of 28 rollouts of 262,144 tokens: the process grows by at most 4×
    the body at its peak (the whole-document parse grew it by about 16×)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _MEASURE,
        REDIS_URL,
        prefix,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["status"] == 202 and got["answer"]["accepted"] == 28, got
    ratio = got["peak"] / got["body"]
    print(f"peak {got['peak'] / 1e6:.0f} MB for a {got['body'] / 1e6:.0f} MB body: {ratio:.2f}×")
    assert ratio <= 4.0
