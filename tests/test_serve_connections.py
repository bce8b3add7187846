"""`serve` bounds the connections each API process holds (app/serving.py): a request head must
arrive within BROKER_HEADER_TIMEOUT_S, an idle keep-alive connection is closed after
BROKER_KEEP_ALIVE_TIMEOUT_S, a head over BROKER_MAX_HEADER_BYTES is refused, and beyond
BROKER_MAX_CONNECTIONS a new connection is answered 503. A real `serve` process on real
services, talked to over raw sockets; each test waits for the server to close a connection, up
to a generous bound, rather than for a fixed time."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from tests.cli_process import LISTENING, broker_env, rollout_broker
from tests.services import REDIS_URL

WITHIN_S = 60.0  # the bound on any wait for the server: far above every timeout set here


@contextlib.contextmanager
def serving(database_url: str, prefix: str, **settings: str) -> Iterator[tuple[str, int]]:
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        **settings,
    )
    with rollout_broker("serve", "--port", "0", env=env) as serve:
        url = urlsplit(serve.wait_for(LISTENING).group(1))
        assert url.hostname is not None and url.port is not None
        yield url.hostname, url.port


def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=WITHIN_S)
    sock.settimeout(WITHIN_S)
    return sock


def request(path: str, method: str = "GET", body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response read off ``sock``: status, headers (lower-case names) and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "closed in the body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_after(sock: socket.socket, start: float, trickle: bytes = b"") -> float:
    """Seconds from ``start`` until the server closed ``sock`` (its end of stream, or a reset
    of what was sent after it), sending ``trickle`` a byte at a time meanwhile; fails after
    WITHIN_S."""
    sock.settimeout(0.2 if trickle else WITHIN_S)
    for byte in [trickle[i : i + 1] for i in range(len(trickle))] or [b""]:
        try:
            if byte:
                sock.sendall(byte)
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
        assert time.monotonic() - start < WITHIN_S, "still open"
    sock.settimeout(WITHIN_S)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(65536) == b"", "an answer to a head that never ended"
    return time.monotonic() - start


def test_a_request_head_must_arrive_within_the_header_timeout(database_url: str, prefix: str):
    with serving(database_url, prefix, BROKER_HEADER_TIMEOUT_S="1") as address:
        # A connection that sends nothing.
        start = time.monotonic()
        idle = connect(address)
        assert closed_after(idle, start) >= 0.9
        # One that sends its head a byte at a time (a head longer than the timeout allows).
        start = time.monotonic()
        slow = connect(address)
        head = request("/healthz")[:-2] + b"X-Slow: " + b"a" * 400 + b"\r\n\r\n"
        assert closed_after(slow, start, trickle=head) >= 0.9
        # A request whose answer takes longer than the header timeout is not cut short, and
        # its connection then serves another request, the timeout counting from its first byte.
        with connect(address) as sock:
            sock.sendall(request("/v1/runs", "POST", json.dumps({"run_id": "slow"}).encode()))
            assert answer(sock)[0] == 201
            sock.sendall(request("/v1/runs/slow/batch?size=1&wait_s=2"))
            assert answer(sock)[0] == 204  # after 2 s of long poll
            sock.sendall(request("/healthz"))
            assert answer(sock)[0] == 200


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(database_url: str, prefix: str):
    """Set above uvicorn's own default (5 s), so that the setting is seen to take its place."""
    with (
        serving(
            database_url, prefix, BROKER_KEEP_ALIVE_TIMEOUT_S="7", BROKER_HEADER_TIMEOUT_S="1"
        ) as address,
        connect(address) as sock,
    ):
        sock.sendall(request("/healthz"))
        assert answer(sock)[0] == 200
        start = time.monotonic()
        assert closed_after(sock, start) >= 6.9


def test_a_request_head_over_its_bound_is_400(database_url: str, prefix: str):
    with serving(database_url, prefix, BROKER_MAX_HEADER_BYTES="4096") as address:
        with connect(address) as sock:
            padding = b"X-Pad: " + b"a" * 8192 + b"\r\n"
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + padding)
            status, headers, _ = answer(sock)
            assert status == 400 and headers["connection"] == "close"
        with connect(address) as sock:  # one within the bound is served
            sock.sendall(request("/healthz")[:-2] + b"X-Pad: " + b"a" * 2048 + b"\r\n\r\n")
            assert answer(sock)[0] == 200


def test_beyond_the_connection_cap_a_new_connection_is_answered_503(database_url: str, prefix: str):
    with serving(database_url, prefix, BROKER_MAX_CONNECTIONS="3") as address:
        held = [connect(address) for _ in range(3)]
        for sock in held[:2]:  # served, and kept open
            sock.sendall(request("/healthz"))
            assert answer(sock)[0] == 200
        with connect(address) as over:
            over.sendall(request("/healthz"))
            status, headers, body = answer(over)
            assert status == 503 and headers["connection"] == "close"
            assert json.loads(body)["error"] == "Unavailable"
            assert int(headers["retry-after"]) >= 1
            assert closed_after(over, time.monotonic()) >= 0
        # The connections within the cap are served as before.
        held[0].sendall(request("/healthz"))
        assert answer(held[0])[0] == 200
        # Once one of them closes, a new connection is served again.
        held.pop().close()
        deadline = time.monotonic() + WITHIN_S
        while True:
            with connect(address) as sock:
                sock.sendall(request("/healthz"))
                if answer(sock)[0] == 200:
                    break
            assert time.monotonic() < deadline, "never below the cap again"
        for sock in held:
            sock.close()
