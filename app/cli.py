"""The ``rollout-broker`` command: run the API, the workers and the migrations, beside the
operator commands (``runs``, ``policy``, ``batches``, ``accounting``, ``prompts``, ``watch``,
``tokens``, ``audit``) and the global options (``--url``, ``--token``, ``--version``), which
the client's command line (``rollout_broker_client.cli``) mounts here.

Every error ends a command with one line on stderr (``error: ...``) and a non-zero status:
``1`` for what went wrong at run time, ``2`` for a bad command line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rollout_broker_client.cli.app import mount

from app import __version__
from app.settings import Settings

cli = typer.Typer(
    help="Rollout Broker: versioned rollouts in, leased batches out, exact sample accounting.",
    no_args_is_help=True,
    add_completion=False,
)


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
    from app.access.startup import AuthSetupError, is_loopback, resolve_auth, served_on

    try:
        resolved = served_on(resolve_auth(settings, host), host)
    except AuthSetupError as exc:
        raise _fail(str(exc)) from None
    if resolved.auth:
        typer.echo("auth is on: every /v1 request needs a bearer token", err=True)
    elif not is_loopback(host):
        typer.echo(
            f"warning: auth is off (BROKER_AUTH=off) on {host}: whoever reaches the port may "
            "do anything (addressing it by IP address, localhost or a name of "
            "BROKER_ALLOWED_HOSTS)",
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


NO_WORKERS = (
    "warning: no background workers in this process: the accounting is not drained and /readyz "
    "answers 503 until `rollout-broker worker` runs (or start `serve --with-workers`)"
)


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
    (and migrate them, and run the workers in this process); against configured ones, /readyz
    answers 503 until `migrate` ran and a worker runs (`rollout-broker worker`, or
    --with-workers).
    Auth (BROKER_AUTH) is on for a non-loopback --host unless set off; with it on, set
    BROKER_ADMIN_TOKEN (or have an admin token in the database) to create tokens with."""
    import uvicorn

    from app.main import create_app
    from app.serving import uvicorn_options
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
        _refuse_old_redis(settings)
        if migrate:
            assert settings.database_url is not None
            _upgrade(settings.database_url)
        # Decided on the final settings (the embedded services' URLs), after any migration,
        # so that an admin token stored in the database is found.
        settings = _auth_settings(settings, host)
        if not settings.workers_in_process:  # once, whatever the API processes; not when
            typer.echo(NO_WORKERS, err=True)  # serve refuses to start anyway
        if api_processes > 1:
            _serve_processes(settings, host, port, api_processes)
            return
        app = create_app(settings, background=run_workers if settings.workers_in_process else None)
        uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_options(settings))
    finally:
        if services is not None:
            services.stop()  # type: ignore[attr-defined]


def _refuse_old_redis(settings: Settings) -> None:
    """A Redis older than 7.0 ends the command with its one line, before any migration or API
    process (each API process's start would refuse it too, with a traceback)."""
    from app.wiring import RedisTooOldError, check_redis_version, redis_client

    async def check() -> None:
        client = redis_client(settings)
        try:
            await check_redis_version(client, settings)
        finally:
            await client.aclose()

    try:
        asyncio.run(check())
    except RedisTooOldError as exc:
        raise _fail(str(exc)) from None


def _serve_processes(settings: Settings, host: str, port: int, processes: int) -> None:
    """``processes`` uvicorn workers on one port. Each builds its app from the environment
    (``app.main:create_app``), where the final settings are put for it; the background workers,
    if any, run once, here beside uvicorn's supervisor, never in the API processes. Their
    request metrics are summed through a folder of this command's own, removed at exit."""
    import shutil
    import tempfile

    import uvicorn

    from app.metrics import MULTIPROC_DIR
    from app.serving import uvicorn_options

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
                    **uvicorn_options(api),
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
        elif isinstance(value, tuple):
            value = ",".join(value)
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
    from app.wiring import RedisTooOldError
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
        try:
            await run_workers(settings, stop)
        except RedisTooOldError as exc:
            typer.echo(f"error: {exc}", err=True)
            return 1
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


# The operator commands and the global options, from the client (listed after the server's).
mount(cli, name="rollout-broker", version=__version__)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
