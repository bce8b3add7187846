"""The ``rollout-broker`` command: run the API, the workers, the migrations, and the operator
commands (``runs``, ``policy``, ``batches``, ``accounting``, ``prompts``, ``watch``, ``tokens``,
``audit``), which go through the HTTP client with the token of ``--token`` or ``BROKER_TOKEN``.

Every error ends a command with one line on stderr (``error: ...``) and a non-zero status:
``1`` for what went wrong at run time, ``2`` for a bad command line. ``watch`` waits through a
broker that cannot be reached and a run that does not exist yet."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, cast

import typer

from app.settings import Settings

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rollout_broker_client import (
        AccessToken,
        Accounting,
        AuditEntry,
        BrokerClient,
        PromptCounts,
        PromptState,
        Retry,
        Run,
        Scope,
        TrainingVersion,
        VersionAccounting,
    )

cli = typer.Typer(
    help="Rollout Broker: versioned rollouts in, leased batches out, exact sample accounting.",
    no_args_is_help=True,
    add_completion=False,
)
runs_cli = typer.Typer(help="List, create, show, configure and close runs.", no_args_is_help=True)
policy_cli = typer.Typer(help="Policy versions of a run.", no_args_is_help=True)
batches_cli = typer.Typer(help="Leased batches of a run.", no_args_is_help=True)
tokens_cli = typer.Typer(
    help="Create, list and revoke the access tokens of a broker with auth on (scope admin).",
    no_args_is_help=True,
)
cli.add_typer(runs_cli, name="runs")
cli.add_typer(policy_cli, name="policy")
cli.add_typer(batches_cli, name="batches")
cli.add_typer(tokens_cli, name="tokens")

Url = Annotated[
    str,
    typer.Option("--url", envvar="BROKER_URL", help="Broker API base URL", show_envvar=True),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]
_TOKEN_HELP = (
    "Bearer token for a broker with auth on; BROKER_TOKEN keeps it off the command line, "
    "where other users of the machine can read it"
)
Token = Annotated[
    str | None,
    typer.Option(
        "--token", help=_TOKEN_HELP + " (default: the global --token)", show_default=False
    ),
]


@dataclasses.dataclass
class _GlobalOptions:
    token: str | None = None


_global = _GlobalOptions()
"""The options given before the command's name, set by :func:`_options` at every invocation."""


@cli.callback()
def _options(
    token: Annotated[
        str | None,
        typer.Option(
            "--token", envvar="BROKER_TOKEN", show_envvar=True, show_default=False, help=_TOKEN_HELP
        ),
    ] = None,
) -> None:
    # Runs before every command; the commands that call the API take the token from here
    # unless they are given one of their own.
    _global.token = token


def _run_id(value: str | None) -> str | None:
    """A run id as the broker accepts them (``RunId``), checked before any request: ``.`` and
    ``..`` would not even reach the run, a URL path resolves them away."""
    if value is None:
        return value
    from pydantic import TypeAdapter, ValidationError

    from app.ids import RunId

    try:
        TypeAdapter(RunId).validate_python(value)
    except ValidationError:
        raise typer.BadParameter(
            f"{value!r} is not a run id: 1 to 128 of A-Z a-z 0-9 . _ -, other than . and .."
        ) from None
    return value


RunArg = Annotated[str, typer.Argument(help="Run id", callback=_run_id)]


def _fail(message: str, code: int = 1) -> typer.Exit:
    """End the command with ``message`` as its one line on stderr."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


# -- services ------------------------------------------------------------------------------------
# The command line is where the API and the workers meet: the one place under app/ that imports
# workers/, and only inside the commands that start them.

Migrate = Annotated[
    bool,
    typer.Option(
        "--migrate",
        help="Upgrade the configured database to the latest schema first (`rollout-broker "
        "migrate`); the embedded Postgres always is",
    ),
]


def _settings() -> Settings:
    """The ``BROKER_*`` settings; one that does not validate ends the command with one line
    naming the variable and what is wrong, never its value (it may be a secret)."""
    from pydantic import ValidationError

    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"{_env_name(e['loc'])}: {e['msg']}" for e in exc.errors(include_input=False)
        )
        raise _fail(f"invalid settings: {problems}") from None


def _env_name(loc: tuple[int | str, ...]) -> str:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    return (prefix + "_".join(str(part) for part in loc)).upper() if loc else "settings"


def _auth_settings(settings: Settings, host: str) -> Settings:
    """``settings`` with auth decided for a listener on ``host`` (on, unless BROKER_AUTH says,
    for a non-loopback address); a set-up nobody could sign in to ends the command with its
    one line. Says on stderr when auth is on, and when it is off on a non-loopback address."""
    from app.access.startup import AuthSetupError, is_loopback, resolve_auth

    try:
        resolved = resolve_auth(settings, host)
    except AuthSetupError as exc:
        raise _fail(str(exc)) from None
    if resolved.auth:
        typer.echo("auth is on: every /v1 request needs a bearer token", err=True)
    elif not is_loopback(host):
        typer.echo(
            f"warning: auth is off (BROKER_AUTH=off) on {host}: whoever reaches the port may "
            "do anything",
            err=True,
        )
    return resolved


def _embedded_settings(settings: Settings, data_dir: Path | None) -> tuple[Settings, object]:
    from app.embedded import EmbeddedStartError, default_data_dir, start_embedded

    folder = data_dir or settings.data_dir or default_data_dir()
    try:
        services = start_embedded(folder)
    except EmbeddedStartError as exc:  # its message says why, and what to do
        raise _fail(str(exc)) from None
    typer.echo(f"embedded Redis and Postgres under {folder}", err=True)
    updated = settings.model_copy(
        update={
            "redis_url": services.redis_url,
            "database_url": services.database_url,
            "workers_in_process": True,
        }
    )
    return updated, services


def _upgrade(database_url: str) -> None:
    """Migrate to the latest schema; a database that cannot be reached or migrated ends the
    command with one line naming it and the driver's reason."""
    from alembic.util import CommandError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from app.db import upgrade_to_head_sync

    try:
        upgrade_to_head_sync(database_url)
    except (OSError, SQLAlchemyError, CommandError) as exc:  # the driver's errors come wrapped
        where = make_url(database_url).render_as_string(hide_password=True)
        raise _fail(f"cannot migrate the database {where}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """An error's innermost cause on one line: the driver's message rather than SQLAlchemy's
    wrapping of it, or the exception's name when it has none."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "orig", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@cli.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0: any free port)")] = 8000,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data folder of the embedded services")
    ] = None,
    with_workers: Annotated[
        bool, typer.Option(help="Also run the background workers in this process")
    ] = False,
    migrate: Migrate = False,
    api_processes: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="API processes serving the port, one core each (the background workers "
            "still run once, in this command's own process)",
        ),
    ] = 1,
) -> None:
    """Run the HTTP API. With no BROKER_REDIS_URL / BROKER_DATABASE_URL, start embedded ones
    (and migrate them); against configured ones, /readyz answers 503 until `migrate` ran.
    Auth (BROKER_AUTH) is on for a non-loopback --host unless set off; with it on, set
    BROKER_ADMIN_TOKEN (or have an admin token in the database) to create tokens with."""
    import uvicorn

    from app.main import create_app
    from workers.runner import run_workers

    settings = _settings()
    services = None
    if settings.embedded:
        settings, services = _embedded_settings(settings, data_dir)
        migrate = True  # nobody else can reach this Postgres to migrate it
    elif settings.redis_url is None or settings.database_url is None:
        missing = "BROKER_REDIS_URL" if settings.redis_url is None else "BROKER_DATABASE_URL"
        raise typer.BadParameter(
            f"{missing} is not set: set both BROKER_REDIS_URL and BROKER_DATABASE_URL, "
            "or neither to start embedded ones"
        )
    if with_workers:
        settings = settings.model_copy(update={"workers_in_process": True})
    try:
        if migrate:
            assert settings.database_url is not None
            _upgrade(settings.database_url)
        # Decided on the final settings (the embedded services' URLs), after any migration,
        # so that an admin token stored in the database is found.
        settings = _auth_settings(settings, host)
        if api_processes > 1:
            _serve_processes(settings, host, port, api_processes)
            return
        app = create_app(settings, background=run_workers if settings.workers_in_process else None)
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        if services is not None:
            services.stop()  # type: ignore[attr-defined]


def _serve_processes(settings: Settings, host: str, port: int, processes: int) -> None:
    """``processes`` uvicorn workers on one port. Each builds its app from the environment
    (``app.main:create_app``), where the final settings are put for it; the background workers,
    if any, run once, here beside uvicorn's supervisor, never in the API processes. Their
    request metrics are summed through a folder of this command's own, removed at exit."""
    import shutil
    import tempfile

    import uvicorn

    from app.metrics import MULTIPROC_DIR

    metrics_dir = tempfile.mkdtemp(prefix="rollout-broker-metrics-")
    api = settings.model_copy(update={"workers_in_process": False})
    try:
        with _environment({**_settings_env(api), MULTIPROC_DIR: metrics_dir}):
            read = Settings()  # what every API process will read
            if wrong := [n for n in Settings.model_fields if getattr(read, n) != getattr(api, n)]:
                raise _fail(f"settings lost on their way to the API processes: {wrong}")
            typer.echo(
                f"{processes} API processes; their request metrics are summed in {metrics_dir}",
                err=True,
            )
            with _workers_beside(settings if settings.workers_in_process else None):
                uvicorn.run(
                    "app.main:create_app",
                    factory=True,
                    host=host,
                    port=port,
                    workers=processes,
                    log_level="info",
                )
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _settings_env(settings: Settings) -> dict[str, str | None]:
    """``settings`` as the ``BROKER_*`` variables that :class:`Settings` reads back; ``None``
    for a variable to unset. Secrets among them stay in the processes' memory, never on disk."""
    from pydantic import SecretStr

    out: dict[str, str | None] = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        out[_env_name((name,))] = None if value is None else str(value)
    return out


@contextlib.contextmanager
def _environment(variables: dict[str, str | None]) -> Iterator[None]:
    """This process's environment (which the processes it starts inherit) with ``variables``
    set or unset, whatever their case (Settings reads them case-insensitively); restored after."""
    names = {name.upper() for name in variables}
    saved = {k: v for k, v in os.environ.items() if k.upper() in names}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in variables.items() if v is not None})
    try:
        yield
    finally:
        for key in names:
            os.environ.pop(key, None)
        os.environ.update(saved)


@contextlib.contextmanager
def _workers_beside(settings: Settings | None) -> Iterator[None]:
    """The background workers on a thread of this process while the block runs (nothing when
    ``settings`` is None). If they fail, this process gets SIGTERM, which stops the API
    processes, and the command ends with the reason."""
    if settings is None:
        yield
        return
    from workers.runner import run_workers

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(run_workers(settings, stop))
        except Exception as exc:
            failed.append(exc)
            logging.getLogger("rollout_broker").exception("the background workers failed")
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, name="broker-workers")
    thread.start()
    try:
        yield
    finally:
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()
    if failed:
        raise _fail(f"the background workers stopped: {_reason(failed[0])}")


async def _schema_missing(database_url: str) -> bool:
    """True when Postgres answers and its schema is not at head. An unreachable one is the
    drain's to wait out, as it waits out any outage."""
    from sqlalchemy.exc import SQLAlchemyError

    from app.db import create_engine, schema_at_head

    engine = create_engine(database_url)
    try:
        return not await schema_at_head(engine)
    except (OSError, SQLAlchemyError):
        return False
    finally:
        await engine.dispose()


@cli.command()
def worker(
    interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between maintenance sweeps  [default: BROKER_SWEEP_INTERVAL_S]",
            min=0.001,
            max=60,
        ),
    ] = None,
    migrate: Migrate = False,
) -> None:
    """Run the background workers only (lease expiry, group timeouts, accounting drain) until
    SIGTERM or SIGINT."""
    from workers.runner import run_workers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = _settings()
    if settings.redis_url is None:
        raise typer.BadParameter("set BROKER_REDIS_URL (and BROKER_DATABASE_URL) for `worker`")
    if interval is not None:
        settings = settings.model_copy(update={"sweep_interval_s": interval})
    if migrate and settings.database_url is not None:
        _upgrade(settings.database_url)

    async def main() -> int:
        if settings.database_url is not None and await _schema_missing(settings.database_url):
            typer.echo(
                "error: the accounting database is not at the latest schema: run "
                "`rollout-broker migrate` first (or `worker --migrate`)",
                err=True,
            )
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_workers(settings, stop)
        return 0

    code = asyncio.run(main())
    if code:
        raise typer.Exit(code)


@cli.command()
def migrate() -> None:
    """Upgrade the accounting database to the latest schema (Alembic upgrade head); once per
    release, before the new API and worker processes start."""
    settings = _settings()
    if settings.database_url is None:
        raise typer.BadParameter("set BROKER_DATABASE_URL for `migrate`")
    _upgrade(settings.database_url)
    typer.echo("database is at the latest schema")


# -- operator commands: plumbing -----------------------------------------------------------------


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False)  # built per command: it binds the current sys.stdout


@contextlib.contextmanager
def _broker(
    url: str, token: str | None = None, retry: Retry | None = None
) -> Iterator[BrokerClient]:
    """A client for one command, with the command's ``--token``, else the global one (or
    ``BROKER_TOKEN``); broker errors become one line on stderr and exit status 1. A request is
    sent again a few times, for a second or so, before the broker counts as unreachable: an
    operator waits for an answer, not for a minute of retries."""
    from rollout_broker_client import (
        BrokerClient,
        BrokerError,
        BrokerHTTPError,
        BrokerUnreachable,
        Forbidden,
        Unauthorized,
    )
    from rollout_broker_client import Retry as RetryPolicy

    try:
        client = BrokerClient(
            url, retry=retry or RetryPolicy(retries=3), token=token or _global.token
        )
    except ValueError as err:  # a token that cannot be sent; the message does not quote it
        raise _fail(str(err)) from None
    try:
        with client as broker:
            yield broker
    except Unauthorized as err:
        raise _fail(
            f"{err.error}: {err.detail}; pass --token or set BROKER_TOKEN to a token of this broker"
        ) from None
    except Forbidden as err:
        raise _fail(
            f"{err.error}: {err.detail}; pass --token or set BROKER_TOKEN to a token allowed to "
            "do this"
        ) from None
    except BrokerHTTPError as err:
        raise _fail(f"{err.error}: {err.detail}") from None
    except BrokerUnreachable as err:
        raise _fail(f"cannot reach the broker at {url}: {err}") from None
    except BrokerError as err:
        raise _fail(f"{type(err).__name__}: {err}") from None


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _jsonable(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name != "raw"
        }
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


T = TypeVar("T")


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(_jsonable(value), indent=2, sort_keys=True))


def _show(value: T, as_json: bool, render: Callable[[T], Any]) -> None:
    """``value`` as JSON (``--json``), or as what ``render`` makes of it for a person."""
    if as_json:
        _print_json(value)
    else:
        _console().print(render(value))


def _parse_config(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as JSON when it parses (numbers, true/false), else
    taken as a string (``order=fifo``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--config")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _fmt(value: float | int | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "–"


# -- runs ----------------------------------------------------------------------------------------


def _run_table(runs: list[Run]) -> RenderableType:
    from rich.table import Table

    table = Table(title="Runs")
    for col in ("run_id", "status", "version", "group_size", "max_staleness", "max_reuse"):
        table.add_column(col, justify="left" if col in ("run_id", "status") else "right")
    table.add_column("created_at")
    for r in runs:
        c = r.config
        table.add_row(
            r.run_id,
            r.status,
            str(r.policy_version),
            str(c.get("group_size", "")),
            str(c.get("max_staleness", "")),
            str(c.get("max_reuse", "")),
            r.created_at.isoformat(timespec="seconds"),
        )
    return table


def _run_detail(run: Run) -> RenderableType:
    from rich.table import Table

    table = Table(title=f"Run {run.run_id}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("status", run.status)
    table.add_row("policy_version", str(run.policy_version))
    table.add_row("created_at", run.created_at.isoformat())
    for key, value in sorted(run.config.items()):
        table.add_row(key, json.dumps(value))
    return table


@runs_cli.command("list")
def runs_list(
    status: Annotated[
        Literal["open", "closed"] | None, typer.Option(help="Only open or only closed runs")
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Every run (not deleted), newest first."""
    with _broker(url, token) as broker:
        runs = broker.list_runs(status)
    _show(runs, as_json, _run_table)


@runs_cli.command("create")
def runs_create(
    run_id: Annotated[
        str | None, typer.Argument(help="Run id (default: a new one)", callback=_run_id)
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            "-c",
            help="RunConfig field of the new run as KEY=VALUE; repeat for more (`runs config` "
            "changes an existing run's)",
        ),
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a run (the same id and config again is a no-op; another config for an existing
    run is refused: change it with `runs config`)."""
    from rollout_broker_client import RunConflict

    cfg = _parse_config(config or [])
    with _broker(url, token) as broker:
        try:
            run = broker.create_run(run_id, cfg)
        except RunConflict as err:
            raise _fail(
                f"{err.error}: {err.detail}; change its config with "
                f"`rollout-broker runs config {run_id} -c KEY=VALUE`"
            ) from None
    _show(run, as_json, _run_detail)


@runs_cli.command("config")
def runs_config(
    run_id: RunArg,
    config: Annotated[
        list[str],
        typer.Option("--config", "-c", help="RunConfig field as KEY=VALUE; repeat for more"),
    ],
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Change fields of a run's config (the others keep their values); the rules apply from the
    broker's next decision on."""
    cfg = _parse_config(config)
    with _broker(url, token) as broker:
        run = broker.patch_config(run_id, **cfg)
    _show(run, as_json, _run_detail)


@runs_cli.command("show")
def runs_show(
    run_id: RunArg,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A run's status, policy version and config."""
    with _broker(url, token) as broker:
        run = broker.get_run(run_id)
    _show(run, as_json, _run_detail)


@runs_cli.command("close")
def runs_close(
    run_id: RunArg,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Close a run: its buffered rollouts retire (run_closed); the accounting stays."""
    with _broker(url, token) as broker:
        run = broker.close_run(run_id)
    _show(run, as_json, _run_detail)


@runs_cli.command("delete")
def runs_delete(
    run_id: Annotated[str, typer.Argument(help="Run id")],
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Delete a closed run's live state once its accounting has caught up; the accounting
    stays. Refused (409) while the run is open, or until its leases are back and its events
    applied."""
    with _broker(url, token) as broker:
        broker.delete_run(run_id)
    _console().print(f"run {run_id} deleted")


# -- policy --------------------------------------------------------------------------------------


@policy_cli.command("set")
def policy_set(
    run_id: RunArg,
    version: Annotated[int, typer.Argument(help="The new policy version", min=0)],
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Announce a new policy version; rollouts now too stale retire."""
    with _broker(url, token) as broker:
        result = broker.set_policy(run_id, version)
    if as_json:
        _print_json(result)
    else:
        typer.echo(
            f"run {run_id} is at policy version {result.policy_version}; "
            f"{result.evicted} rollouts retired as stale"
        )


# -- batches -------------------------------------------------------------------------------------


@batches_cli.command("nack")
def batches_nack(
    run_id: RunArg,
    batch_id: Annotated[str, typer.Argument(help="Batch id (from the lease)")],
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Give a leased batch back unused: its rollouts return to the buffer as they were, as when
    its trainer fails (and it does not wait for the lease to expire)."""
    with _broker(url, token) as broker:
        returned = broker.nack(run_id, batch_id)
    if as_json:
        _print_json({"returned": returned})
    else:
        typer.echo(f"batch {batch_id} of run {run_id}: {returned} rollouts back in the buffer")


# -- accounting ----------------------------------------------------------------------------------


def _histogram(hist: dict[int, int], width: int = 16) -> str:
    if not hist:
        return "–"
    top = max(hist.values()) or 1
    lines = []
    for lag in sorted(hist):
        n = hist[lag]
        bar = "█" * max(1 if n else 0, round(width * n / top))
        lines.append(f"lag {lag:>2} {bar} {n:,}")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:,.1f} s"


def _prompt_line(p: PromptCounts) -> str:
    return (
        f"queued {p.queued:,}, in flight {p.in_flight:,}, done {p.done:,}, failed {p.failed:,}"
        f" (retried {p.retried:,})"
    )


def ledger_check(acc: Accounting) -> tuple[bool, str]:
    """Whether the accounting can be trusted, and why not: the ledger's buffered and leased
    equal the broker's live counts (``live``), every event is applied (``pending_events`` 0),
    none was dead-lettered, and received = buffered + leased + retired. A broker that does not
    report ``live`` or ``dead_letters`` cannot be checked: no ✓ then."""
    raw = acc.raw
    why = []
    if acc.unaccounted:
        why.append(f"off by {acc.unaccounted:,}")
    live = raw.get("live")
    if not isinstance(live, dict):
        why.append("the broker does not report its live counts")
    elif (acc.buffered, acc.leased) != (live.get("buffered"), live.get("leased")):
        why.append(
            f"the ledger's buffered {acc.buffered:,}, leased {acc.leased:,} are not the live "
            f"{live.get('buffered')}, {live.get('leased')}"
        )
    if acc.pending_events is None:
        why.append("the broker does not report pending events")
    elif acc.pending_events:
        why.append(f"{acc.pending_events:,} events not yet applied")
    dead = raw.get("dead_letters")
    if dead is None:
        why.append("the broker does not report dead letters")
    elif dead:
        why.append(f"{dead:,} dead letters")
    return not why, "; ".join(why)


def accounting_table(acc: Accounting, run: Run | None = None) -> RenderableType:
    """The accounting as a readable table: prompts handed out (for runs that use work leases),
    where rollouts went and what became samples."""
    from rich.table import Table

    name = run.run_id if run is not None else "run"
    table = Table(title=f"Accounting of {name}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("count", justify="right")
    table.add_column("notes")

    def section(title: str) -> None:
        table.add_row(f"[cyan]{title}[/]", "", "", end_section=False)

    p = acc.prompts
    if p.registered:  # a run whose generators take their work from the broker
        section("prompts (passes)")
        table.add_row("registered", _fmt(p.registered), "")
        table.add_row("queued", _fmt(p.queued), "waiting for a generator")
        table.add_row("in flight", _fmt(p.in_flight), "in work leases, or groups not yet used")
        table.add_row("done", _fmt(p.done), "reached a gradient (or retired zero_variance)")
        table.add_row("failed", _fmt(p.failed), "ran out of attempts")
        table.add_row("retried", _fmt(p.retried), "attempts after the first")
        check = "✓" if p.unaccounted == 0 else f"✗ off by {p.unaccounted:,}"
        table.add_row(
            "queued + in flight + done + failed",
            check,
            f"{p.queued:,} + {p.in_flight:,} + {p.done:,} + {p.failed:,} = {p.registered:,}"
            " registered",
            end_section=True,
        )
    section("rollouts in")
    table.add_row("rollouts received", _fmt(acc.rollouts_received), "accepted into the buffer")
    gs = run.config.get("group_size") if run is not None else None
    table.add_row(
        "groups received",
        _fmt(acc.groups_received),
        f"group_size {gs}" if gs is not None else "",
    )
    table.add_row("duplicates", _fmt(acc.duplicates), "repeated rollout_ids, not counted")
    table.add_row("rejected", _fmt(sum(acc.rejected.values())), _reasons(acc.rejected))
    table.add_row("tokens generated", _fmt(acc.tokens_generated), "")
    section("where they are")
    table.add_row("buffered", _fmt(acc.buffered), "")
    table.add_row("leased", _fmt(acc.leased), "in live leases")
    table.add_row("retired", _fmt(acc.retired_total), _reasons(acc.retired))
    table.add_row("wasted tokens", _fmt(acc.wasted_tokens), "of rollouts retired unused")
    ok, why = ledger_check(acc)
    table.add_row(
        "buffered + leased + retired",
        "✓" if ok else "✗",
        f"{acc.buffered:,} + {acc.leased:,} + {acc.retired_total:,} = {acc.rollouts_received:,}"
        " received",
    )
    table.add_row(
        "ledger = live",
        "",
        "buffered and leased as the broker counts them, all events applied, none dead-lettered"
        if ok
        else f"✗ {why}",
        end_section=True,
    )
    section("waits")
    table.add_row("generators waited", _seconds(acc.wait.generator_s), "for prompts or budget")
    table.add_row("trainers waited", _seconds(acc.wait.trainer_s), "for rollouts", end_section=True)
    section("samples out")
    max_reuse = run.config.get("max_reuse") if run is not None else None
    table.add_row("samples consumed", _fmt(acc.samples_consumed), "Σ uses = Σ acked batch sizes")
    table.add_row("tokens consumed", _fmt(acc.tokens_consumed), "")
    table.add_row(
        "reuse factor",
        _fmt(acc.reuse_factor, 3),
        "samples / rollouts" + (f" (max_reuse {max_reuse})" if max_reuse is not None else ""),
    )
    b = acc.batches
    table.add_row(
        "batches",
        _fmt(b.leased),
        f"acked {b.acked:,}, nacked {b.nacked:,}, expired {b.expired:,}",
        end_section=True,
    )
    section("off-policy")
    table.add_row("lag", f"mean {_fmt(acc.lag.mean, 3)}", f"max {_fmt(acc.lag.max)}")
    table.add_row("lag histogram", "", _histogram(acc.lag.histogram))
    table.add_row("KL", f"mean {_fmt(acc.kl.mean, 3)}", f"max {_fmt(acc.kl.max, 3)}")
    table.add_row(
        "IS ratio",
        f"mean {_fmt(acc.is_ratio.mean, 4)}",
        f"clip fraction {_fmt(acc.is_ratio.clip_fraction, 3)}",
    )
    if acc.pending_events:
        table.caption = f"{acc.pending_events} events not yet in the accounting"
    return table


def versions_table(rows: list[VersionAccounting]) -> RenderableType:
    from rich import box
    from rich.table import Table

    reasons = sorted({k for v in rows for k in v.retired})
    table = Table(
        title="Accounting by policy version",
        caption="retired, by reason, on the right",
        box=box.SIMPLE_HEAD,
    )
    for col in ("version", "received", "buffered", "leased", "samples", "reuse", "lag", *reasons):
        table.add_column(col, justify="right")
    for v in rows:
        table.add_row(
            str(v.policy_version),
            _fmt(v.rollouts_received),
            _fmt(v.buffered),
            _fmt(v.leased),
            _fmt(v.samples_consumed),
            _fmt(v.reuse_factor, 3),
            _fmt(v.lag.mean, 3),
            *(_fmt(v.retired.get(k, 0)) for k in reasons),
        )
    return table


def training_table(rows: list[TrainingVersion]) -> RenderableType:
    from rich import box
    from rich.table import Table

    table = Table(
        title="Training by policy version",
        caption="acknowledged batches by the trainer's version V of their lease",
        box=box.SIMPLE_HEAD,
    )
    for col in ("version", "batches", "samples", "tokens", "KL mean", "KL max", "IS mean", "clip"):
        table.add_column(col, justify="right")
    for v in rows:
        table.add_row(
            str(v.policy_version),
            _fmt(v.batches),
            _fmt(v.samples),
            _fmt(v.tokens),
            _fmt(v.kl_mean, 3),
            _fmt(v.kl_max, 3),
            _fmt(v.is_ratio_mean, 4),
            _fmt(v.clip_fraction, 3),
        )
    return table


@cli.command()
def accounting(
    run_id: RunArg,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
    versions: Annotated[
        bool, typer.Option("--versions", help="Per policy version of the rollouts")
    ] = False,
    training: Annotated[
        bool,
        typer.Option(
            "--training",
            help="Per policy version of the trainer: batches, samples, tokens, KL, IS ratio, clip",
        ),
    ] = False,
) -> None:
    """A run's sample/rollout accounting (from Postgres; may trail by a second or two)."""
    if versions and training:
        raise typer.BadParameter(
            "they cannot be used together: give one", param_hint="'--versions' / '--training'"
        )
    with _broker(url, token) as broker:
        if versions:
            rows = broker.accounting_versions(run_id)
            _show(rows, as_json, versions_table)
            return
        if training:
            trained = broker.accounting_training(run_id)
            _show(trained, as_json, training_table)
            return
        acc = broker.accounting(run_id)
        run = None if as_json else broker.get_run(run_id)
    if as_json:
        typer.echo(json.dumps(acc.raw, indent=2, sort_keys=True, default=str))
    else:
        _console().print(accounting_table(acc, run))


# -- prompts -------------------------------------------------------------------------------------

# The states of a prompt pass (the client's PromptStateName), spelled here for typer to read.
PassState = Literal["queued", "in_flight", "done", "failed"]


def prompts_table(
    run_id: str, rows: list[PromptState], counts: PromptCounts | None, more: bool
) -> RenderableType:
    """The run's passes counted by state, then the passes listed one per line."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    table = Table(
        title=f"Prompt passes of {run_id}",
        caption=f"{len(rows):,} shown; more with --limit (0: all)" if more else None,
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for col in ("prompt_id", "pass", "attempt", "state", "tries"):
        table.add_column(col, justify="left" if col in ("prompt_id", "state") else "right")
    for r in rows:
        table.add_row(r.prompt_id, str(r.pass_), str(r.attempt), r.state, str(r.tries))
    if counts is None:
        return table
    return Group(f"{counts.registered:,} passes registered: {_prompt_line(counts)}", table)


@cli.command()
def prompts(
    run_id: RunArg,
    state: Annotated[
        PassState | None, typer.Option("--state", "-s", help="Only passes in this state")
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Show at most this many passes (0: all of them)", min=0)
    ] = 50,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A run's prompt passes (runs whose generators take work from the broker): each one's
    state, attempt and tries, in prompt order (from the accounting; may trail by a second)."""
    with _broker(url, token) as broker:
        counts = None if as_json else broker.accounting(run_id).prompts
        page_size = min(limit + 1, 1000) if limit else 1000
        found = broker.prompt_states(run_id, state, page_size=page_size)
        rows = list(itertools.islice(found, limit + 1 if limit else None))
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    if as_json:
        docs = [
            {"prompt_id": r.prompt_id, "pass": r.pass_, "attempt": r.attempt, "state": r.state,
             "tries": r.tries}
            for r in rows
        ]  # fmt: skip
        typer.echo(json.dumps(docs, indent=2))
    else:
        _console().print(prompts_table(run_id, rows, counts, more))


# -- access: tokens and the audit log -------------------------------------------------------------


class ScopeName(StrEnum):
    """The scopes of a token (the client's ``Scope``), spelled here for typer to read."""

    GENERATE = "generate"
    TRAIN = "train"
    OPERATE = "operate"
    ADMIN = "admin"


SECRET_WARNING = (
    "warning: the token is shown only this once (the broker keeps only a digest of it): "
    "store it now"
)


def _when(at: datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at is not None else "–"


def tokens_table(rows: list[AccessToken]) -> RenderableType:
    """The tokens, newest first, revoked ones marked; never a secret (the broker has none)."""
    from rich import box
    from rich.table import Table

    table = Table(title="Tokens", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("token_id", "name", "scopes", "runs", "created_at", "created_by", "status"):
        table.add_column(col)
    for t in rows:
        table.add_row(
            t.token_id,
            t.name,
            ",".join(t.scopes),
            "all" if t.runs is None else ",".join(t.runs),
            _when(t.created_at),
            t.created_by or "–",
            f"revoked {_when(t.revoked_at)}" if t.revoked else "active",
        )
    return table


@tokens_cli.command("create")
def tokens_create(
    name: Annotated[str, typer.Argument(help="Who holds the token: the audit log names it")],
    scope: Annotated[
        list[ScopeName],
        typer.Option(
            "--scope",
            "-s",
            help="What the token may do: generate, train, operate or admin; repeat for more",
        ),
    ],
    run: Annotated[
        list[str] | None,
        typer.Option(
            "--run",
            "-r",
            help="A run id or prefix* pattern the token may touch; repeat for more "
            "(default: every run)",
        ),
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a token (needs an admin token) and print its id and its secret, once."""
    with _broker(url, token) as broker:
        scopes = cast("list[Scope]", [s.value for s in scope])
        new = broker.create_token(name, scopes, run or None)
    if as_json:
        _print_json(new)
    else:
        typer.echo(f"token_id: {new.token_id}")
        typer.echo(f"token:    {new.token}")
    typer.echo(SECRET_WARNING, err=True)


@tokens_cli.command("list")
def tokens_list(
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Every token, newest first, revoked ones included; no secret is ever shown."""
    with _broker(url, token) as broker:
        rows = broker.list_tokens()
    _show(rows, as_json, tokens_table)


@tokens_cli.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (from `tokens list`)")],
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Revoke a token: every API process of the broker refuses it within a second (revoking
    it again changes nothing)."""
    from rollout_broker_client._wire import token_id_of

    with _broker(url, token) as broker:
        broker.revoke_token(token_id)
    typer.echo(f"token {token_id_of(token_id)} revoked")


def audit_table(rows: list[AuditEntry], more: bool) -> RenderableType:
    from rich import box
    from rich.table import Table

    table = Table(
        title="Audit log, newest first",
        caption=f"{len(rows):,} shown; more with --limit (0: all)" if more else None,
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for col in ("id", "at", "actor", "action", "run_id", "detail"):
        table.add_column(col, justify="right" if col == "id" else "left")
    for e in rows:
        table.add_row(
            str(e.id),
            _when(e.at),
            e.actor,
            e.action,
            e.run_id or "–",
            json.dumps(e.detail, sort_keys=True, separators=(",", ":")),
        )
    return table


@cli.command()
def audit(
    run: Annotated[
        str | None, typer.Option("--run", help="Only this run's entries", callback=_run_id)
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Show at most this many entries (0: all of them)", min=0)
    ] = 50,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Operator actions, newest first: who (the token's name) created, changed, closed or
    deleted which run, set its policy version, or created or revoked a token (scope operate)."""
    with _broker(url, token) as broker:
        page_size = min(limit + 1, 1000) if limit else 1000
        found = broker.audit_entries(run, page_size=page_size)
        rows = list(itertools.islice(found, limit + 1 if limit else None))
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    if as_json:
        _print_json(rows)
    else:
        _console().print(audit_table(rows, more))


# -- watch ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Frame:
    run: Run
    acc: Accounting | None
    at: float
    error: str | None = None


def watch_view(now: _Frame, before: _Frame | None) -> RenderableType:
    """One frame of ``watch``: the buffer, the flow since the last frame, prompt passes, waits,
    lag, reuse and KL."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    run, acc = now.run, now.acc
    cfg = run.config
    head = (
        f"[bold]{run.run_id}[/]  {run.status}  policy v{run.policy_version}  "
        f"max_staleness {cfg.get('max_staleness')}  max_reuse {cfg.get('max_reuse')}  "
        f"kl_max {cfg.get('kl_max')}"
    )
    if acc is None:
        return Panel(f"{head}\naccounting unavailable: {now.error}", title="rollout-broker watch")

    def change(read: Callable[[Accounting], float], unit: str) -> str:
        if before is None or before.acc is None or now.at <= before.at:
            return ""
        return f"{(read(acc) - read(before.acc)) / (now.at - before.at):,.1f}{unit}"

    def rate(field: str) -> str:
        return change(lambda a: float(getattr(a, field)), "/s")

    flow = Table(show_header=False, box=None, pad_edge=False)
    flow.add_column("what")
    flow.add_column("count", justify="right")
    flow.add_column("notes")
    cap = cfg.get("capacity_rollouts")
    flow.add_row("buffered", _fmt(acc.buffered), f"of capacity {cap:,}" if cap else "")
    flow.add_row("leased", _fmt(acc.leased), "")
    flow.add_row("rollouts received", _fmt(acc.rollouts_received), rate("rollouts_received"))
    flow.add_row("samples consumed", _fmt(acc.samples_consumed), rate("samples_consumed"))
    flow.add_row("reuse factor", _fmt(acc.reuse_factor, 3), "")
    p = acc.prompts
    done = change(lambda a: a.prompts.done, " done/s")
    flow.add_row(
        "prompt passes", _fmt(p.registered), _prompt_line(p) + (f", {done}" if done else "")
    )
    # Seconds waited per second: how many requests were waiting at a time, on average.
    busy = change(lambda a: a.wait.generator_s, " waiting on average")
    flow.add_row("generators waited", _seconds(acc.wait.generator_s), busy)
    busy = change(lambda a: a.wait.trainer_s, " waiting on average")
    flow.add_row("trainers waited", _seconds(acc.wait.trainer_s), busy)
    flow.add_row("retired", _fmt(acc.retired_total), _reasons(acc.retired))
    ok, why = ledger_check(acc)
    flow.add_row("ledger = live", "✓" if ok else "✗", why)
    flow.add_row("KL", f"mean {_fmt(acc.kl.mean, 3)}", f"max {_fmt(acc.kl.max, 3)}")
    flow.add_row(
        "IS ratio",
        f"mean {_fmt(acc.is_ratio.mean, 4)}",
        f"clip {_fmt(acc.is_ratio.clip_fraction, 3)}",
    )
    lag = f"lag mean {_fmt(acc.lag.mean, 3)}, max {_fmt(acc.lag.max)}\n" + _histogram(
        acc.lag.histogram
    )
    pending = f"  ({acc.pending_events} events pending)" if acc.pending_events else ""
    return Panel(
        Group(head + pending, flow, lag),
        title="rollout-broker watch",
        subtitle=time.strftime("%H:%M:%S"),
    )


def _frame(broker: BrokerClient, run_id: str) -> _Frame:
    from rollout_broker_client import NotFound

    run = broker.get_run(run_id)
    try:
        acc = broker.accounting(run_id)
    except NotFound as err:  # a server without the accounting API, or one not caught up yet
        return _Frame(run, None, time.monotonic(), err.detail)
    return _Frame(run, acc, time.monotonic())


def waiting_view(run_id: str, why: str) -> RenderableType:
    """A frame of ``watch`` while there is nothing to show yet, and why."""
    from rich.panel import Panel

    return Panel(
        f"[bold]{run_id}[/]  waiting: {why}",
        title="rollout-broker watch",
        subtitle=time.strftime("%H:%M:%S"),
    )


@cli.command()
def watch(
    run_id: RunArg,
    url: Url = "http://127.0.0.1:8000",
    token: Token = None,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes", min=0.05)] = 1.0,
    count: Annotated[
        int | None, typer.Option(help="Stop after this many refreshes (default: until Ctrl-C)")
    ] = None,
) -> None:
    """A live view of a run: buffered, leased, flow rates, prompt passes, waits, lag histogram,
    reuse factor, KL. A broker that cannot be reached or is unavailable, and a run that does
    not exist yet, are shown as such and tried again at the next refresh."""
    from rich.live import Live
    from rollout_broker_client import BrokerUnreachable, Retry, RunNotFound, ServerError

    console = _console()
    # One attempt a refresh: the refreshes are the retries.
    with _broker(url, token, retry=Retry(retries=0)) as broker:
        before: _Frame | None = None
        shown = 0
        live = Live(console=console, auto_refresh=False) if console.is_terminal else None
        with live if live is not None else contextlib.nullcontext():
            try:
                while count is None or shown < count:
                    if shown:
                        time.sleep(interval)
                    view: RenderableType
                    try:
                        now = _frame(broker, run_id)
                    except RunNotFound:
                        view = waiting_view(run_id, f"no run {run_id!r} (yet)")
                    except BrokerUnreachable as err:
                        view = waiting_view(run_id, f"cannot reach the broker at {url}: {err}")
                    except ServerError as err:  # 5xx: an outage of its Redis or Postgres
                        view = waiting_view(run_id, f"{err.error}: {err.detail}")
                    else:
                        view = watch_view(now, before)
                        before = now
                    if live is not None:
                        live.update(view, refresh=True)
                    else:  # not a terminal: one frame after the other
                        console.print(view)
                    shown += 1
            except KeyboardInterrupt:
                pass


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
