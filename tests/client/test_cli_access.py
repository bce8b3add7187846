"""The command line against a broker with auth on: ``--token`` (global or per command) and
``BROKER_TOKEN``, ``tokens create|list|revoke``, ``audit``, one-line 401/403 errors, and ``serve``
refusing a set-up nobody could sign in to."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.client.live import LiveServer, broker_env, serve
from tests.helpers import KNOWN_SECRETS
from tests.services import REDIS_URL, fresh_database, redis_prefix

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)
runner = CliRunner()


@pytest.fixture(scope="module")
def auth_server() -> Iterator[LiveServer]:
    with redis_prefix() as prefix, fresh_database() as db:
        env = broker_env(prefix, db, BROKER_AUTH="on", BROKER_ADMIN_TOKEN=ADMIN)
        with serve(env) as server:
            yield server
    assert ADMIN not in server.output()


def invoke(server: LiveServer | None, *args: str, token: str | None = None) -> tuple[int, str, str]:
    """``rollout-broker <args>``, with ``BROKER_TOKEN=token`` (none when None)."""
    env: dict[str, str | None] = {"COLUMNS": "200", "NO_COLOR": "1", "BROKER_TOKEN": token}
    if server is not None:
        env["BROKER_URL"] = server.url
    result = runner.invoke(cli, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def created(out: str) -> tuple[str, str]:
    """The token_id and the secret that ``tokens create`` printed."""
    fields = dict(line.split(":", 1) for line in out.splitlines())
    return fields["token_id"].strip(), fields["token"].strip()


@pytest.mark.slow
def test_tokens_create_list_revoke_and_audit(auth_server: LiveServer) -> None:
    code, out, err = invoke(
        auth_server, "tokens", "create", "ops-1", "-s", "operate", "--scope", "train",
        "--run", "cli-*", "-r", "other", token=ADMIN,
    )  # fmt: skip
    assert code == 0, err
    token_id, token = created(out)
    assert token.startswith(f"rb_{token_id}_")
    assert err.strip() == (
        "warning: the token is shown only this once (the broker keeps only a digest of it): "
        "store it now"
    )
    code, out, err = invoke(
        auth_server, "tokens", "create", "gen-1", "-s", "generate", "--json", token=ADMIN
    )
    assert code == 0, err
    gen = json.loads(out)
    assert (gen["name"], gen["scopes"], gen["runs"]) == ("gen-1", ["generate"], None)
    assert gen["token"].startswith(f"rb_{gen['token_id']}_")

    code, out, err = invoke(auth_server, "tokens", "list", token=ADMIN)
    assert code == 0, err
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.strip()[:1].isalnum()
    }
    assert rows[token_id][1:4] == ["ops-1", "operate,train", "cli-*,other"]
    assert rows[token_id][-2:] == ["bootstrap", "active"]
    assert rows[gen["token_id"]][3] == "all"
    assert token not in out and gen["token"] not in out
    code, out, _ = invoke(auth_server, "tokens", "list", "--json", token=ADMIN)
    listed = json.loads(out)
    assert [t["name"] for t in listed] == ["gen-1", "ops-1"]
    assert all("token" not in t for t in listed) and token not in out

    # The new token at work, given on the command line: before the command or after it.
    code, _, err = invoke(auth_server, "--token", token, "runs", "create", "cli-a")
    assert code == 0, err
    code, _, err = invoke(auth_server, "policy", "set", "cli-a", "2", "--token", token)
    assert code == 0, err
    # The command's own --token wins over BROKER_TOKEN.
    code, _, err = invoke(auth_server, "runs", "close", "cli-a", "--token", token, token="nope")
    assert code == 0, err

    code, out, err = invoke(auth_server, "audit", "--json", token=token)
    assert code == 0, err
    entries = json.loads(out)
    assert [(e["actor"], e["token_id"], e["action"], e["run_id"]) for e in entries] == [
        ("ops-1", token_id, "run.close", "cli-a"),
        ("ops-1", token_id, "run.policy", "cli-a"),
        ("ops-1", token_id, "run.create", "cli-a"),
    ]  # a token limited to runs sees only theirs: no token action
    code, out, err = invoke(auth_server, "audit", "--limit", "2", token=ADMIN)
    assert code == 0, err
    assert "run.close" in out and "run.policy" in out and "run.create" not in out
    assert "2 shown; more with --limit" in out
    code, out, _ = invoke(auth_server, "audit", "--run", "cli-a", "--limit", "0", token=ADMIN)
    assert code == 0 and out.count("ops-1") == 3 and "token.create" not in out
    assert out.count(token_id) == 3  # the token's id beside its name
    assert "more with --limit" not in out

    code, out, err = invoke(auth_server, "tokens", "revoke", token_id, token=ADMIN)
    assert (code, out.strip()) == (0, f"token {token_id} revoked"), err
    code, out, err = invoke(auth_server, "tokens", "revoke", token_id, token=ADMIN)
    assert code == 0, err  # again: nothing changes
    code, _, err = invoke(auth_server, "tokens", "revoke", "0000000000000000", token=ADMIN)
    assert code == 1 and one_line(err).startswith("error: TokenNotFound:")
    code, _, err = invoke(auth_server, "runs", "list", token=token)
    assert code == 1
    assert one_line(err).startswith("error: Unauthorized: unknown or revoked token")
    code, out, _ = invoke(auth_server, "tokens", "list", "--json", token=ADMIN)
    assert [t["revoked_at"] is not None for t in json.loads(out)] == [False, True]

    assert "auth is on: every /v1 request needs a bearer token" in auth_server.output()
    for secret in (token, gen["token"], ADMIN):
        assert secret not in auth_server.output()


@pytest.mark.slow
def test_401_and_403_are_one_line_saying_how_to_pass_a_token(auth_server: LiveServer) -> None:
    for args in (["runs", "list"], ["tokens", "list"], ["audit"], ["accounting", "r"]):
        code, out, err = invoke(auth_server, *args)
        assert code == 1 and out == "", (args, out)
        line = one_line(err)
        assert line.startswith("error: Unauthorized: "), line
        assert line.endswith("pass --token or set BROKER_TOKEN to a token of this broker")

    code, out, err = invoke(auth_server, "tokens", "create", "g", "-s", "generate", token=ADMIN)
    assert code == 0, err
    _, generate = created(out)
    for args in (["tokens", "list"], ["runs", "create", "cli-b"], ["audit"]):
        code, _, err = invoke(auth_server, *args, token=generate)
        line = one_line(err)
        assert code == 1 and line.startswith("error: Forbidden: token 'g' lacks the scope"), line
        assert "pass --token or set BROKER_TOKEN" in line and generate not in line
    # watch reads the run (any scope may) and then its accounting (operate).
    assert invoke(auth_server, "runs", "create", "cli-w", token=ADMIN)[0] == 0
    code, _, err = invoke(auth_server, "watch", "cli-w", "--count", "1", token=generate)
    assert code == 1 and one_line(err).startswith("error: Forbidden:")

    code, _, err = invoke(auth_server, "runs", "list", token="has a space")
    line = one_line(err)
    assert code == 1 and "BROKER_TOKEN" in line and "has a space" not in line


def test_tokens_create_checks_its_scopes_before_any_request() -> None:
    code, out, err = invoke(
        None, "tokens", "create", "x", "-s", "root", "--url", "http://127.0.0.1:9"
    )
    assert code == 2 and out == "" and "root" in err
    code, _, err = invoke(None, "tokens", "create", "x", "--url", "http://127.0.0.1:9")
    assert code == 2 and "--scope" in err


# -- serve ---------------------------------------------------------------------------------------


@pytest.fixture
def services(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Redis and a database not migrated (so holding no admin token) for ``serve``."""
    for name in ("BROKER_AUTH", "BROKER_ADMIN_TOKEN", "BROKER_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    with fresh_database() as db:
        monkeypatch.setenv("BROKER_REDIS_URL", REDIS_URL)
        monkeypatch.setenv("BROKER_DATABASE_URL", db)
        yield


@pytest.mark.parametrize(
    ("args", "env", "why"),
    [
        (["--host", "0.0.0.0"], {}, "the API listens on 0.0.0.0, not loopback"),
        ([], {"BROKER_AUTH": "on"}, "BROKER_AUTH=on"),
    ],
)
def test_serve_refuses_auth_nobody_could_sign_in_to(
    services: None, args: list[str], env: dict[str, str], why: str
) -> None:
    result = runner.invoke(cli, ["serve", "--port", "0", *args], env=env)
    assert result.exit_code == 1 and result.stdout == ""
    line = one_line(result.stderr)
    assert line.startswith(f"error: auth is on ({why}) but nobody could sign in")
    assert "BROKER_ADMIN_TOKEN" in line and "BROKER_AUTH=off" in line


def test_serve_says_which_setting_is_wrong_without_its_value(services: None) -> None:
    weak = "weak-admin-secret"
    result = runner.invoke(
        cli, ["serve", "--port", "0"], env={"BROKER_ADMIN_TOKEN": weak, "BROKER_AUTH": "perhaps"}
    )
    assert result.exit_code == 1 and result.stdout == ""
    line = one_line(result.stderr)
    assert line.startswith("error: invalid settings: ")
    assert "BROKER_AUTH: " in line and "BROKER_ADMIN_TOKEN: " in line
    assert weak not in line and "perhaps" not in line
