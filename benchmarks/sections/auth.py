"""``--only auth``: throughput with access control on against off (see :mod:`benchmarks.pairs`)."""

from __future__ import annotations

import contextlib
import json
import secrets

from benchmarks.harness import Bench, Row
from benchmarks.load import Http, expect
from benchmarks.pairs import Toggle, paired_rows
from benchmarks.servers import Server

AUTH_SCOPES = ("generate", "train", "operate")
AUTH_NEED = 0.95  # auth on may cost at most 5 % of the throughput with auth off


def auth_toggle(admin: str) -> Toggle:
    return Toggle(
        "auth",
        "Access control overhead",
        "BROKER_AUTH",
        AUTH_NEED,
        {"off": {"BROKER_AUTH": "off"}, "on": {"BROKER_AUTH": "on", "BROKER_ADMIN_TOKEN": admin}},
        "auth on (a token made through POST /v1/tokens)",
    )


def bench_token(server: Server, admin: str) -> str:
    """A generate/train/operate token made by the admin through ``POST /v1/tokens``, as an
    operator would make it: the load presents it, so that what is measured is the database
    token's path (looked up once, then cached), not the bootstrap token's comparison."""
    http = Http(server.address, admin)
    body = json.dumps({"name": "bench", "scopes": list(AUTH_SCOPES)}).encode()
    status, data, _ = http.call("POST", "/v1/tokens", body, "application/json")
    http.close()
    expect(status, data, 201)
    return str(json.loads(data)["token"])


def check_auth(servers: dict[str, Server], token: str) -> None:
    """Auth is on where it should be: ``on`` refuses a request without a token and takes one
    with it; ``off`` needs none."""
    for side, presented, want in (("on", None, 401), ("on", token, 200), ("off", None, 200)):
        http = Http(servers[side].address, presented)
        status, data, _ = http.call("GET", "/v1/runs")
        http.close()
        expect(status, data, want)


def auth_rows(b: Bench) -> list[Row]:
    """Ingest and lease + ack with auth off and on (see :func:`paired_rows`); the on side's
    load presents a token made through ``POST /v1/tokens``."""
    admin = secrets.token_urlsafe(32)
    token: str | None = None

    def prepare(servers: dict[str, Server]) -> dict[str, str | None]:
        nonlocal token
        token = token or bench_token(servers["on"], admin)  # the database keeps it
        check_auth(servers, token)
        return {"off": None, "on": token}

    return paired_rows(b, auth_toggle(admin), prepare, lambda _: contextlib.nullcontext())
