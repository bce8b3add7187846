"""Access control through HTTP (SPEC "Access control"): 401 vs 403, each scope and run limit,
tokens and their revocation (on a second API process too), the audit log, the Origin rule with
auth off, constant-time comparison and secrets kept out of logs."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from pydantic import SecretStr
from sqlalchemy import func, select

from app import keys
from app.access import policy, tokens
from app.access.models import ApiToken, AuditEntry
from app.access.startup import AuthSetupError, resolve_auth
from app.caller import run_matches
from app.errors import TokenNameTaken
from app.main import create_app
from app.settings import Settings
from tests.api.support import assert_error
from tests.helpers import KNOWN_SECRETS, SecretWatch, rollout
from tests.processes import ApiProcess, broker_env
from tests.services import REDIS_URL, RedisBackend

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)


def _secret(token: str) -> str:
    """A token's secret part (url-safe: it may hold '_' itself, so not the text after the last
    '_')."""
    return tokens.split_token(token)[1]  # type: ignore[index]


@pytest.fixture
async def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": True, "admin_token": SecretStr(ADMIN)})


@pytest.fixture
async def app_client(auth_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process with auth on; no token sent unless a test sets one."""
    app = create_app(auth_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def new_token(
    c: httpx.AsyncClient, name: str, scopes: list[str], runs: list[str] | None = None
) -> str:
    body: dict[str, Any] = {"name": name, "scopes": scopes}
    if runs is not None:
        body["runs"] = runs
    resp = await c.post("/v1/tokens", json=body, headers=bearer(ADMIN))
    assert resp.status_code == 201, resp.text
    out = resp.json()
    assert out["name"] == name and out["scopes"] == scopes and out["runs"] == runs
    assert tokens.split_token(out["token"]) is not None
    return str(out["token"])


# -- the table -------------------------------------------------------------------------------------


def test_every_route_of_the_app_is_in_the_access_table_and_nothing_else():
    app = create_app(Settings(redis_url=REDIS_URL, database_url="postgresql://x/y"))
    routes = {
        (m, r.path_format)
        for r in iter_route_contexts(app.routes)
        for m in r.methods or ()
        if m != "HEAD"
    }
    assert routes == set(policy.ROUTES)


def test_run_patterns_match_ids_and_prefixes():
    assert run_matches(["a", "team-*"], "a")
    assert run_matches(["team-*"], "team-x")
    assert run_matches(["*"], "anything")
    assert not run_matches(["a", "team-*"], "ab")
    assert not run_matches(["team-*"], "tea")
    assert not run_matches([], "a")


# -- 401 and 403 -----------------------------------------------------------------------------------


async def test_no_token_unknown_token_and_a_malformed_header_are_401(app_client):
    for headers in (
        {},
        bearer("rb_0123456789abcdef_" + "x" * 43),
        bearer("not-a-token"),
        {"Authorization": f"Basic {ADMIN}"},
        {"Authorization": "Bearer "},
    ):
        resp = await app_client.get("/v1/runs", headers=headers)
        assert_error(resp, 401, "Unauthorized")
        assert resp.headers["www-authenticate"] == "Bearer"
    # A real token's id with another secret is unknown too.
    good = await new_token(app_client, "t", ["operate"])
    token_id = tokens.split_token(good)[0]  # type: ignore[index]
    forged = f"rb_{token_id}_{secrets.token_urlsafe(32)}"
    assert_error(await app_client.get("/v1/runs", headers=bearer(forged)), 401, "Unauthorized")
    assert (await app_client.get("/v1/runs", headers=bearer(good))).status_code == 200


async def test_health_and_the_api_description_need_no_token(app_client):
    for path in ("/healthz", "/openapi.json"):
        assert (await app_client.get(path)).status_code == 200, path


# What each scope may do, from the SPEC; the table in app/access/policy.py must agree.
SPEC_SCOPES = {
    "generate": {"rollouts", "work", "work_return", "read", "read_consumer"},
    "reward": {"reward_lease", "rewards", "reward_return", "read", "read_consumer"},
    "train": {
        "lease",
        "measure",
        "ack",
        "nack",
        "policy",
        "consumer_lease",
        "consumer_ack",
        "consumer_nack",
        "read",
        "read_consumer",
    },
    "operate": {
        "create",
        "patch",
        "close",
        "prompts",
        "accounting",
        "versions",
        "generators",
        "batches",
        "prompt_list",
        "dead_letters",
        "audit",
        "release",
        "consumer_create",
        "consumer_delete",
        "read",
        "read_consumer",
    },
}


def _calls(run: str) -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    base = f"/v1/runs/{run}"
    return {
        "read": ("GET", base, None),
        "create": ("POST", "/v1/runs", {"run_id": run + "-new"}),
        "patch": ("PATCH", f"{base}/config", {"ack_timeout_s": 30}),
        "policy": ("POST", f"{base}/policy", {"version": 1}),
        "rollouts": ("POST", f"{base}/rollouts", {"rollouts": [rollout("x1")]}),
        "lease": ("GET", f"{base}/batch?size=1", None),
        "ack": ("POST", f"{base}/batches/b-none/ack", {"step": 1}),
        "nack": ("POST", f"{base}/batches/b-none/nack", None),
        "measure": ("POST", f"{base}/batches/b-none/measure", {"logprobs": {}}),
        "prompts": (
            "POST",
            f"{base}/prompts",
            {"prompts": [{"prompt_id": "p", "prompt_ids": [1]}]},
        ),
        "work": ("POST", f"{base}/work", {"max_prompts": 1}),
        "work_return": ("POST", f"{base}/work/wl-00000000/return", {}),
        "reward_lease": ("POST", f"{base}/rewards/lease", {"max_rollouts": 1}),
        "rewards": ("POST", f"{base}/rewards", {"rewards": {}}),
        "reward_return": ("POST", f"{base}/rewards/lease/rl-00000000/return", {}),
        "accounting": ("GET", f"{base}/accounting", None),
        "versions": ("GET", f"{base}/accounting/versions", None),
        "generators": ("GET", f"{base}/accounting/generators", None),
        "batches": ("GET", f"{base}/batches", None),
        "prompt_list": ("GET", f"{base}/prompts", None),
        "dead_letters": ("GET", f"{base}/accounting/dead-letters", None),
        "audit": ("GET", f"/v1/audit?run_id={run}", None),
        "release": ("POST", f"{base}/generators/gen-a/release", None),
        "consumer_create": ("POST", f"{base}/consumers", {"name": "c", "source": "received"}),
        "read_consumer": ("GET", f"{base}/consumers/c", None),
        "consumer_lease": ("GET", f"{base}/consumers/c/batch?size=1", None),
        "consumer_ack": ("POST", f"{base}/consumers/c/batches/b-none/ack", None),
        "consumer_nack": ("POST", f"{base}/consumers/c/batches/b-none/nack", None),
        "consumer_delete": ("DELETE", f"{base}/consumers/c", None),
        "close": ("POST", f"{base}/close", None),
    }


@pytest.mark.parametrize("scope", [*SPEC_SCOPES, "admin"])
async def test_each_scope_may_do_what_the_spec_says_and_nothing_else(app_client, scope):
    admin = bearer(ADMIN)
    assert (await app_client.post("/v1/runs", json={"run_id": "r"}, headers=admin)).status_code
    token = bearer(await new_token(app_client, f"{scope}-token", [scope]))
    for what, (method, path, body) in _calls("r").items():
        resp = await app_client.request(method, path, json=body, headers=token)
        allowed = scope == "admin" or what in SPEC_SCOPES[scope]
        if allowed:
            assert resp.status_code not in (401, 403), (scope, what, resp.text)
        else:
            detail = assert_error(resp, 403, "Forbidden")
            assert re.search(r"lacks the scope '(train|generate|reward|operate)'$", detail), detail
    for method, path in (("GET", "/v1/tokens"), ("POST", "/v1/tokens")):
        resp = await app_client.request(
            method, path, json={"name": "n", "scopes": ["generate"]}, headers=token
        )
        if scope == "admin":
            assert resp.status_code in (200, 201), resp.text
        else:
            assert_error(resp, 403, "Forbidden")


async def test_a_token_limited_to_runs_touches_only_those(app_client):
    admin = bearer(ADMIN)
    for run in ("team-a-1", "team-b-1"):
        resp = await app_client.post("/v1/runs", json={"run_id": run}, headers=admin)
        assert resp.status_code == 201
    limited = bearer(await new_token(app_client, "team-a", ["operate", "train"], ["team-a-*"]))
    resp = await app_client.post("/v1/runs", json={"run_id": "team-a-2"}, headers=limited)
    assert resp.status_code == 201, resp.text
    for method, path, body in (
        ("POST", "/v1/runs", {"run_id": "team-b-2"}),
        ("POST", "/v1/runs", {}),  # an unnamed run could be any run
        ("GET", "/v1/runs/team-b-1", None),
        ("POST", "/v1/runs/team-b-1/close", None),
        ("POST", "/v1/runs/team-b-1/policy", {"version": 3}),
        ("GET", "/v1/audit?run_id=team-b-1", None),
    ):
        resp = await app_client.request(method, path, json=body, headers=limited)
        assert "team-a" in assert_error(resp, 403, "Forbidden"), (method, path)
    listed = (await app_client.get("/v1/runs", headers=limited)).json()["runs"]
    assert {r["run_id"] for r in listed} == {"team-a-1", "team-a-2"}
    everything = (await app_client.get("/v1/runs", headers=admin)).json()["runs"]
    assert {r["run_id"] for r in everything} == {"team-a-1", "team-a-2", "team-b-1"}
    # The run it lacks is unchanged.
    run = (await app_client.get("/v1/runs/team-b-1", headers=admin)).json()
    assert run["status"] == "open" and run["policy_version"] == 0


@pytest.mark.parametrize("status", [None, "open", "closed"])
async def test_a_token_limited_to_runs_lists_and_pages_through_only_those(app_client, status):
    """Neither a page nor its cursor names a run of others: the listing was filtered after
    paging, and each cursor named the last run of the unfiltered page, so following the
    cursors walked every run id of the broker."""
    admin = bearer(ADMIN)
    mine = {"team-a-1", "team-a-2", "team-a-3"}
    order = [f"other-{i:02d}" for i in range(20)]
    for at, run in zip((0, 9, 19), sorted(mine), strict=True):
        order.insert(at, run)
    for run in order:  # created one after another: the listing is newest first
        resp = await app_client.post("/v1/runs", json={"run_id": run}, headers=admin)
        assert resp.status_code == 201
        if status == "closed":
            assert (await app_client.post(f"/v1/runs/{run}/close", headers=admin)).is_success
    limited = bearer(await new_token(app_client, "team-a", ["operate"], ["team-a-*"]))
    for limit in (1, 2, 3, 1000):
        seen: list[str] = []
        cursor = None
        for _ in range(len(order) + 2):  # the walk ends
            query = {"limit": limit, **({"status": status} if status else {})}
            resp = await app_client.get(
                "/v1/runs",
                params={**query, **({"cursor": cursor} if cursor else {})},
                headers=limited,
            )
            assert resp.status_code == 200, resp.text
            page = resp.json()
            got = [r["run_id"] for r in page["runs"]]
            assert set(got) <= mine, got
            assert len(got) == min(limit, len(mine) - len(seen))  # full pages while it has runs
            seen += got
            cursor = page["next_cursor"]
            if cursor is None:
                break
            assert cursor.partition(":")[2] in mine, cursor
        else:
            raise AssertionError("the cursors never ended")
        assert seen == sorted(mine, reverse=True), (limit, seen)


async def test_a_token_request_that_is_wrong_is_422_and_creates_nothing(app_client):
    admin = bearer(ADMIN)
    for body in (
        {"name": "x", "scopes": []},
        {"name": "x", "scopes": ["root"]},
        {"name": "x", "scopes": ["train", "train"]},
        {"name": "", "scopes": ["train"]},
        {"name": "ops\x85", "scopes": ["train"]},  # a C1 control (NEL)
        {"name": "ops\u202egnp.exe", "scopes": ["train"]},  # shown as "opsexe.png"
        {"name": "o\u200bps", "scopes": ["train"]},  # shown as "ops"
        {"name": "ops\u2066", "scopes": ["train"]},
        {"name": "\ufeffops", "scopes": ["train"]},
        {"name": "x", "scopes": ["admin"], "runs": ["a"]},
        {"name": "x", "scopes": ["train"], "runs": ["a b"]},
        {"name": "x", "scopes": ["train"], "runs": ["a*b"]},
        {"name": "x", "scopes": ["train"], "extra": 1},
    ):
        assert_error(
            await app_client.post("/v1/tokens", json=body, headers=admin), 422, "ValidationFailed"
        )
    assert (await app_client.get("/v1/tokens", headers=admin)).json() == {"tokens": []}


# -- tokens ----------------------------------------------------------------------------------------


async def test_tokens_are_listed_without_secrets_and_revoked_at_once(app_client, sessionmaker):
    admin = bearer(ADMIN)
    token = await new_token(app_client, "trainer-7", ["train"], ["r*"])
    token_id = tokens.split_token(token)[0]  # type: ignore[index]
    listed = (await app_client.get("/v1/tokens", headers=admin)).json()["tokens"]
    assert [t["token_id"] for t in listed] == [token_id]
    assert listed[0]["created_by"] == "bootstrap" and listed[0]["revoked_at"] is None
    assert token not in str(listed) and _secret(token) not in str(listed)
    # Only the digest is stored.
    from sqlalchemy import text

    async with sessionmaker() as s:
        stored = (await s.execute(text("SELECT * FROM api_tokens"))).mappings().one()
    assert _secret(token) not in str(dict(stored))
    assert stored["secret_sha256"] == tokens.digest(tokens.split_token(token)[1])  # type: ignore[index]

    assert (await app_client.get("/v1/runs", headers=bearer(token))).status_code == 200
    resp = await app_client.delete(f"/v1/tokens/{token_id}", headers=admin)
    assert resp.status_code == 204
    assert_error(await app_client.get("/v1/runs", headers=bearer(token)), 401, "Unauthorized")
    assert (await app_client.delete(f"/v1/tokens/{token_id}", headers=admin)).status_code == 204
    assert_error(
        await app_client.delete("/v1/tokens/0000000000000000", headers=admin), 404, "TokenNotFound"
    )
    listed = (await app_client.get("/v1/tokens", headers=admin)).json()["tokens"]
    assert listed[0]["revoked_at"] is not None


async def test_the_secret_is_compared_in_constant_time(app_client, monkeypatch):
    token = await new_token(app_client, "t", ["train"])
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", spy)
    assert (await app_client.get("/v1/runs", headers=bearer(token))).status_code == 200
    secret = tokens.split_token(token)[1]  # type: ignore[index]
    assert (tokens.digest(secret), tokens.digest(secret)) in compared
    compared.clear()
    assert (await app_client.get("/v1/runs", headers=bearer(ADMIN))).status_code == 200
    assert (tokens.digest(ADMIN), tokens.digest(ADMIN)) in compared


async def test_a_revoked_token_stops_working_within_a_second_on_another_replica(
    redis_backend: RedisBackend, database_url: str, prefix: str, tmp_path: Path
):
    env = broker_env(
        **redis_backend.env(),
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_AUTH="on",
        BROKER_ADMIN_TOKEN=ADMIN,
    )
    a, b = ApiProcess(env, tmp_path / "a.log"), ApiProcess(env, tmp_path / "b.log")
    for p in (a, b):
        p.argv[-1] = "debug"  # access lines too: no secret in any of them
    await asyncio.gather(a.start(), b.start())
    try:
        async with httpx.AsyncClient(base_url=a.url) as ca, httpx.AsyncClient(base_url=b.url) as cb:
            token = await new_token(ca, "gen", ["generate", "operate"])
            # Replica b has the token cached (looked up once, trusted for BROKER_TOKEN_CACHE_S).
            for _ in range(3):
                assert (await cb.get("/v1/runs", headers=bearer(token))).status_code == 200
            token_id = tokens.split_token(token)[0]  # type: ignore[index]
            assert (
                await ca.delete(f"/v1/tokens/{token_id}", headers=bearer(ADMIN))
            ).status_code == 204
            revoked = time.monotonic()
            while (await cb.get("/v1/runs", headers=bearer(token))).status_code != 401:
                assert time.monotonic() - revoked < 1.0, "replica b still accepts a revoked token"
            assert (await ca.get("/v1/runs", headers=bearer(token))).status_code == 401
    finally:
        await asyncio.gather(a.stop(), b.stop())
    for p in (a, b):
        text = p.log.read_text()
        assert "GET /v1/runs" in text  # the log holds the requests ...
        assert token not in text and ADMIN not in text  # ... and no secret
        assert _secret(token) not in text


def test_the_log_watch_sees_a_leaked_secret(no_secret_in_any_log_line: SecretWatch):
    before = len(no_secret_in_any_log_line.leaks)
    logging.getLogger("leaky").warning("token is %s", "rb_0123456789abcdef_" + "s" * 43)
    logging.getLogger("leaky").info("admin token %s", ADMIN)
    leaks = no_secret_in_any_log_line.leaks[before:]
    del no_secret_in_any_log_line.leaks[before:]  # the leaks this test made on purpose
    assert len(leaks) == 2, leaks


async def test_a_live_token_name_is_unique_and_the_reserved_names_are_refused(app_client):
    admin = bearer(ADMIN)
    first = await new_token(app_client, "alice", ["operate"])
    resp = await app_client.post(
        "/v1/tokens", json={"name": "alice", "scopes": ["train"]}, headers=admin
    )
    detail = assert_error(resp, 409, "TokenNameTaken")
    assert "'alice'" in detail and "revoke" in detail
    for name in ("bootstrap", "Bootstrap", " bootstrap ", "anonymous"):
        resp = await app_client.post(
            "/v1/tokens", json={"name": name, "scopes": ["operate"]}, headers=admin
        )
        assert "reserved" in assert_error(resp, 422, "ValidationFailed"), name
    listed = (await app_client.get("/v1/tokens", headers=admin)).json()["tokens"]
    assert [t["name"] for t in listed] == ["alice"]
    # A revoked token's name may be reused.
    first_id = tokens.split_token(first)[0]  # type: ignore[index]
    assert (await app_client.delete(f"/v1/tokens/{first_id}", headers=admin)).status_code == 204
    second = await new_token(app_client, "alice", ["train"])
    assert tokens.split_token(second)[0] != first_id


async def test_concurrent_creations_of_one_name_make_one_token(app_client):
    body = {"name": "twin", "scopes": ["generate"]}
    answers = await asyncio.gather(
        *(app_client.post("/v1/tokens", json=body, headers=bearer(ADMIN)) for _ in range(4))
    )
    assert sorted(r.status_code for r in answers) == [201, 409, 409, 409]
    listed = (await app_client.get("/v1/tokens", headers=bearer(ADMIN))).json()["tokens"]
    assert [t["name"] for t in listed] == ["twin"]


async def test_the_database_keeps_a_live_name_unique_across_open_transactions(sessionmaker):
    """The rule holds where no request could check it first: the second of two uncommitted
    creations of one name fails once the first commits."""
    async with sessionmaker() as a, sessionmaker() as b:
        async with a.begin():
            await tokens.insert_token(a, "twin", [policy.Scope.TRAIN], None, "test")

            async def second() -> None:
                async with b.begin():
                    await tokens.insert_token(b, "twin", [policy.Scope.TRAIN], None, "test")

            racer = asyncio.create_task(second())
        with pytest.raises(TokenNameTaken, match="'twin'"):
            await racer
    async with sessionmaker() as s:
        assert await s.scalar(select(func.count()).select_from(ApiToken)) == 1


# -- the audit log ---------------------------------------------------------------------------------


async def test_operator_actions_are_in_the_audit_log_with_the_token_name(app_client):
    ops = bearer(await new_token(app_client, "alice", ["operate"]))
    trainer = bearer(await new_token(app_client, "trainer-0", ["train"], ["run-1"]))
    assert (
        await app_client.post("/v1/runs", json={"run_id": "run-1"}, headers=ops)
    ).status_code == 201
    resp = await app_client.patch("/v1/runs/run-1/config", json={"max_staleness": 3}, headers=ops)
    assert resp.status_code == 200
    assert (
        await app_client.post("/v1/runs/run-1/policy", json={"version": 2}, headers=trainer)
    ).status_code == 200
    assert (await app_client.post("/v1/runs/run-1/close", headers=ops)).status_code == 200
    # A refused action is not an action.
    await app_client.post("/v1/runs/run-1/policy", json={"version": 1}, headers=trainer)

    page = (await app_client.get("/v1/audit", headers=ops)).json()
    got = [(e["actor"], e["action"], e["run_id"]) for e in page["entries"]]
    assert got == [
        ("alice", "run.close", "run-1"),
        ("trainer-0", "run.policy", "run-1"),
        ("alice", "run.config", "run-1"),
        ("alice", "run.create", "run-1"),
        ("bootstrap", "token.create", None),
        ("bootstrap", "token.create", None),
    ]
    by_action = {e["action"]: e for e in page["entries"]}
    assert by_action["run.policy"]["detail"] == {"version": 2}
    assert by_action["run.config"]["detail"] == {"patch": {"max_staleness": 3}}
    assert by_action["run.create"]["detail"]["config"]["max_staleness"] == 1
    assert "token" not in str(by_action["token.create"]["detail"]).replace("token_id", "")
    # Paging, newest first.
    first = (await app_client.get("/v1/audit?limit=4", headers=ops)).json()
    rest = (
        await app_client.get(f"/v1/audit?limit=4&cursor={first['next_cursor']}", headers=ops)
    ).json()
    assert [e["id"] for e in first["entries"] + rest["entries"]] == [
        e["id"] for e in page["entries"]
    ]
    assert rest["next_cursor"] is None
    exact = (await app_client.get("/v1/audit?limit=6", headers=ops)).json()
    assert len(exact["entries"]) == 6 and exact["next_cursor"] is None  # no empty last page
    # A caller limited to runs sees entries of its runs, and no token action.
    mine = (
        await app_client.get(
            "/v1/audit",
            headers=bearer(await new_token(app_client, "ops-1", ["operate"], ["run-*"])),
        )
    ).json()["entries"]
    assert {e["run_id"] for e in mine} == {"run-1"} and len(mine) == 4
    resp = await app_client.delete("/v1/runs/run-1", headers=ops)
    assert resp.status_code in (204, 409), resp.text


async def test_audit_entries_name_the_token_id_that_tells_one_name_apart(app_client):
    admin = bearer(ADMIN)
    first = await new_token(app_client, "ops", ["operate"])
    first_id = tokens.split_token(first)[0]  # type: ignore[index]
    resp = await app_client.post("/v1/runs", json={"run_id": "a-1"}, headers=bearer(first))
    assert resp.status_code == 201
    assert (await app_client.delete(f"/v1/tokens/{first_id}", headers=admin)).status_code == 204
    second = await new_token(app_client, "ops", ["operate"])
    second_id = tokens.split_token(second)[0]  # type: ignore[index]
    resp = await app_client.post("/v1/runs", json={"run_id": "a-2"}, headers=bearer(second))
    assert resp.status_code == 201
    page = (await app_client.get("/v1/audit", headers=admin)).json()
    got = [(e["actor"], e["token_id"], e["action"]) for e in page["entries"]]
    assert got == [  # in the order they were made: each was moved into Postgres as it answered
        ("ops", second_id, "run.create"),
        ("bootstrap", "bootstrap", "token.create"),
        ("bootstrap", "bootstrap", "token.revoke"),
        ("ops", first_id, "run.create"),
        ("bootstrap", "bootstrap", "token.create"),
    ]


# -- auth off: the Origin rule ---------------------------------------------------------------------


async def test_with_auth_off_a_foreign_web_page_cannot_change_anything(api):
    assert (await api.post("/v1/runs", json={"run_id": "laptop"})).status_code == 201
    form = {"content-type": "application/x-www-form-urlencoded"}
    for origin in ("https://evil.example", "null", "http://broker:8080", "http://127.0.0.1"):
        for method, path in (
            ("POST", "/v1/runs/laptop/close"),
            ("POST", "/v1/runs/laptop/batches/b1/nack"),
            ("POST", "/v1/runs/laptop/policy"),
            ("DELETE", "/v1/runs/laptop"),
            ("DELETE", "/v1/tokens/" + "0" * tokens.ID_HEX),
        ):
            resp = await api.request(
                method, path, headers={"origin": origin, **form}, content=b"a=1"
            )
            assert "origin" in assert_error(resp, 403, "Forbidden"), (origin, path)
    run = (await api.get("/v1/runs/laptop", headers={"origin": "https://evil.example"})).json()
    assert run["status"] == "open"  # reading is not refused, and nothing changed
    # The broker's own pages, and clients outside browsers (no Origin), may.
    for headers in ({"origin": "http://broker"}, {"origin": "HTTP://BROKER:80"}, {}):
        resp = await api.post("/v1/runs/laptop/policy", json={"version": 1}, headers=headers)
        assert resp.status_code == 200, (headers, resp.text)
        assert (
            await api.post("/v1/runs/laptop/policy", json={"version": 1}, headers=headers)
        ).status_code == 200


async def test_an_action_is_in_the_log_when_it_answers_and_reading_writes_nothing(
    app_client, redis, prefix, sessionmaker
):
    """A run action's entry, written to the run's outbox with the change, is in Postgres by the
    time the action answers; reading the log moves and writes nothing."""
    ops = bearer(await new_token(app_client, "alice", ["operate"]))
    for run_id in ("w-1", "w-2", "w-3"):
        resp = await app_client.post("/v1/runs", json={"run_id": run_id}, headers=ops)
        assert resp.status_code == 201

    async def stored() -> tuple[int, int]:
        async with sessionmaker() as session:
            rows = await session.scalar(select(func.count()).select_from(AuditEntry))
        outboxes = [await redis.xlen(keys.outbox_key(prefix, r)) for r in ("w-1", "w-2", "w-3")]
        return sum(outboxes), int(rows or 0)

    before = await stored()
    assert before == (0, 4)  # every action in Postgres, none left in an outbox
    actions, cursor = [], None
    while True:
        query = "/v1/audit?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = (await app_client.get(query, headers=ops)).json()
        actions += [(e["action"], e["run_id"]) for e in page["entries"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert actions == [
        ("run.create", "w-3"),
        ("run.create", "w-2"),
        ("run.create", "w-1"),
        ("token.create", None),
    ]
    assert (await app_client.get("/v1/audit?run_id=w-2", headers=ops)).status_code == 200
    assert await stored() == before


async def test_with_auth_off_no_token_can_be_made(api, sessionmaker):
    """A token made with auth off would belong to nobody and become valid when auth is turned on
    against the same database: it is refused, with the way to make one."""
    body = {"name": "gen", "scopes": ["generate"]}
    for headers in ({}, {"authorization": "Bearer whatever"}):
        resp = await api.post("/v1/tokens", json=body, headers=headers)
        detail = assert_error(resp, 403, "Forbidden")
        assert "auth is off" in detail and "BROKER_AUTH=on" in detail
    async with sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(ApiToken)) == 0
        assert await session.scalar(select(func.count()).select_from(AuditEntry)) == 0
    # Listing (and revoking what an earlier release made) still answers.
    assert (await api.get("/v1/tokens")).json() == {"tokens": []}


async def test_with_auth_off_the_audit_log_names_the_caller_anonymous(api):
    assert (await api.post("/v1/runs", json={"run_id": "r"})).status_code == 201
    entries = (await api.get("/v1/audit")).json()["entries"]
    assert [(e["actor"], e["token_id"], e["action"]) for e in entries] == [
        ("anonymous", None, "run.create")
    ]


# -- start-up --------------------------------------------------------------------------------------


def test_auth_follows_the_listener_unless_set(settings: Settings):
    admin = settings.model_copy(update={"admin_token": SecretStr(ADMIN)})
    assert resolve_auth(settings, "127.0.0.1").auth is False
    assert resolve_auth(settings, "::1").auth is False
    assert resolve_auth(settings, "localhost").auth is False
    assert resolve_auth(admin, "0.0.0.0").auth is True
    assert resolve_auth(admin, "10.1.2.3").auth is True
    off = settings.model_copy(update={"auth": False})
    assert resolve_auth(off, "0.0.0.0").auth is False
    with pytest.raises(AuthSetupError, match=r"BROKER_ADMIN_TOKEN.*BROKER_AUTH=off"):
        resolve_auth(settings, "0.0.0.0")
    with pytest.raises(AuthSetupError, match="BROKER_AUTH=on"):
        resolve_auth(settings.model_copy(update={"auth": True}), "127.0.0.1")


def test_a_weak_admin_token_is_refused():
    with pytest.raises(ValueError, match="32"):
        Settings(admin_token="short")
