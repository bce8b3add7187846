"""The ``rollout-broker`` command: run the API, the workers, the migrations."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from app.settings import Settings

cli = typer.Typer(
    help="Rollout Broker: versioned rollouts in, leased batches out, exact sample accounting.",
    no_args_is_help=True,
    add_completion=False,
)


def _embedded_settings(settings: Settings, data_dir: Path | None) -> tuple[Settings, object]:
    from app.embedded import default_data_dir, start_embedded

    folder = data_dir or settings.data_dir or default_data_dir()
    services = start_embedded(folder)
    typer.echo(f"embedded Redis and Postgres under {folder}", err=True)
    updated = settings.model_copy(
        update={
            "redis_url": services.redis_url,
            "database_url": services.database_url,
            "workers_in_process": True,
        }
    )
    return updated, services


@cli.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind")] = 8000,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data folder of the embedded services")
    ] = None,
    with_workers: Annotated[
        bool, typer.Option(help="Also run the background workers in this process")
    ] = False,
) -> None:
    """Run the HTTP API. With no BROKER_REDIS_URL / BROKER_DATABASE_URL, start embedded ones."""
    import uvicorn

    from app.main import create_app

    settings = Settings()
    services = None
    if settings.embedded:
        settings, services = _embedded_settings(settings, data_dir)
    if with_workers:
        settings = settings.model_copy(update={"workers_in_process": True})
    _migrate_if_configured(settings)
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    finally:
        if services is not None:
            services.stop()  # type: ignore[attr-defined]


def _migrate_if_configured(settings: Settings) -> None:
    if settings.database_url is None:
        return
    try:
        from app.accounting.db import upgrade_to_head
    except ImportError:  # accounting not installed in this build
        return
    upgrade_to_head(settings.database_url)


@cli.command()
def worker(
    interval: Annotated[float, typer.Option(help="Seconds between maintenance sweeps")] = 1.0,
) -> None:
    """Run the background workers only (lease expiry, group timeouts, accounting drain)."""
    from workers.runner import run_workers

    logging.basicConfig(level=logging.INFO)
    settings = Settings()
    if settings.redis_url is None:
        raise typer.BadParameter("set BROKER_REDIS_URL (and BROKER_DATABASE_URL) for `worker`")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_workers(settings.model_copy(update={"sweep_interval_s": interval}), stop)

    asyncio.run(main())


@cli.command()
def migrate() -> None:
    """Upgrade the accounting database to the latest schema (Alembic upgrade head)."""
    settings = Settings()
    if settings.database_url is None:
        raise typer.BadParameter("set BROKER_DATABASE_URL for `migrate`")
    from app.accounting.db import upgrade_to_head

    upgrade_to_head(settings.database_url)
    typer.echo("database is at the latest schema")


def main() -> None:
    cli()
