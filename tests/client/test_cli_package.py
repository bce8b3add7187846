"""The operator commands as the client ships them (``rollout_broker_client.cli``): built on the
client's public API alone, out of the base install's imports, with ``--url``, ``--token`` and
``--version`` before the command's name, mounted by the server's ``rollout-broker`` as they are
in the client's own ``rollout-broker-ctl``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import rollout_broker_client
import typer
from rollout_broker_client.cli.app import build
from typer.testing import CliRunner

import app
from app.cli import cli

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
PACKAGE = CLIENT / "rollout_broker_client"
UNREACHABLE = "http://127.0.0.1:9"
runner = CliRunner()


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports, relative imports spelled out from its package."""
    package = ".".join(path.relative_to(CLIENT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            # `from rollout_broker_client import _wire` imports a module too
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_client_never_imports_the_server() -> None:
    server = ("app", "workers", "migrations")
    offenders = {
        str(path.relative_to(CLIENT)): sorted(
            n for n in _imported(path) if n.split(".")[0] in server
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_cli_uses_only_the_public_api_of_the_client() -> None:
    """No ``_wire`` or other private module: what ``rollout_broker_client`` exports, and its
    ``protocol`` for the id rules."""
    offenders = {
        str(path.relative_to(CLIENT)): sorted(
            n
            for n in _imported(path)
            if n.startswith("rollout_broker_client.")
            and any(_private(part) for part in n.split(".")[1:])
        )
        for path in sorted((PACKAGE / "cli").glob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# Where the cli extra is not installed: its packages cannot be imported.
WITHOUT_THE_CLI_EXTRA = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"typer", "rich", "click"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
"""


def _python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in a fresh interpreter that imports the client of this checkout."""
    return subprocess.run(
        [sys.executable, *args],
        env={"PYTHONPATH": str(CLIENT), "PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_base_install_needs_neither_typer_nor_rich() -> None:
    imports = "import rollout_broker_client, rollout_broker_client.protocol\n"
    out = _python(
        "-c", WITHOUT_THE_CLI_EXTRA + imports + "print(rollout_broker_client.__version__)"
    )
    assert (out.returncode, out.stdout.strip()) == (0, rollout_broker_client.__version__), out
    # Where they are installed, the client does not import them (httpx may import rich and
    # click, for a command line of its own).
    out = _python("-c", "import sys\n" + imports + "print('typer' in sys.modules)")
    assert (out.returncode, out.stdout.strip()) == (0, "False"), out.stderr


def test_without_the_cli_extra_the_command_says_what_to_install() -> None:
    out = _python(
        "-c", WITHOUT_THE_CLI_EXTRA + "from rollout_broker_client.cli import main; main()"
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        "error: the operator commands need typer: pip install 'rollout-broker-client[cli]'\n"
    )


def test_versions_are_those_of_the_distributions() -> None:
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert rollout_broker_client.__version__ == client["version"]
    assert app.__version__ == server["version"]
    assert f"rollout-broker-client[cli]=={client['version']}" in [
        d.split(";")[0].replace(" ", "") for d in server["dependencies"]
    ]


def test_the_console_script_of_the_client() -> None:
    scripts = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["rollout-broker-ctl"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))

    out = _python("-m", "rollout_broker_client.cli", "--help", COLUMNS="160")
    assert out.returncode == 0, out.stderr
    for name in ("runs", "policy", "batches", "accounting", "prompts", "watch", "tokens", "audit"):
        assert name in out.stdout
    for name in ("serve", "worker", "migrate"):
        assert name not in out.stdout


@pytest.mark.parametrize(
    ("command", "name", "version"),
    [
        (cli, "rollout-broker", app.__version__),
        (build(), "rollout-broker-ctl", rollout_broker_client.__version__),
    ],
    ids=["rollout-broker", "rollout-broker-ctl"],
)
def test_version(command: typer.Typer, name: str, version: str) -> None:
    result = runner.invoke(command, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"{name} {version}\n")


def invoke(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    base: dict[str, str | None] = {"COLUMNS": "160", "NO_COLOR": "1", "BROKER_TOKEN": None}
    result = runner.invoke(cli, list(args), env={"BROKER_URL": None, **base, **(env or {})})
    return result.exit_code, result.stdout, result.stderr


def test_the_global_url_before_the_command() -> None:
    code, out, err = invoke("--url", UNREACHABLE, "runs", "list")
    assert code == 1 and out == ""
    assert err.startswith(f"error: cannot reach the broker at {UNREACHABLE}:")
    assert len(err.splitlines()) == 1

    # It wins over BROKER_URL; the command's own --url wins over it.
    code, _, err = invoke("--url", UNREACHABLE, "runs", "list", env={"BROKER_URL": "http://x:1"})
    assert code == 1 and f"at {UNREACHABLE}:" in err
    code, _, err = invoke("--url", "http://x:1", "accounting", "r", "--url", UNREACHABLE)
    assert code == 1 and f"at {UNREACHABLE}:" in err
    code, _, err = invoke("runs", "list", env={"BROKER_URL": UNREACHABLE})
    assert code == 1 and f"at {UNREACHABLE}:" in err


def test_the_global_url_reaches_watch() -> None:
    code, out, err = invoke("--url", UNREACHABLE, "watch", "r1", "--count", "1")
    assert code == 0, err
    assert f"waiting: cannot reach the broker at {UNREACHABLE}" in out


def test_the_global_token_before_the_command() -> None:
    """A token that cannot be sent ends the command before any request; the command's own
    ``--token`` wins over the global one, which wins over ``BROKER_TOKEN``."""
    bad = "has a space"
    code, out, err = invoke("--token", bad, "runs", "list", "--url", UNREACHABLE)
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: ") and "BROKER_TOKEN" in err and bad not in err

    code, _, err = invoke("--token", bad, "runs", "list", "--url", UNREACHABLE, "--token", "t0k")
    assert code == 1 and "cannot reach the broker" in err
    code, _, err = invoke("--token", "t0k", "runs", "list", "--url", UNREACHABLE, env={
        "BROKER_TOKEN": bad
    })  # fmt: skip
    assert code == 1 and "cannot reach the broker" in err
    code, _, err = invoke("runs", "list", "--url", UNREACHABLE, env={"BROKER_TOKEN": bad})
    assert code == 1 and "cannot reach the broker" not in err and bad not in err


def test_a_bad_command_line_is_status_2() -> None:
    code, out, _ = invoke("--url")
    assert code == 2 and out == ""
    code, _, err = invoke("--url", UNREACHABLE, "runs", "show", "..")
    assert code == 2 and "is not a run id" in err


PREFIXED = f"{UNREACHABLE}/v1"


@pytest.mark.parametrize(
    ("args", "env", "given_as", "url"),
    [
        (["--url", PREFIXED, "runs", "list"], {}, "--url", PREFIXED),
        (["runs", "list"], {"BROKER_URL": f"{PREFIXED}/"}, "BROKER_URL", f"{PREFIXED}/"),
        (["accounting", "r", "--url", PREFIXED], {"BROKER_URL": UNREACHABLE}, "--url", PREFIXED),
        (["watch", "r", "--count", "1"], {"BROKER_URL": PREFIXED}, "BROKER_URL", PREFIXED),
    ],
    ids=["global --url", "BROKER_URL", "the command's --url", "watch"],
)
def test_a_url_with_the_api_prefix_is_refused_before_any_request(
    args: list[str], env: dict[str, str | None], given_as: str, url: str
) -> None:
    """The client adds /v1 itself: the URL is the broker's base URL, and the one line says
    where the wrong one came from and what the right one is."""
    code, out, err = invoke(*args, env=env)
    assert code == 2 and out == ""
    assert err == (
        f"error: {given_as} {url} ends in /v1, the API's prefix: give the broker's base URL "
        f"without it, {UNREACHABLE}\n"
    )


def test_only_a_path_ending_in_v1_is_the_api_prefix() -> None:
    code, _, err = invoke("--url", f"{UNREACHABLE}/api/v1/", "runs", "list")
    assert code == 2 and err.endswith(f"without it, {UNREACHABLE}/api\n"), err
    for path in ("/v10", "/v1x", "/v1/runs", "/api"):
        code, _, err = invoke("--url", f"{UNREACHABLE}{path}", "runs", "list")
        assert code == 1 and err.startswith(f"error: cannot reach the broker at {UNREACHABLE}"), (
            path,
            err,
        )


def test_a_url_with_the_api_prefix_stops_only_the_operator_commands() -> None:
    """``--version`` and the server's own commands do not use the URL."""
    env: dict[str, str | None] = {"BROKER_URL": PREFIXED, "BROKER_REDIS_URL": None}
    code, out, _ = invoke("--version", env=env)
    assert (code, out) == (0, f"rollout-broker {app.__version__}\n")
    code, _, err = invoke("worker", env=env)
    assert code == 2 and "BROKER_REDIS_URL" in err and "/v1" not in err
