"""Starting and stopping both servers under one data directory: its lock, the order of the
steps, the wait until both accept connections, and the handle that stops them."""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import platformdirs

from app.embedded.common import EmbeddedStartError, Server, check_running, child_env, log
from app.embedded.postgres import (
    PG_SHUTDOWN,
    postgres_account,
    postgres_binaries,
    postgres_root,
    start_postgres,
)
from app.embedded.processes import Runtime, lock_data_dir, stop_leftover
from app.embedded.redis import REDIS_SHUTDOWN, redis_binary, start_redis

SERVICE_ACCOUNT = "rollout-broker"
"""System account that runs the embedded Postgres when the broker runs as root."""


def default_data_dir() -> Path:
    """Per-user data directory of the embedded services, e.g. ``~/.local/share/rollout-broker``."""
    return platformdirs.user_data_path("rollout-broker", appauthor=False)


@dataclass(frozen=True)
class EmbeddedServices:
    """Running embedded Redis and Postgres. Stop with :meth:`stop` or use as a context manager."""

    redis_url: str
    """``unix://`` URL accepted by ``redis.asyncio.from_url``."""
    database_url: str
    """``postgresql+asyncpg://`` URL over the Unix socket, for SQLAlchemy async + asyncpg."""
    data_dir: Path
    redis_pid: int
    postgres_pid: int
    """Pid of the postmaster, which is also the process group of every Postgres process."""
    _runtime: Runtime = field(repr=False, compare=False)

    def stop(self) -> None:
        """Stop both servers and release the data directory. Idempotent and thread-safe."""
        self._runtime.stop()

    def __enter__(self) -> EmbeddedServices:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_embedded(
    data_dir: Path,
    *,
    start_timeout: float = 120.0,
    service_account: str = SERVICE_ACCOUNT,
) -> EmbeddedServices:
    """Start (initialising on first use) Redis and Postgres under ``data_dir``.

    ``start_timeout`` bounds the wait for both servers to accept connections; it includes loading
    a large AOF and Postgres crash recovery after an unclean stop. ``service_account`` is the
    account that runs Postgres when the caller is root; it is ignored otherwise.

    Raises :class:`DataDirInUseError` if the directory is in use, :class:`EmbeddedStartError` for
    any other failure (with the server log's tail); nothing is left running on failure.
    """
    if sys.platform == "win32":
        raise EmbeddedStartError(
            "embedded services are not supported on Windows; set BROKER_REDIS_URL and "
            "BROKER_DATABASE_URL"
        )
    data_dir = data_dir.expanduser()
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # not writable, a file in the way, ...
        raise EmbeddedStartError(
            f"cannot create the data directory {data_dir}: {exc.strerror or exc}; give "
            "another one with --data-dir (or BROKER_DATA_DIR)"
        ) from exc
    data_dir = data_dir.resolve()
    runtime = Runtime(lock_data_dir(data_dir))
    atexit.register(runtime.stop)
    try:
        return _start(data_dir, runtime, start_timeout, service_account)
    except BaseException:
        runtime.stop()
        raise


def _start(
    data_dir: Path, runtime: Runtime, start_timeout: float, service_account: str
) -> EmbeddedServices:
    t0 = time.monotonic()
    redis_server = redis_binary()
    pg_root = postgres_root()
    pg_binaries = postgres_binaries(pg_root)

    log_dir = data_dir / "log"
    redis_dir = data_dir / "redis"
    pgdata = data_dir / "postgres"
    for d in (log_dir, redis_dir):
        d.mkdir(mode=0o700, exist_ok=True)

    account = postgres_account(data_dir, pgdata, pg_root, service_account)
    env = child_env()

    # Servers left behind by a previous owner of this directory.
    stop_leftover("redis", redis_dir / "redis.pid", "redis-server", REDIS_SHUTDOWN)
    stop_leftover("postgres", pgdata / "postmaster.pid", str(pgdata), PG_SHUTDOWN)

    # Redis first: it loads its AOF while Postgres initialises and starts.
    redis = start_redis(redis_server, redis_dir, log_dir / "redis.log", env)
    runtime.children.append(("redis", redis.proc, REDIS_SHUTDOWN))
    pg = start_postgres(pg_binaries, pgdata, log_dir / "postgres.log", account, env)
    runtime.children.append(("postgres", pg.proc, PG_SHUTDOWN))

    _wait_ready((redis, pg), start_timeout, log_dir)
    log.info(
        "embedded Redis (pid %d) and Postgres (pid %d) ready in %.2f s under %s",
        redis.proc.pid,
        pg.proc.pid,
        time.monotonic() - t0,
        data_dir,
    )
    return EmbeddedServices(
        redis_url=redis.url,
        database_url=pg.url,
        data_dir=data_dir,
        redis_pid=redis.proc.pid,
        postgres_pid=pg.proc.pid,
        _runtime=runtime,
    )


def _wait_ready(servers: Sequence[Server], start_timeout: float, log_dir: Path) -> None:
    """Until every server accepts connections; a server that exits, or a wait past
    ``start_timeout``, is an :class:`EmbeddedStartError`."""
    deadline = time.monotonic() + start_timeout
    ready = dict.fromkeys((s.name for s in servers), False)
    while not all(ready.values()):
        for server in servers:
            if not ready[server.name]:
                check_running(server.name, server.proc, server.log_path)
                ready[server.name] = server.ready()
        if time.monotonic() > deadline:
            waiting = " and ".join(name for name, ok in ready.items() if not ok)
            raise EmbeddedStartError(
                f"embedded {waiting} not ready after {start_timeout:.0f} s; logs in {log_dir}"
            )
        if not all(ready.values()):
            time.sleep(0.01)
