"""docker-compose.yml and its Dockerfile against the code they run (no Docker engine here): the
commands are real commands of our CLI, the environment is made of our settings, the worker's
health check reads what the running worker writes, and the start order migrates first."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml

from app.cli import cli
from app.settings import Settings
from tests.cli_process import broker_env, rollout_broker
from tests.conftest import REDIS_URL

REPO = Path(__file__).resolve().parents[1]
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return doc


def services(compose: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = compose["services"]
    return out


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def broker_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in services(compose).items()
        if command(svc)[:1] == ["rollout-broker"]
    }


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the defaults (no variable set)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def dockerfile_cmd() -> list[str]:
    lines = (REPO / "Dockerfile").read_text().splitlines()
    (cmd,) = [ln for ln in lines if ln.startswith("CMD ")]
    parsed: list[str] = yaml.safe_load(cmd.removeprefix("CMD "))  # the exec form is JSON
    return parsed


def parse_cli(args: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``rollout-broker <args>`` the way the installed command would, without running
    it; an unknown command or option, or a value of the wrong type, fails the test."""
    group = typer.main.get_command(cli)
    name, *rest = args
    with group.make_context("rollout-broker", list(args)) as top:
        sub = group.get_command(top, name)  # type: ignore[attr-defined]
        assert sub is not None, f"`rollout-broker {name}` is no command"
        try:
            with sub.make_context(name, list(rest), parent=top) as ctx:
                return name, dict(ctx.params)
        except Exception as exc:
            if getattr(exc, "exit_code", None) == 2:  # click's usage errors
                raise AssertionError(f"`rollout-broker {' '.join(args)}`: {exc}") from exc
            raise


@pytest.mark.parametrize(
    "args", [["serve", "--no-such-option"], ["serve", "--port", "eighty"], ["drain"]]
)
def test_parse_cli_refuses_what_the_cli_would(args: list[str]) -> None:
    with pytest.raises(AssertionError):
        parse_cli(args)


def test_every_broker_command_is_one_of_ours(compose: dict[str, Any]) -> None:
    commands = {name: command(svc) for name, svc in broker_services(compose).items()}
    commands["Dockerfile CMD"] = dockerfile_cmd()
    assert {"serve", "worker", "migrate"} <= {c[1] for c in commands.values()}
    for where, cmd in commands.items():
        assert cmd[0] == "rollout-broker", where
        parse_cli(cmd[1:])


def test_every_variable_of_the_broker_services_is_a_setting(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renamed or removed setting fails here, not silently in a container that ignores it."""
    for name in [k for k in os.environ if k.startswith("BROKER_")]:
        monkeypatch.delenv(name)
    for name, svc in broker_services(compose).items():
        env = {k: interpolate(str(v)) for k, v in svc.get("environment", {}).items()}
        assert env, f"{name} sets no BROKER_* variable"
        for key in env:
            field = key.removeprefix("BROKER_").lower()
            assert key.startswith("BROKER_") and field in Settings.model_fields, (name, key)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            settings = Settings()  # the values validate as they are
        assert not settings.embedded, f"{name} would start embedded services in the container"
        for url in (settings.redis_url, settings.database_url):
            host = urlsplit(url).hostname
            assert host in services(compose), f"{name}: {host} is not a service of the file"


def test_migrations_run_once_before_the_api_and_the_worker(compose: dict[str, Any]) -> None:
    svcs = services(compose)
    parsed = {name: parse_cli(command(svc)[1:]) for name, svc in broker_services(compose).items()}
    (migrate,) = [name for name, (cmd, _) in parsed.items() if cmd == "migrate"]
    assert svcs[migrate].get("restart") == "no", "a one-shot migration must not restart"
    for name, (cmd, params) in parsed.items():
        if cmd in ("serve", "worker"):
            assert not params.get("migrate"), f"{name} migrates on every start"
            dep = svcs[name].get("depends_on", {}).get(migrate)
            assert dep == {"condition": "service_completed_successfully"}, name
    for name, svc in svcs.items():
        for dep, how in svc.get("depends_on", {}).items():
            assert dep in svcs, f"{name} depends on unknown {dep}"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in svcs[dep], f"{dep} has no healthcheck"
    # The migration itself needs a database that accepts connections.
    deps = svcs[migrate]["depends_on"]
    assert any(deps[d]["condition"] == "service_healthy" for d in deps)


def test_redis_fsyncs_every_write(compose: dict[str, Any]) -> None:
    """What the broker acknowledged survives a crash of Redis itself."""
    (redis,) = [s for s in services(compose).values() if command(s)[:1] == ["redis-server"]]
    cmd = command(redis)
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "always"
    data = [v for v in redis.get("volumes", []) if v.split(":")[1:] == ["/data"]]
    assert data, "the append-only file must outlive the container"


def test_the_api_health_check_probes_the_published_port(compose: dict[str, Any]) -> None:
    for svc in broker_services(compose).values():
        name, params = parse_cli(command(svc)[1:])
        if name != "serve":
            continue
        port = params["port"]
        assert any(interpolate(str(p)).endswith(f":{port}") for p in svc["ports"])
        assert f"127.0.0.1:{port}/readyz" in " ".join(svc["healthcheck"]["test"])


def test_the_api_runs_with_auth_on_and_does_not_start_without_its_admin_token(
    compose: dict[str, Any],
) -> None:
    """The API listens on 0.0.0.0 in its container: auth is on, its bootstrap admin token must
    come from the operator (compose refuses ``${VAR:?...}`` unset), and the port is published
    on loopback unless the operator chooses otherwise."""
    served = 0
    for svc in broker_services(compose).values():
        if parse_cli(command(svc)[1:])[0] != "serve":
            continue
        served += 1
        env = svc["environment"]
        assert env["BROKER_AUTH"] == "on"
        assert re.fullmatch(r"\$\{BROKER_ADMIN_TOKEN:\?.+\}", env["BROKER_ADMIN_TOKEN"])
        assert all(interpolate(str(p)).startswith("127.0.0.1:") for p in svc["ports"])
    assert served == 1


def test_volumes_are_declared(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes") or {})
    for svc in services(compose).values():
        for v in svc.get("volumes", []):
            source = v.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in named


def test_the_image_holds_every_package_of_the_distribution() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = [
        ln.split()[1]
        for ln in (REPO / "Dockerfile").read_text().splitlines()
        if ln.startswith("COPY ")
    ]
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"{pattern} is not copied into the image"
    assert not any(
        ln.startswith("USER root") for ln in (REPO / "Dockerfile").read_text().splitlines()
    )


def _health_check(compose: dict[str, Any]) -> tuple[list[str], str]:
    worker = next(s for s in broker_services(compose).values() if command(s)[1] == "worker")
    beat = worker["environment"]["BROKER_WORKER_HEARTBEAT_FILE"]
    test = worker["healthcheck"]["test"]
    assert test[0] == "CMD" and beat in " ".join(test)
    return test[1:], beat


def test_the_worker_health_check_follows_the_running_workers_heartbeat(
    compose: dict[str, Any], prefix: str, database_url: str, tmp_path: Path
) -> None:
    """Run `rollout-broker worker` with the compose file's settings (on the test services),
    then the compose file's health check: healthy while the worker beats, not once it stops."""
    check, beat = _health_check(compose)
    path = tmp_path / "heartbeat"
    probe = [sys.executable if c == "python" else c.replace(beat, str(path)) for c in check]

    def healthy() -> bool:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0

    assert not healthy()  # no heartbeat yet
    worker = next(s for s in broker_services(compose).values() if command(s)[1] == "worker")
    env = broker_env(**{k: interpolate(str(v)) for k, v in worker["environment"].items()})
    env.update(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_WORKER_HEARTBEAT_FILE=str(path),
    )
    with rollout_broker(*command(worker)[1:], env=env) as proc:
        deadline = time.monotonic() + 30
        while not healthy():
            assert proc.proc.poll() is None, proc.output()
            assert time.monotonic() < deadline, "the health check never passed:\n" + proc.output()
            time.sleep(0.05)
        assert proc.stop(signal.SIGTERM) == 0, proc.output()
    old = time.time() - 3600
    os.utime(path, (old, old))  # what an hour without a beat looks like
    assert not healthy()
