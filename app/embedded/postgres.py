"""The embedded Postgres: the binaries bundled by ``pgserver``, the cluster (created by initdb on
first use), the account it runs as (an unprivileged one when the broker runs as root) and its
readiness."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from app.embedded.accounts import Account, grant_read_tree, grant_search, system_account
from app.embedded.common import (
    EmbeddedStartError,
    Server,
    ShutdownPlan,
    binary,
    log,
    log_file,
    log_tail,
    package_dir,
    socket_dir,
)
from app.embedded.processes import parent_death_hook

_PG_PORT = 5432  # only names the socket file (.s.PGSQL.5432); no TCP port is opened
_PG_USER = "postgres"
_PG_DATABASE = "postgres"

PG_SHUTDOWN: ShutdownPlan = ((signal.SIGINT, 60.0), (signal.SIGQUIT, 5.0))  # fast, immediate


def postgres_root() -> Path:
    """The bundled installation (bin/, lib/, share/)."""
    return package_dir("pgserver") / "pginstall"


def postgres_binaries(pg_root: Path) -> tuple[Path, Path]:
    """initdb and postgres."""
    initdb = binary(pg_root / "bin" / "initdb", "pgserver")
    postgres = binary(pg_root / "bin" / "postgres", "pgserver")
    return initdb, postgres


def postgres_account(
    data_dir: Path, pgdata: Path, pg_root: Path, service_account: str
) -> Account | None:
    """The account Postgres runs as when the broker runs as root (None: the caller's), which
    can reach the cluster and the binaries; the cluster must be the running account's."""
    account = system_account(service_account) if os.geteuid() == 0 else None
    pg_uid = account.uid if account else os.geteuid()
    if (pgdata / "PG_VERSION").exists() and (owner := pgdata.stat().st_uid) != pg_uid:
        raise EmbeddedStartError(
            f"{pgdata} belongs to uid {owner}, but Postgres runs as uid {pg_uid} here; run the "
            "broker as the user that created it, or use another data directory"
        )
    if account:
        grant_search(data_dir, account)
        grant_search(pg_root, account)
        grant_read_tree(pg_root, account)
    return account


def start_postgres(
    binaries: tuple[Path, Path],
    pgdata: Path,
    log_path: Path,
    account: Account | None,
    env: dict[str, str],
) -> Server:
    """Start Postgres on ``pgdata`` (created first if it holds no cluster) as ``account``,
    logging to ``log_path``; returns once it runs, not yet ready (crash recovery, ...)."""
    initdb, postgres = binaries
    pg_uid = account.uid if account else os.geteuid()
    with log_file(log_path) as fd:
        if not (pgdata / "PG_VERSION").exists():
            _initdb(initdb, pgdata, account, env, fd, log_path)
        sock_dir = socket_dir(pgdata, f".s.PGSQL.{_PG_PORT}", pg_uid)
        proc = subprocess.Popen(
            [
                str(postgres),
                "-D",
                str(pgdata),
                "-p",
                str(_PG_PORT),
                "-h",
                "",
                "-k",
                _pg_quote_list_item(sock_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=pgdata,
            env=env,
            start_new_session=True,
            preexec_fn=parent_death_hook(signal.SIGINT),
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
        )
    url = (
        f"postgresql+asyncpg://{_PG_USER}@:{_PG_PORT}/{_PG_DATABASE}"
        f"?host={quote(str(sock_dir), safe='/')}"
    )
    return Server("postgres", proc, log_path, lambda: _postgres_ready(pgdata, proc.pid), url)


def _pg_quote_list_item(value: Path) -> str:
    return '"' + str(value).replace('"', '""') + '"'


def _initdb(
    initdb: Path,
    pgdata: Path,
    account: Account | None,
    env: dict[str, str],
    log_fd: int,
    log_path: Path,
) -> None:
    """Create the cluster in a scratch directory, then rename it into place (atomic)."""
    if pgdata.exists():
        try:
            pgdata.rmdir()  # an empty directory is fine
        except OSError:
            raise EmbeddedStartError(
                f"{pgdata} exists but is not a Postgres cluster (no PG_VERSION); move it away"
            ) from None
    scratch = pgdata.with_name(pgdata.name + ".initdb")
    if scratch.exists():
        shutil.rmtree(scratch)  # an interrupted earlier attempt
    scratch.mkdir(mode=0o700)
    if account:
        os.chown(scratch, account.uid, account.gid)
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [
                str(initdb),
                "-D",
                str(scratch),
                "-U",
                _PG_USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-instructions",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            cwd=scratch,
            env=env,
            timeout=300,
            check=False,
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
        )
    except subprocess.TimeoutExpired:
        raise EmbeddedStartError(f"initdb timed out; see {log_path}") from None
    if done.returncode != 0:
        raise EmbeddedStartError(
            f"initdb failed (exit status {done.returncode}):\n{log_tail(log_path)}"
        )
    scratch.rename(pgdata)
    log.info("initialised the embedded Postgres cluster in %.2f s", time.monotonic() - t0)


def _postgres_ready(pgdata: Path, pid: int) -> bool:
    """True once postmaster.pid says ``ready`` for this postmaster (what ``pg_ctl -w`` checks)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"
